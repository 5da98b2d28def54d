#!/usr/bin/env bash
# One device call for the two deterministic-backward candidates (docs/sm90_backward_tuning.md, last two
# sections; issue 12 asks deterministic >= 0.85x of the default):
#   Tuning.dq_free_on_read  the dQ writer frees its staging buffer once read, passes the turn at completion
#   Tuning.rotated_turns    full-mask walks start at the key block's own query block, turns in arrival order
# Their GPU tests (deterministic oracle, head splits, bitwise reproducibility, sanitizer shapes, the rotated
# walk's own cases) while the CPU compiles the timed kernels; then D = 64 / 128, 1k / 4k, full and causal
# (the rotated variant skips causal rows), each timed only if its tests passed.
# Usage (device machine, repo root, bundle sourced): bash benchmarks/device/backward_deterministic.sh REV
set -u
REV=$1
OUT=${OUT:-/tmp/out}
export PYTHONPATH=$PWD:$PYTHONPATH CUTE_DSL_ARCH=sm_90a FA4_GIT_REVISION=$REV FA4_JAX_CACHE_DIR=/tmp/fa4_kernels \
  PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
BACKWARD="--variants default deterministic deterministic_dq_free_on_read deterministic_rotated_turns
  --head-dims 64 128 --seq-lens 1024 4096"
JAX_PLATFORMS=cpu timeout 200 python3 benchmarks/attention_backward.py --precompile-only --precompile-workers 4 \
  $BACKWARD > "$OUT/precompile_backward.log" 2>&1 &
PRE=$!
timeout 240 python3 -m pytest -v -n 12 -p no:cacheprovider --timeout 230 tests/test_sm90_backward.py \
  -k "(dq_free_on_read or rotated_turns) and (deterministic or reproducible or test_rotated_turns_match_oracle)" \
  > "$OUT/backward_tests.log" 2>&1
echo "pytest rc=$?" >> "$OUT/backward_tests.log"
grep -E "^(FAILED|ERROR)|passed|failed|pytest rc" "$OUT/backward_tests.log" | tail -8
wait $PRE; tail -1 "$OUT/precompile_backward.log"
timeout 150 python3 benchmarks/attention_backward.py --out "$OUT/backward_deterministic.json" $BACKWARD \
  --iterations 10 --variants-passing "$OUT/backward_tests.log" > "$OUT/backward_bench.log" 2>&1
echo "backward bench rc=$?"; tail -14 "$OUT/backward_bench.log"
