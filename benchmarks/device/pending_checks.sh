#!/usr/bin/env bash
# The GPU checks that the 2026-12-02 session's device time did not finish (its calls were cut by their own
# timeouts), as one H200 call of <= 560 s. Carry [".dev/cute"]. -v (not -rA) so that a run cut short still
# says which tests passed; every log goes into one tarball (the device tool returns at most 8 files).
#   bash benchmarks/device/pending_checks.sh tests REV   # forward, varlen, decode, tangent GPU files
PART=$1; REV=$2
[ "$PART" = tests ] || { echo "usage: bash benchmarks/device/pending_checks.sh tests REV"; exit 2; }
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/logs"
source .dev/cute/setup.sh || { echo "the CuTe DSL bundle (.dev/cute) did not set up"; exit 1; }
export PYTHONPATH=$PWD:$PYTHONPATH CUTE_DSL_ARCH=sm_90a FA4_GIT_REVISION=$REV FA4_JAX_CACHE_DIR=/tmp/fa4_kernels \
  PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
PYTEST="python3 -m pytest -v -n 14 -p no:cacheprovider --timeout 300 --timeout-method thread"
summary() { grep -cE " PASSED " "$1" | sed "s/^/$(basename $1): passed /"; grep -E " (FAILED|ERROR) " "$1" | head -20; tail -1 "$1"; }
timeout 540 $PYTEST tests/test_sm90_forward.py tests/test_sm90_varlen.py tests/test_sm90_decode.py \
  tests/test_sm90_tangent.py > "$OUT/logs/gpu_tests.log" 2>&1
echo "pytest rc=$?" >> "$OUT/logs/gpu_tests.log"
summary "$OUT/logs/gpu_tests.log"
tar cJf "$OUT/logs.tar.xz" -C "$OUT" logs && rm -rf "$OUT/logs"
