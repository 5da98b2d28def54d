#!/usr/bin/env bash
# GPU checks of the deterministic backward's defaults (two dQ writer warps since rev e3c0509): the oracle,
# head-split, wide-block and sanitizer-shape cases, the ten-run reproducibility tests (more CTAs than the
# GPU holds), packed sequences and the public API; then memcheck and racecheck of every sanitizer case in one
# process (sanitize_all.sh, alone on the GPU). ~7 min on an H100.
# Usage (device machine, repo root, bundle sourced; carry .dev/cute):
#   bash benchmarks/device/deterministic_checks.sh REV
REV=$1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-} CUTE_DSL_ARCH=sm_90a FA4_GIT_REVISION=$REV FA4_JAX_CACHE_DIR=/tmp/fa4_kernels \
  PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 330 python3 -m pytest -q -rA -n 12 -p no:cacheprovider -m gpu --timeout 300 \
  tests/test_sm90_backward.py tests/test_sm90_varlen.py tests/test_attention_cute.py \
  -k "deterministic or reproducib" > "$OUT/deterministic_tests.log" 2>&1
echo "pytest rc=$?" >> "$OUT/deterministic_tests.log"
echo "== gpu tests: $(grep -E 'passed|failed' "$OUT/deterministic_tests.log" | tail -1)"
grep -E "^(FAILED|ERROR)" "$OUT/deterministic_tests.log" | head -20
bash "$(dirname "$0")/sanitize_all.sh" 100
