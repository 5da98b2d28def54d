#!/usr/bin/env bash
# The third device call of the 2026-12-07 session, on the machine the first two left warm (the CuTe DSL and
# the peer bundle already unpacked: cute_env.sh), carrying nothing:
#   1. ncu of the D = 128 full forward at B 2, S 8k, 16 heads, ours against FA4's (profile_attention.sh):
#      the grid's rows furthest below FA4 in the forward (0.90-0.94 at 4k-16k on an H100, rev 6f403c6), the
#      evidence before any change to them;
#   2. memcheck and racecheck over every sanitizer case in one process (sanitize_all.sh);
#   3. benchmarks/decode.py at B = 64 up to 32k (128k does not fit an H100 beside Pallas' paged copy).
# Four files in $OUT. Usage: bash benchmarks/device/forward_profile_sanitize_b64.sh REV
set -u
REV=$1
OUT=${OUT:-/tmp/out}
HERE=$(dirname "$0")
PEER=1 source "$HERE/cute_env.sh" || exit 1
mkdir -p /tmp/profile
OUT=/tmp/profile bash "$HERE/profile_attention.sh" forward "2 8192 16/16 128"
tar cf "$OUT/forward_profile.tar" -C /tmp/profile .   # one file back for the six pages and the ncu logs
export PYTHONPATH=$PWD:$PYTHONPATH CUTE_DSL_ARCH=sm_90a FA4_GIT_REVISION=$REV FA4_JAX_CACHE_DIR=/tmp/fa4_kernels \
  PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
bash "$HERE/sanitize_all.sh" 100
timeout 200 python3 benchmarks/decode.py --batches 64 --contexts 1024,8192,32768 --option-variants xla_combine \
  --compile-workers 8 --out "$OUT/decode_b64.json" > /tmp/decode_b64.log 2>&1
echo "grid rc=$?"; grep -E "^B=|copy" /tmp/decode_b64.log | tail -14
