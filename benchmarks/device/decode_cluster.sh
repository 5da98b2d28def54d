#!/usr/bin/env bash
# One device call for the decode kernel's cluster combine (DecodeOptions.combine = "cluster", issue 16):
#   probe     the cluster variants of decode_probe.py, each in its own process (a failed cluster launch
#             poisons its context), then one of them under compute-sanitizer memcheck and racecheck
#   tests     test_sm90_decode.py's cluster cases (every paged case, the forced split counts) and the
#             fixed test_kernel_clamps_int32_lengths (not yet run on a GPU)
#   timing    benchmarks/decode.py at B = 1 and 8, contexts 1k, 8k, 32k, with the last-CTA and cluster merges
#             beside the default XLA pass (predictions in docs/kernels.md, "cluster combine")
# Usage (device machine, repo root, bundle sourced): bash benchmarks/device/decode_cluster.sh REV
set -u
REV=$1
OUT=${OUT:-/tmp/out}
export PYTHONPATH=$PWD:$PYTHONPATH CUTE_DSL_ARCH=sm_90a FA4_GIT_REVISION=$REV FA4_JAX_CACHE_DIR=/tmp/fa4_kernels \
  PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 100 python3 benchmarks/device/decode_probe.py --only cluster,cluster_no_keys,cluster16_bf16,d128_bf16 \
  > "$OUT/decode_probe.log" 2>&1
echo "probe rc=$?" >> "$OUT/decode_probe.log"; grep -E "VARIANT|PROBE|rc=" "$OUT/decode_probe.log"
for tool in memcheck racecheck; do
  timeout 90 compute-sanitizer --tool $tool --print-limit 12 python3 benchmarks/device/decode_probe.py \
    --variant cluster16_bf16 > "$OUT/decode_${tool}.log" 2>&1
  echo "$tool rc=$?: $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/decode_${tool}.log" | head -2)"
done
timeout 150 python3 -m pytest -v -n 8 -p no:cacheprovider --timeout 140 tests/test_sm90_decode.py \
  tests/test_paged_attention.py -k "cluster or clamps" > "$OUT/decode_tests.log" 2>&1
echo "pytest rc=$?" >> "$OUT/decode_tests.log"
grep -E "^(FAILED|ERROR)|passed|failed|pytest rc" "$OUT/decode_tests.log" | tail -8
timeout 200 python3 benchmarks/decode.py --batches 1,8 --contexts 1024,8192,32768 --combines last_cta,cluster \
  --out "$OUT/decode_cluster.json" > "$OUT/decode_bench.log" 2>&1
echo "bench rc=$?"; grep -E "^B=|copy" "$OUT/decode_bench.log"
