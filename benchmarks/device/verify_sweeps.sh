#!/usr/bin/env bash
# One device call for the mirrored causal tile order (KernelOptions.mirrored_tiles, the causal default;
# docs/sm90_forward_tuning.md "Fifth round"):
#   tests   the sm90 forward file (every causal case now in the mirrored order, and
#           test_mirrored_order_on_few_ctas_matches_oracle with several units a CTA), without the variant
#           cases of the old order (all-pairs-order: the previous default, tested before) and of the
#           candidates measured and left off (d64-poly, d192-n112)
#   timing  the forward variant rows (benchmarks/attention.py --variants): default (mirrored) against
#           all-pairs-order and cuDNN, causal rows first; then D = 128 full 16k / 4k with heads-interleaved-4
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
timeout 280 python3 -m pytest -v -n 10 -p no:cacheprovider --timeout 250 tests/test_sm90_forward.py \
  -k "not all-pairs-order and not d64-poly and not d192-n112" --junitxml="$OUT/forward_tests.xml" > "$OUT/gpu_tests.log" 2>&1
echo "pytest rc=$?" >> "$OUT/gpu_tests.log"
grep -E "^(FAILED|ERROR)|passed|failed|pytest rc" "$OUT/gpu_tests.log" | tail -8
wait $VARIANTS; tail -1 "$OUT/compile_variants.log"
timeout 200 python3 benchmarks/attention.py --variants --iterations 10 --max-seconds 140 \
  --exclude-failed "$OUT/forward_tests.xml" --out "$OUT/forward_variants.json" > "$OUT/forward_bench.log" 2>&1
echo "forward bench rc=$?"; grep -E "^D=" "$OUT/forward_bench.log" | tail -14
wait $PRE; grep -E "precompiled|compiled" "$OUT/precompile.log"
