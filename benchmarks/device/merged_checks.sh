#!/usr/bin/env bash
# One H200 call for a merge of several branches: the GPU tests each one asked for (sm90 backward defaults
# after the SASS-budget change, q_start shards of both backward kernels, padded head dims, paged decode,
# forward mode), then the backward default timed before (.dev/before, a `git archive` of REV_BEFORE) and
# after. Carry [".dev/cute", ".dev/before"]. Usage: bash benchmarks/device/merged_checks.sh REV REV_BEFORE
REV=$1; BEFORE=$2
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:$PYTHONPATH CUTE_DSL_ARCH=sm_90a FA4_GIT_REVISION=$REV FA4_JAX_CACHE_DIR=/tmp/fa4_kernels \
  PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
G="--head-dims 128 64 --seq-lens 1024 4096 16384 --iterations 10 --variants default"
(cd .dev/before && PYTHONPATH=$PWD:$PYTHONPATH JAX_PLATFORMS=cpu timeout 200 python3 benchmarks/attention_backward.py \
  --precompile-only --precompile-workers 3 $G > "$OUT/precompile_before.log" 2>&1; \
 cd - >/dev/null; JAX_PLATFORMS=cpu timeout 150 python3 benchmarks/attention_backward.py --precompile-only \
  --precompile-workers 3 $G > "$OUT/precompile_after.log" 2>&1) &
PRE=$!
timeout 120 python3 -m pytest -q -rA -n 3 -p no:cacheprovider -m gpu tests/test_sm90_decode.py > "$OUT/decode.log" 2>&1 &
DEC=$!
K="((default or query_shard or public_api or reproducible) and not sanitizer_shapes and not tiled_dq)"
HD="d36_ or d72_ or d80_ or d112_ or d160_ or d192-v128 or d96-v64 or d64-v128 or d256-v128 or d128-v64 or d96-v256 or d112-v64"
timeout 300 python3 -m pytest -q -rA -n 10 -p no:cacheprovider -m gpu \
  tests/test_sm90_backward.py tests/test_sm90_backward_large_heads.py tests/test_attention_cute.py \
  tests/test_forward_mode.py tests/test_context_parallel_gpu.py \
  -k "$K or $HD or forward_mode or jvp or per_shard" > "$OUT/gpu_tests.log" 2>&1
echo "pytest rc=$?" >> "$OUT/gpu_tests.log"
wait $DEC; wait $PRE
tail -qn1 "$OUT/precompile_before.log" "$OUT/precompile_after.log"
(cd .dev/before && PYTHONPATH=$PWD:$PYTHONPATH FA4_GIT_REVISION=$BEFORE timeout 100 python3 benchmarks/attention_backward.py $G \
  --out "$OUT/backward_before_h200.json" > "$OUT/bench_before.log" 2>&1)
timeout 100 python3 benchmarks/attention_backward.py $G --out "$OUT/backward_after_h200.json" > "$OUT/bench_after.log" 2>&1
echo "== decode: $(tail -1 $OUT/decode.log)"; grep -E "^(FAILED|ERROR)" "$OUT/decode.log" | head -5
echo "== gpu tests: $(grep -E 'passed|failed' $OUT/gpu_tests.log | tail -1)"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20
tail -16 "$OUT/bench_before.log"; tail -16 "$OUT/bench_after.log"
