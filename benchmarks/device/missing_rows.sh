#!/usr/bin/env bash
# The benchmark rows earlier H200 calls did not reach (cut by their timeouts), one call of <= 560 s, carry
# [".dev/cute"]: decode B = 8 at 32k page 64 and 128k, B = 64 at 128k page 64 (issue 16); varlen's
# short-16-1024 mix (issue 15). Reports and logs in one tarball (the device tool returns at most 8 files).
#   bash benchmarks/device/missing_rows.sh REV
REV=$1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/rows"
source .dev/cute/setup.sh || { echo "the CuTe DSL bundle (.dev/cute) did not set up"; exit 1; }
export PYTHONPATH=$PWD:$PYTHONPATH CUTE_DSL_ARCH=sm_90a FA4_GIT_REVISION=$REV FA4_JAX_CACHE_DIR=/tmp/fa4_kernels \
  PYTHONUNBUFFERED=1
R=$OUT/rows
timeout 170 python3 benchmarks/decode.py --batches 8 --contexts 32768,131072 --page-sizes 64 --fused-combine \
  --out $R/decode_b8_p64.json > $R/decode_b8_p64.log 2>&1; echo "decode b8 p64 rc=$?"
timeout 90 python3 benchmarks/decode.py --batches 8 --contexts 131072 --page-sizes 16 --fused-combine \
  --out $R/decode_b8_p16.json > $R/decode_b8_p16.log 2>&1; echo "decode b8 p16 rc=$?"
timeout 100 python3 benchmarks/decode.py --batches 64 --contexts 131072 --page-sizes 64 \
  --out $R/decode_b64_p64.json > $R/decode_b64_p64.log 2>&1; echo "decode b64 p64 rc=$?"
timeout 170 python3 benchmarks/varlen.py --mixes short-16-1024 --max-seconds 140 \
  --out $R/varlen_short.json > $R/varlen_short.log 2>&1; echo "varlen rc=$?"
grep -hE "^B=|^row " $R/*.log | cut -c1-220
tar cJf "$OUT/rows.tar.xz" -C "$OUT" rows && rm -rf "$OUT/rows"
