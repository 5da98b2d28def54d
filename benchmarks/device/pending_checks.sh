#!/usr/bin/env bash
# The GPU checks that the 2026-12-02 session's device time did not finish (its calls were cut by their own
# timeouts), as two H200 calls of <= 560 s. Carry [".dev/cute"]. -v (not -rA) so that a run cut short still
# says which tests passed; every log goes into one tarball (the device tool returns at most 8 files).
#   bash benchmarks/device/pending_checks.sh tests REV   # forward, varlen, decode, tangent GPU files
#   bash benchmarks/device/pending_checks.sh rows80 REV  # Tuning(query_rows=80): its GPU tests, then timed
PART=$1; REV=$2
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/logs"
source .dev/cute/setup.sh || { echo "the CuTe DSL bundle (.dev/cute) did not set up"; exit 1; }
export PYTHONPATH=$PWD:$PYTHONPATH CUTE_DSL_ARCH=sm_90a FA4_GIT_REVISION=$REV FA4_JAX_CACHE_DIR=/tmp/fa4_kernels \
  PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
PYTEST="python3 -m pytest -v -n 14 -p no:cacheprovider --timeout 300 --timeout-method thread"
summary() { grep -cE " PASSED " "$1" | sed "s/^/$(basename $1): passed /"; grep -E " (FAILED|ERROR) " "$1" | head -20; tail -1 "$1"; }
if [ "$PART" = tests ]; then
  timeout 540 $PYTEST tests/test_sm90_forward.py tests/test_sm90_varlen.py tests/test_sm90_decode.py \
    tests/test_sm90_tangent.py > "$OUT/logs/gpu_tests.log" 2>&1
  echo "pytest rc=$?" >> "$OUT/logs/gpu_tests.log"
  summary "$OUT/logs/gpu_tests.log"
else
  G="--head-dims 128 --seq-lens 1024 4096 16384 --iterations 10"
  V="--variants default query_rows_80 deterministic deterministic_query_rows_80"
  JAX_PLATFORMS=cpu timeout 200 python3 benchmarks/attention_backward.py --precompile-only --precompile-workers 4 \
    $V $G > "$OUT/logs/precompile.log" 2>&1 & PRE=$!
  timeout 240 $PYTEST tests/test_sm90_backward.py -k query_rows_80 > "$OUT/logs/gpu_tests.log" 2>&1
  echo "pytest rc=$?" >> "$OUT/logs/gpu_tests.log"
  wait $PRE
  # --variants-passing reads the per-test outcome lines, which -v prints as "PASSED" per test too.
  timeout 240 python3 benchmarks/attention_backward.py $V $G --out "$OUT/backward_query_rows_80_h200.json" \
    --variants-passing "$OUT/logs/gpu_tests.log" > "$OUT/logs/bench.log" 2>&1
  echo "bench rc=$?"
  summary "$OUT/logs/gpu_tests.log"; tail -8 "$OUT/logs/bench.log"
fi
tar cJf "$OUT/logs.tar.xz" -C "$OUT" logs && rm -rf "$OUT/logs"
