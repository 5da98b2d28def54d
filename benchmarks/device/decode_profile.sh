#!/usr/bin/env bash
# Nsight Compute profiles of one decode call, to see where issue 16's B = 1 rows spend their time: the split
# kernel alone takes ~7 us at B = 1 1k (merging in the kernel instead of the XLA pass saved <= 0.2 us on the
# H100 at 17f1841) while its K/V read is ~1.3 us at the copy rate. Per row: every kernel of one call
# (benchmarks/device/decode_one_call.py, `--set full`), the details page as text, the per-SASS-instruction
# stall samples and the raw metrics, compressed.
# Usage (device machine, repo root, bundle sourced):
#   bash benchmarks/device/decode_profile.sh "BATCH CONTEXT PAGE_SIZE Q_LEN [--overrides JSON]" ...
#   (JSON without spaces, e.g. {"combine":"xla"}: each row is split on spaces)
# (each row is one ncu report: keep the rows few, a call returns a limited number of files)
set -u
OUT=${OUT:-/tmp/out}
export PYTHONPATH=$PWD:$PYTHONPATH CUTE_DSL_ARCH=sm_90a FA4_JAX_CACHE_DIR=/tmp/fa4_kernels PYTHONUNBUFFERED=1 \
  XLA_PYTHON_CLIENT_PREALLOCATE=false
for row in "$@"; do
  name="$OUT/decode_$(echo "$row" | tr -c 'A-Za-z0-9_\n' '_')"
  # shellcheck disable=SC2086  (the row is the driver's arguments)
  timeout 150 ncu --set full --import-source no --profile-from-start off -f -o "$name" \
    python3 benchmarks/device/decode_one_call.py $row > "$name.log" 2>&1
  echo "$row: ncu rc=$? after ${SECONDS} s"
  bash "$(dirname "$0")/ncu_pages.sh" "$name"   # details, stall samples, raw metrics
  grep -E "^  [A-Za-z_].*\(|^    Duration|^    Registers Per Thread|^    Grid Size|^    Block Size|^    Dynamic Shared|^    Achieved Occupancy" \
    "$name.details.txt" | head -40
done
