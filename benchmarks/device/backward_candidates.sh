#!/usr/bin/env bash
# The backward candidates' device call (backward_deterministic.sh and backward_mla_prefetch.sh say which): the
# candidates' GPU tests while the CPU compiles the timed kernels, then attention_backward.py over the
# given variants and shapes, a candidate timed only if its tests passed. Logs and the JSON go to $OUT
# under NAME.
# Usage (device machine, repo root, bundle sourced):
#   bash benchmarks/device/backward_candidates.sh REV NAME TEST_FILES PYTEST_K BENCHMARK_ARGS...
# TEST_FILES: one test file, or several separated by spaces in one argument. TEST_LIMIT and BENCH_LIMIT
# (environment, seconds; 240 and 150 by default) bound the tests and the timing, so that both fit one call.
set -u
REV=$1 NAME=$2 TEST_FILES=$3 SELECT=$4
TEST_LIMIT=${TEST_LIMIT:-240} BENCH_LIMIT=${BENCH_LIMIT:-150}
shift 4
OUT=${OUT:-/tmp/out}
export PYTHONPATH=$PWD:${PYTHONPATH:-} CUTE_DSL_ARCH=sm_90a FA4_GIT_REVISION=$REV FA4_JAX_CACHE_DIR=/tmp/fa4_kernels \
  PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
JAX_PLATFORMS=cpu timeout 200 python3 benchmarks/attention_backward.py --precompile-only --precompile-workers 4 \
  "$@" > "$OUT/precompile_$NAME.log" 2>&1 &
PRE=$!
# shellcheck disable=SC2086  # TEST_FILES splits into its files on purpose
timeout "$TEST_LIMIT" python3 -m pytest -v -n 12 -p no:cacheprovider --timeout $((TEST_LIMIT - 10)) $TEST_FILES -k "$SELECT" \
  > "$OUT/${NAME}_tests.log" 2>&1
echo "pytest rc=$?" >> "$OUT/${NAME}_tests.log"
grep -E "^(FAILED|ERROR)|passed|failed|pytest rc" "$OUT/${NAME}_tests.log" | tail -8
wait $PRE; tail -1 "$OUT/precompile_$NAME.log"
timeout "$BENCH_LIMIT" python3 benchmarks/attention_backward.py --out "$OUT/$NAME.json" "$@" \
  --iterations 10 --variants-passing "$OUT/${NAME}_tests.log" > "$OUT/${NAME}_bench.log" 2>&1
echo "$NAME bench rc=$?"; tail -14 "$OUT/${NAME}_bench.log"
