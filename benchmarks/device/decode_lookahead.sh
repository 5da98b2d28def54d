#!/usr/bin/env bash
# One device call for issue 16's B = 1 rows (docs/kernels.md, "Decode: page numbers one block ahead"):
#   tests    DecodeOptions.page_lookahead on every paged case and the forced split / stage counts, and the
#            length clamps
#   timing   benchmarks/decode.py at B = 1 and 8, contexts 1k / 8k / 32k, with --page-lookahead
#            (fa4_jax_page_lookahead_ms beside fa4_jax_run_ms, the default options through decode.run)
#   profile  ncu of one call at B = 1 1k and 8k, default and lookahead (decode_profile.sh)
# Usage (device machine, repo root, bundle sourced): bash benchmarks/device/decode_lookahead.sh REV
set -u
REV=$1
OUT=${OUT:-/tmp/out}
export PYTHONPATH=$PWD:$PYTHONPATH CUTE_DSL_ARCH=sm_90a FA4_GIT_REVISION=$REV FA4_JAX_CACHE_DIR=/tmp/fa4_kernels \
  PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 150 python3 -m pytest -v -n 8 -p no:cacheprovider --timeout 140 tests/test_sm90_decode.py \
  -k "page_lookahead or clamps" > "$OUT/decode_tests.log" 2>&1
echo "pytest rc=$?" >> "$OUT/decode_tests.log"
grep -E "^(FAILED|ERROR)|passed|failed|pytest rc" "$OUT/decode_tests.log" | tail -8
timeout 200 python3 benchmarks/decode.py --batches 1,8 --contexts 1024,8192,32768 --page-lookahead \
  --out "$OUT/decode_lookahead.json" > "$OUT/decode_bench.log" 2>&1
echo "bench rc=$?"; grep -E "^B=|copy" "$OUT/decode_bench.log"
timeout 150 bash benchmarks/device/decode_profile.sh "1 1024 16 1" "1 8192 16 1" "1 8192 16 1 --page-lookahead"
