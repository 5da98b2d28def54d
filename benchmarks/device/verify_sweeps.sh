#!/usr/bin/env bash
# One device call after next_sweeps.sh's results were acted on (docs/sm90_backward_tuning.md):
#   tests   the shipped backward with its only query-stage release (per thread) and the large-head
#           backward's diagonal-first default (oracle, default and deterministic; at D = 64 the default
#           splits dQ by rows), the column split it replaced with its 128 rows forced, the forward's
#           d64-poly candidates; then memcheck and racecheck of every sanitizer case in one process
#   timing  D = 64 backward: poly_exp2_6 on top of the per-thread release, dq_column_split and its
#           deterministic twin (only those whose tests passed); the forward variant rows (d64-poly,
#           mla-n128) without a failed test
# Meanwhile the CPU precompiles hopper_vs_peers.py's kernels into /tmp/fa4_kernels for the next call.
# Usage (device machine, repo root, bundle sourced): bash benchmarks/device/verify_sweeps.sh REV
set -u
REV=$1
OUT=${OUT:-/tmp/out}
export PYTHONPATH=$PWD:$PYTHONPATH CUTE_DSL_ARCH=sm_90a FA4_GIT_REVISION=$REV FA4_JAX_CACHE_DIR=/tmp/fa4_kernels \
  PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
SMALL="--variants default poly_exp2_6 dq_column_split deterministic deterministic_dq_column_split --head-dims 64
       --seq-lens 1024 4096"
(JAX_PLATFORMS=cpu timeout 150 python3 benchmarks/attention_backward.py --precompile-only --precompile-workers 4 $SMALL
 JAX_PLATFORMS=cpu timeout 150 python3 benchmarks/attention.py --compile-only --compile-workers 4
 JAX_PLATFORMS=cpu timeout 240 python3 benchmarks/hopper_vs_peers.py --precompile-only --precompile-workers 6
 JAX_PLATFORMS=cpu timeout 120 python3 benchmarks/hopper_vs_peers.py --grid head-dims --precompile-only --precompile-workers 6) \
  > "$OUT/precompile.log" 2>&1 &
PRE=$!
timeout 230 python3 -m pytest -v -n 10 -p no:cacheprovider --timeout 200 \
  tests/test_sm90_backward.py::test_backward_matches_oracle tests/test_sm90_backward.py::test_deterministic_matches_oracle \
  tests/test_sm90_backward.py::test_wide_query_blocks_match_oracle tests/test_sm90_backward_large_heads.py::test_backward_matches_oracle \
  tests/test_sm90_forward.py \
  -k "(test_backward_matches_oracle and (default or poly_exp2_6 or lowest_first or deterministic)) or (test_deterministic_matches_oracle and default) or dq_column_split or d64-poly" > "$OUT/gpu_tests.log" 2>&1
echo "pytest rc=$?" >> "$OUT/gpu_tests.log"
grep -E "^(FAILED|ERROR)|passed|failed|pytest rc" "$OUT/gpu_tests.log" | tail -8
timeout 150 python3 benchmarks/attention_backward.py --out "$OUT/backward_d64_candidates.json" $SMALL \
  --iterations 10 --variants-passing "$OUT/gpu_tests.log" > "$OUT/backward_bench.log" 2>&1
echo "backward bench rc=$?"; tail -6 "$OUT/backward_bench.log"
timeout 100 python3 benchmarks/attention.py --variants --iterations 10 --max-seconds 80 \
  --out "$OUT/forward_variants.json" > "$OUT/forward_bench.log" 2>&1
echo "forward bench rc=$?"; grep -E "^D=" "$OUT/forward_bench.log" | tail -8
bash benchmarks/device/sanitize_all.sh 120
wait $PRE; grep -E "precompiled|compiled" "$OUT/precompile.log"
