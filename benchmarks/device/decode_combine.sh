#!/usr/bin/env bash
# One device call for issue 16's combine kernel (docs/kernels.md, "Decode: the combine as one kernel";
# DecodeOptions.combine = "kernel": the decode kernel's partials merged by fa4_jax/kernels/sm90/decode_combine.py
# instead of XLA's three kernels):
#   tests    the combine kernel on every paged case and the forced split counts (1, 7, 33, 128) against the
#            float64 oracle, NaN-poisoned memory
#   timing   benchmarks/decode.py at B = 1 and 8, contexts 1k / 8k / 32k, the combine kernel through decode.run
#            beside the defaults through it (fa4_jax_combine_kernel_ms, fa4_jax_run_ms): decode_combine.json
#   kernels  CUPTI time of each kernel of one call at B = 1 1k / 8k, B = 1 1k Sq 4, B = 8 1k, the API (XLA merge)
#            and the combine kernel: decode_combine_kernel_times.json
# Three output files (a call returns few; the log comes back compressed); about 400 s at most.
# Usage (device machine, repo root, bundle sourced): bash benchmarks/device/decode_combine.sh REV
set -u
REV=$1
OUT=${OUT:-/tmp/out}
export PYTHONPATH=$PWD:$PYTHONPATH CUTE_DSL_ARCH=sm_90a FA4_GIT_REVISION=$REV FA4_JAX_CACHE_DIR=/tmp/fa4_kernels \
  PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
LOG=/tmp/decode_combine.log
timeout 120 python3 -m pytest -v -n 8 -p no:cacheprovider --timeout 110 tests/test_sm90_decode.py \
  -k "combine_kernel or combinekernel" > $LOG 2>&1
echo "pytest rc=$?" >> $LOG
grep -E "^(FAILED|ERROR)|passed|failed|pytest rc" $LOG | tail -8
# The benchmark first: its parallel precompile fills the cache with every kernel decode_kernel_times.py needs.
timeout 200 python3 benchmarks/decode.py --batches 1,8 --contexts 1024,8192,32768 \
  --option-variants combine_kernel --out "$OUT/decode_combine.json" >> $LOG 2>&1
echo "bench rc=$?"; grep -E "^B=|copy" $LOG | tail -26
timeout 80 python3 benchmarks/device/decode_kernel_times.py --variants api,combine_kernel \
  --out "$OUT/decode_combine_kernel_times.json" 2>&1 | grep -E "^B=" | tee -a $LOG
xz -9 -c $LOG > "$OUT/decode_combine.log.xz"
