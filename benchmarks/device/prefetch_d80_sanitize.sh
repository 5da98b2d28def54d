#!/usr/bin/env bash
# One device call for what the 2026-12-06 (#3) session built after its first calls:
#   1. MLA (D / Dv = 192 / 128) with two Q stages and one P / dS buffer, `Tuning.prefetch_query`, against its
#      default: backward_mla_prefetch.sh (its GPU tests, then attention_backward.py --shapes mla);
#   2. the native D = 80 sm90 forward: its oracle tests (`-k d80`);
#   3. memcheck and racecheck over every sanitizer case in one process: D = 192's backward now runs one P / dS
#      buffer behind a named barrier of all consumers, new synchronisation (sanitize_all.sh).
# Seven files in $OUT (a call returns about eight). Usage (device machine, repo root, bundle sourced):
#   bash benchmarks/device/prefetch_d80_sanitize.sh REV
set -u
REV=$1
OUT=${OUT:-/tmp/out}
HERE=$(dirname "$0")
export PYTHONPATH=$PWD:${PYTHONPATH:-} CUTE_DSL_ARCH=sm_90a FA4_GIT_REVISION=$REV FA4_JAX_CACHE_DIR=/tmp/fa4_kernels \
  PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
bash "$HERE/backward_mla_prefetch.sh" "$REV"
timeout 150 python3 -m pytest -v -n 12 -p no:cacheprovider --timeout 140 tests/test_sm90_forward.py -k d80 \
  > /tmp/d80_tests.log 2>&1
echo "pytest rc=$?" >> /tmp/d80_tests.log
grep -E "^(FAILED|ERROR)|passed|failed|pytest rc" /tmp/d80_tests.log | tail -8
xz -9 -c /tmp/d80_tests.log > "$OUT/d80_tests.log.xz"
bash "$HERE/sanitize_all.sh" 100
