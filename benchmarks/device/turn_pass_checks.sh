#!/usr/bin/env bash
# GPU checks of the dQ turn passed by a relaxed red after the fence (ordered_reduction.finish_bulk_adds, the
# only form since rev a546978's measurement, where backward.py's candidate passed its tests): the
# large-head kernel's deterministic oracle and ten-run reproducibility cases and the packed sequences'
# deterministic backward, both sanitizers over every sanitizer case in one process, then D 256
# default / deterministic 2k / 8k (against ceba8e5's 0.72-0.80 of cuDNN, logs/session_ceba8e5_h100.tar.xz).
# ~7 min (at rev 3338a91 a 110-s limit cut the tests after 30 of 46).
# Usage (device machine, repo root, bundle sourced; carry .dev/cute):
#   bash benchmarks/device/turn_pass_checks.sh REV
REV=$1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:${PYTHONPATH:-} CUTE_DSL_ARCH=sm_90a FA4_GIT_REVISION=$REV FA4_JAX_CACHE_DIR=/tmp/fa4_kernels \
  PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
B="--variants default deterministic --head-dims 256 --seq-lens 2048 8192 --iterations 10"
JAX_PLATFORMS=cpu timeout 100 python3 benchmarks/attention_backward.py --precompile-only --precompile-workers 4 $B \
  > "$OUT/precompile.log" 2>&1 &
timeout 260 python3 -m pytest -q -rA -n 12 -p no:cacheprovider -m gpu --timeout 240 \
  tests/test_sm90_backward_large_heads.py tests/test_sm90_varlen.py \
  -k "test_deterministic_is_bitwise_reproducible or (test_backward_matches_oracle and deterministic) or test_deterministic_backward" \
  > "$OUT/turn_pass_tests.log" 2>&1
echo "pytest rc=$?" >> "$OUT/turn_pass_tests.log"
echo "== gpu tests: $(grep -E 'passed|failed' "$OUT/turn_pass_tests.log" | tail -1)"
grep -E "^(FAILED|ERROR)" "$OUT/turn_pass_tests.log" | head -10
wait
bash "$(dirname "$0")/sanitize_all.sh" 45
timeout 50 python3 benchmarks/attention_backward.py --out "$OUT/turn_pass_d256.json" $B > "$OUT/turn_pass_d256.log" 2>&1
echo "bench rc=$?"; tail -5 "$OUT/turn_pass_d256.log"
