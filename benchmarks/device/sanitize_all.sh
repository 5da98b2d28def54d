#!/usr/bin/env bash
# memcheck, then racecheck, of every sanitizer case in one process (tests/sanitizer_cases.py all), with
# the shipped tunings; logs $OUT/memcheck_all.log and $OUT/racecheck_all.log, a summary line each.
# Run it with nothing else on the GPU: started beside the GPU tests, compute-sanitizer segfaulted part
# way three times (docs/sm90_backward_tuning.md, "racecheck"); alone, both tools over the 16 cases (17
# since rev b636efb) took 30 s together with the kernels cached (an H100). Usage (device machine, repo root, environment set):
#   bash benchmarks/device/sanitize_all.sh [LIMIT_S]
LIMIT=${1:-120}
OUT=${OUT:-/tmp/out}
timeout "$LIMIT" compute-sanitizer --tool memcheck --print-limit 12 python3 tests/sanitizer_cases.py all \
  > "$OUT/memcheck_all.log" 2>&1
echo "memcheck rc=$?" >> "$OUT/memcheck_all.log"
timeout "$LIMIT" compute-sanitizer --tool racecheck --racecheck-report all --print-limit 12 python3 tests/sanitizer_cases.py all \
  > "$OUT/racecheck_all.log" 2>&1
echo "racecheck rc=$?" >> "$OUT/racecheck_all.log"
for tool in memcheck racecheck; do
  echo "$tool: $(grep -c ': ran' "$OUT/${tool}_all.log") of $(python3 -c "import sys; sys.path.insert(0, 'tests'); import sanitizer_cases as c; print(len(c.cases_of('all')))" 2>/dev/null) cases ran; $(grep -E "rc=" "$OUT/${tool}_all.log")"
  grep -E "RACECHECK SUMMARY|ERROR SUMMARY|Error:|Hazard" "$OUT/${tool}_all.log" | sort | uniq -c | head -6
done
