#!/usr/bin/env bash
# GPU tests selected by a pytest -k expression, then memcheck and racecheck of every sanitizer case in one
# process (sanitize_all.sh, alone on the GPU): the body of the *_checks.sh device calls after a promotion.
# Logs $OUT/NAME_tests.log. Usage (device machine, repo root, bundle sourced; carry .dev/cute):
#   bash benchmarks/device/gpu_checks.sh REV NAME PYTEST_K TEST_FILE...
REV=$1 NAME=$2 SELECT=$3
shift 3
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-} CUTE_DSL_ARCH=sm_90a FA4_GIT_REVISION=$REV FA4_JAX_CACHE_DIR=/tmp/fa4_kernels \
  PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
LOG=$OUT/${NAME}_tests.log
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 330 python3 -m pytest -q -rA -n 12 -p no:cacheprovider -m gpu --timeout 300 "$@" -k "$SELECT" > "$LOG" 2>&1
echo "pytest rc=$?" >> "$LOG"
echo "== gpu tests: $(grep -E 'passed|failed' "$LOG" | tail -1)"
grep -E "^(FAILED|ERROR)" "$LOG" | head -20
bash "$(dirname "$0")/sanitize_all.sh" 100
