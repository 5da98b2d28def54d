#!/usr/bin/env bash
# One device call for issue 16's B = 1 rows after the page-lookahead measurement (docs/kernels.md, "Decode:
# the XLA merge in one reduction"):
#   tests    the variadic XLA merge and the old page order on every paged case and the forced splits, and
#            the length clamps
#   timing   benchmarks/decode.py at B = 1 and 8, contexts 1k / 8k / 32k, the candidates through
#            decode.run beside the defaults, and ours / Pallas with a cold L2 too: decode_merge.json
#   kernels  CUPTI time of each kernel of one call at B = 1 1k / 8k, B = 1 1k Sq 4, B = 8 1k (the API,
#            last-CTA merge, old page order, variadic merge): decode_kernel_times.json
# Few output files on purpose (a call returns a limited number; the log comes back compressed).
# Usage (device machine, repo root, bundle sourced): bash benchmarks/device/decode_merge.sh REV
set -u
REV=$1
OUT=${OUT:-/tmp/out}
export PYTHONPATH=$PWD:$PYTHONPATH CUTE_DSL_ARCH=sm_90a FA4_GIT_REVISION=$REV FA4_JAX_CACHE_DIR=/tmp/fa4_kernels \
  PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
LOG=/tmp/decode_merge.log
timeout 150 python3 -m pytest -v -n 8 -p no:cacheprovider --timeout 140 tests/test_sm90_decode.py \
  -k "variadic or page_lookahead or clamps" > $LOG 2>&1
echo "pytest rc=$?" >> $LOG
grep -E "^(FAILED|ERROR)|passed|failed|pytest rc" $LOG | tail -8
# The benchmark first: its parallel precompile also fills the cache with all but the last-CTA kernels
# that decode_kernel_times.py (one process, compiling serially) needs.
timeout 240 python3 benchmarks/decode.py --batches 1,8 --contexts 1024,8192,32768 \
  --option-variants no_page_lookahead,variadic_merge --cold-l2 --out "$OUT/decode_merge.json" >> $LOG 2>&1
echo "bench rc=$?"; grep -E "^B=|copy" $LOG | tail -26
timeout 150 python3 benchmarks/device/decode_kernel_times.py --out "$OUT/decode_kernel_times.json" 2>&1 \
  | grep -E "^B=" | tee -a $LOG
xz -9 -c $LOG > "$OUT/decode_merge.log.xz"
