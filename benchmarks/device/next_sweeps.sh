#!/usr/bin/env bash
# The prepared sweeps in three device calls, one after the other on the same warm machine (the kernel
# cache in /tmp/fa4_kernels carries over):
#   tests REV          the candidates' GPU tests (backward poly_exp2_every 4 / 6 and dq_column_split; forward
#                      d64-poly4 / d64-poly8; the large-head diagonal-first / lowest-first turn orders), the
#                      forward's polynomial-exp2 oracle tests (which the rewritten exp2 must pass as the old
#                      one did), tests/test_sm90_varlen.py; then, alone on the GPU, memcheck and racecheck
#                      of every sanitizer case in one process (sanitize_all.sh); meanwhile the timed
#                      kernels precompile on the CPU
#   backward REV LOGS  the backward timing (D 64 / 128) of each candidate whose tests passed in the first
#                      call's gpu_tests.log (copied from what the device tool brought back into the tree,
#                      LOGS a folder of it)
#   forward REV LOGS   the forward D = 64 rows (LOGS/gpu_tests.xml) and the D = 256 deterministic turn orders
#   varlen REV LOGS    the packed backward's timing (benchmarks/varlen.py --backward), if its GPU tests passed
#   timing REV LOGS    backward (S 1k / 4k only), forward and varlen in one call of <= 590 s, when device time is short
# Usage (device machine, repo root, bundle sourced; docs/device.md):
#   bash benchmarks/device/next_sweeps.sh tests REV
#   bash benchmarks/device/next_sweeps.sh backward REV LOGS
#   bash benchmarks/device/next_sweeps.sh forward REV LOGS
#   bash benchmarks/device/next_sweeps.sh varlen REV LOGS
#   bash benchmarks/device/next_sweeps.sh timing REV LOGS
# Outputs under $OUT, a short table printed last.
set -u
PHASE=$1
REV=$2
OUT=${OUT:-/tmp/out}
export PYTHONPATH=$PWD:$PYTHONPATH CUTE_DSL_ARCH=sm_90a FA4_GIT_REVISION=$REV FA4_JAX_CACHE_DIR=/tmp/fa4_kernels \
  PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
SMALL="--variants default poly_exp2_4 poly_exp2_6 dq_column_split deterministic deterministic_dq_column_split
       --head-dims 64 128 --seq-lens 1024 4096 16384"
LARGE="--variants default deterministic deterministic_lowest_first --head-dims 256 --seq-lens 1024 4096"

if [ "$PHASE" = tests ]; then
  (JAX_PLATFORMS=cpu timeout 250 python3 benchmarks/attention_backward.py --precompile-only --precompile-workers 6 $SMALL
   JAX_PLATFORMS=cpu timeout 120 python3 benchmarks/attention_backward.py --precompile-only --precompile-workers 4 $LARGE
   JAX_PLATFORMS=cpu timeout 120 python3 benchmarks/attention.py --compile-only --compile-workers 4) \
    > "$OUT/precompile.log" 2>&1 &
  PRE=$!
  timeout 420 python3 -m pytest -v -n 12 -p no:cacheprovider --timeout 200 --junitxml="$OUT/gpu_tests.xml" \
    tests/test_sm90_backward.py tests/test_sm90_forward.py tests/test_sm90_backward_large_heads.py tests/test_sm90_varlen.py \
    -k "poly_exp2 or polynomial_exp2 or dq_column_split or (variant and d64-poly) or diagonal_first or lowest_first or varlen or mla" \
    > "$OUT/gpu_tests.log" 2>&1
  echo "pytest rc=$?" >> "$OUT/gpu_tests.log"
  # A warm machine keeps /tmp: the next phases read the logs from here when the tree has no copy yet.
  mkdir -p /tmp/next_sweeps_logs && cp "$OUT/gpu_tests.log" "$OUT/gpu_tests.xml" /tmp/next_sweeps_logs/
  grep -E "^(FAILED|ERROR)|passed|failed|pytest rc" "$OUT/gpu_tests.log" | tail -12
  bash benchmarks/device/sanitize_all.sh 150
  wait $PRE
  tail -3 "$OUT/precompile.log"
else
  LOGS=${3:-}
  [ -f "$LOGS/gpu_tests.log" ] || LOGS=/tmp/next_sweeps_logs
  if [ ! -f "$LOGS/gpu_tests.log" ]; then echo "no gpu_tests.log in ${3:-} or $LOGS: run the tests phase first"; exit 2; fi
  echo "test logs from $LOGS"
  set -- "$1" "$2" "$LOGS"
fi
if [ "$PHASE" = backward ] || [ "$PHASE" = timing ]; then
  [ "$PHASE" = timing ] && BACKWARD_LIMIT=240 SEQ="--seq-lens 1024 4096" || BACKWARD_LIMIT=540 SEQ=
  timeout $BACKWARD_LIMIT python3 benchmarks/attention_backward.py --out "$OUT/backward_candidates_h200.json" $SMALL $SEQ \
    --iterations 10 --variants-passing "$3/gpu_tests.log" > "$OUT/backward_bench.log" 2>&1
  echo "backward bench rc=$?"
fi
if [ "$PHASE" = forward ] || [ "$PHASE" = timing ]; then
  timeout 130 python3 benchmarks/attention.py --variants --iterations 10 --max-seconds 110 \
    --exclude-failed "$3/gpu_tests.xml" --out "$OUT/forward_variants_d64_poly_h200.json" \
    > "$OUT/forward_bench.log" 2>&1
  echo "forward bench rc=$?"
  timeout 110 python3 benchmarks/attention_backward.py --out "$OUT/backward_d256_diagonal_first_h200.json" $LARGE \
    --iterations 10 --variants-passing "$3/gpu_tests.log" > "$OUT/large_heads_bench.log" 2>&1
  echo "large-head bench rc=$?"
fi
if [ "$PHASE" = varlen ] || [ "$PHASE" = timing ]; then
  # The packed backward is timed only when every test of tests/test_sm90_varlen.py ran and passed.
  # (pytest -v under xdist writes "[gw3] [ 10%] PASSED tests/...", without xdist "tests/... PASSED").
  if grep -qE "PASSED.*test_sm90_varlen.py|test_sm90_varlen.py.*PASSED" "$3/gpu_tests.log" && \
     ! grep -qE "(FAILED|ERROR).*test_sm90_varlen.py|test_sm90_varlen.py.*(FAILED|ERROR)" "$3/gpu_tests.log" && \
     grep -qE "^\W*[0-9]+ (passed|failed).* in [0-9.]+s" "$3/gpu_tests.log"; then
    timeout 100 python3 benchmarks/varlen.py --backward --quick --iterations 10 \
      --max-seconds 70 --out "$OUT/varlen_backward_h200.json" > "$OUT/varlen_bench.log" 2>&1
    echo "varlen backward bench rc=$?"
  else
    echo "varlen backward bench skipped: tests/test_sm90_varlen.py did not pass whole in $3/gpu_tests.log"
  fi
fi
case $PHASE in
  varlen) tail -12 "$OUT/varlen_bench.log" ;;
  backward) tail -40 "$OUT/backward_bench.log" ;;
  forward) tail -10 "$OUT/forward_bench.log"; tail -8 "$OUT/large_heads_bench.log" ;;
  timing) tail -26 "$OUT/backward_bench.log"; tail -6 "$OUT/varlen_bench.log"; tail -10 "$OUT/forward_bench.log"; tail -8 "$OUT/large_heads_bench.log" ;;
esac
