#!/usr/bin/env bash
# GPU checks of the 80-query-row default at D = 128 without a mask (rev b636efb; docs/sm90_backward_tuning.md,
# "80 query rows again"): every non-deterministic case of the sm90 backward's GPU tests (the shared oracle
# cases at D = 128 full now run 80 rows, the query-shard cases too) and the public API's gradients, then
# memcheck and racecheck of every sanitizer case in one process (sanitize_all.sh, alone on the GPU; the
# d128-gqa case reaches 80 rows). ~7 min on an H100.
# Usage (device machine, repo root, bundle sourced; carry .dev/cute): bash benchmarks/device/rows80_checks.sh REV
REV=$1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-} CUTE_DSL_ARCH=sm_90a FA4_GIT_REVISION=$REV FA4_JAX_CACHE_DIR=/tmp/fa4_kernels \
  PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 330 python3 -m pytest -q -rfE -n 12 -p no:cacheprovider -m gpu --timeout 300 \
  tests/test_sm90_backward.py tests/test_attention_cute.py \
  -k "not deterministic and not reproducib and not sanitizer_shapes" > "$OUT/rows80_checks_tests.log" 2>&1
echo "pytest rc=$?" >> "$OUT/rows80_checks_tests.log"
echo "== gpu tests: $(grep -E 'passed|failed' "$OUT/rows80_checks_tests.log" | tail -1)"
grep -E "^(FAILED|ERROR)" "$OUT/rows80_checks_tests.log" | head -20
bash "$(dirname "$0")/sanitize_all.sh" 100
