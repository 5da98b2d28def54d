#!/usr/bin/env bash
# One device call for the causal tile order in L2-sized head chunks (KernelOptions.head_group,
# docs/sm90_forward_tuning.md "Fifth round"):
#   tests   the whole sm90 forward file (the new default order where the shapes pick it, and
#           test_head_groups_match_oracle forcing small chunks), without all-pairs-order's variant
#           cases (head_group=0: the order the small test shapes take anyway)
#   timing  the forward variant rows (benchmarks/attention.py --variants): default (chunked) against
#           all-pairs-order and cuDNN, causal short rows first
# Meanwhile the CPU precompiles hopper_vs_peers.py's kernels into /tmp/fa4_kernels for the next call.
# Usage (device machine, repo root, bundle sourced): bash benchmarks/device/verify_sweeps.sh REV
set -u
REV=$1
OUT=${OUT:-/tmp/out}
export PYTHONPATH=$PWD:$PYTHONPATH CUTE_DSL_ARCH=sm_90a FA4_GIT_REVISION=$REV FA4_JAX_CACHE_DIR=/tmp/fa4_kernels \
  PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
JAX_PLATFORMS=cpu timeout 150 python3 benchmarks/attention.py --compile-only --compile-workers 6 \
  > "$OUT/compile_variants.log" 2>&1 &
VARIANTS=$!
(JAX_PLATFORMS=cpu timeout 240 python3 benchmarks/hopper_vs_peers.py --precompile-only --precompile-workers 5
 JAX_PLATFORMS=cpu timeout 120 python3 benchmarks/hopper_vs_peers.py --grid head-dims --precompile-only --precompile-workers 5) \
  > "$OUT/precompile.log" 2>&1 &
PRE=$!
timeout 240 python3 -m pytest -v -n 8 -p no:cacheprovider --timeout 200 tests/test_sm90_forward.py \
  -k "not all-pairs-order" --junitxml="$OUT/forward_tests.xml" > "$OUT/gpu_tests.log" 2>&1
echo "pytest rc=$?" >> "$OUT/gpu_tests.log"
grep -E "^(FAILED|ERROR)|passed|failed|pytest rc" "$OUT/gpu_tests.log" | tail -8
wait $VARIANTS; tail -1 "$OUT/compile_variants.log"
timeout 200 python3 benchmarks/attention.py --variants --iterations 10 --max-seconds 170 \
  --exclude-failed "$OUT/forward_tests.xml" --out "$OUT/forward_variants.json" > "$OUT/forward_bench.log" 2>&1
echo "forward bench rc=$?"; grep -E "^D=" "$OUT/forward_bench.log" | tail -14
wait $PRE; grep -E "precompiled|compiled" "$OUT/precompile.log"
