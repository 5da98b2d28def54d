#!/usr/bin/env bash
# One device call for the D = 192 backward candidate Tuning.two_groups_by_keys (backward_large_heads: two
# consumer warp groups splitting 96 keys, docs/sm90_backward_tuning.md, "D = 192: two groups split by
# keys"): its GPU tests (the D = 192 cases, unordered and deterministic) while the CPU compiles the timed
# kernels, then hopper_vs_peers' D = 192 rows against the default (three warp groups), each variant timed
# only if its tests passed.
# Usage (device machine, repo root, bundle sourced): bash benchmarks/device/backward_d192.sh REV
set -u
REV=$1
OUT=${OUT:-/tmp/out}
export PYTHONPATH=$PWD:$PYTHONPATH CUTE_DSL_ARCH=sm_90a FA4_GIT_REVISION=$REV FA4_JAX_CACHE_DIR=/tmp/fa4_kernels \
  PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
D192="--variants default deterministic two_groups_by_keys deterministic_two_groups_by_keys --shapes d192
  --head-dims 192 --seq-lens 2048 8192"
JAX_PLATFORMS=cpu timeout 200 python3 benchmarks/attention_backward.py --precompile-only --precompile-workers 4 \
  $D192 > "$OUT/precompile_d192.log" 2>&1 &
PRE=$!
timeout 240 python3 -m pytest -v -n 12 -p no:cacheprovider --timeout 230 tests/test_sm90_backward_large_heads.py \
  -k "two_groups_by_keys" > "$OUT/d192_tests.log" 2>&1
echo "pytest rc=$?" >> "$OUT/d192_tests.log"
grep -E "^(FAILED|ERROR)|passed|failed|pytest rc" "$OUT/d192_tests.log" | tail -8
wait $PRE; tail -1 "$OUT/precompile_d192.log"
timeout 150 python3 benchmarks/attention_backward.py --out "$OUT/backward_d192_by_keys.json" $D192 \
  --iterations 10 --variants-passing "$OUT/d192_tests.log" > "$OUT/d192_bench.log" 2>&1
echo "d192 bench rc=$?"; tail -10 "$OUT/d192_bench.log"
