#!/usr/bin/env bash
# Device call for the 80-query-row backward at D = 128 (`Tuning.query_rows=80`: dQ^T = K^T dS^T, one dQ
# staging buffer; the default without a mask since rev b636efb; docs/sm90_backward_tuning.md, "80 query rows
# again"): its GPU tests while the CPU compiles the timed kernels, then 64 rows forced vs 80 forced (and the
# default) at D 128, full and causal, 1k / 4k (B*S = 16k), then the GQA / MQA rows (80 rows take no head
# splits: against the default's), each with per-kernel CUPTI times, then racecheck and memcheck over two of
# its oracle cases in one process. ~6 min. Measured at revs 9f5f9a4, e9f31bf and 458b42a on an H100
# (benchmarks/results/logs/rows80_458b42a_h100.tar.xz).
# Usage (device machine, repo root, bundle sourced): bash benchmarks/device/backward_rows80.sh REV
set -u
REV=$1
HERE=$(dirname "$0")
OUT=${OUT:-/tmp/out}
bash "$HERE/backward_candidates.sh" "$REV" rows80 tests/test_sm90_backward.py "query_rows_80 or query_rows_64" \
  --variants default query_rows_64 query_rows_80 --head-dims 128 --seq-lens 1024 4096 --per-kernel
timeout 120 python3 benchmarks/attention_backward.py --out "$OUT/rows80_gqa.json" --shapes gqa \
  --variants default query_rows_64 query_rows_80 --head-dims 128 --iterations 10 --per-kernel > "$OUT/rows80_gqa.log" 2>&1
echo "gqa bench rc=$?"; tail -8 "$OUT/rows80_gqa.log"
for tool in racecheck memcheck; do
  timeout 100 compute-sanitizer --tool $tool --report-api-errors no --print-limit 12 python3 -m pytest -q -p no:cacheprovider -p no:xdist \
    tests/test_sm90_backward.py -k "query_rows_80 and (causal-cross or gqa-long)" > "$OUT/rows80_$tool.log" 2>&1
  echo "$tool rc=$?: $(grep -E 'SUMMARY|passed|failed' "$OUT/rows80_$tool.log" | tr '\n' ' ')"
done
