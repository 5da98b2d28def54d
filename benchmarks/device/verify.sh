#!/usr/bin/env bash
# After a promotion: the whole GPU test suite, the issue benchmarks with the defaults, compute-sanitizer,
# and cold/warm first-call time, in one device call. With two GPUs the forward side (GPU 0) and the
# backward side (GPU 1) run at once; each benchmark is one process on one GPU against cuDNN on the same
# inputs. Usage (device machine, repo root, bundle sourced): bash benchmarks/device/verify.sh REV
set -u
export PYTHONPATH=$PWD:${PYTHONPATH:-} CUTE_DSL_ARCH=sm_90a FA4_GIT_REVISION=$1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
GPUS=$(nvidia-smi -L | wc -l)
TIMEOUT=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout=150 --timeout-method=thread")

forward_side() {  # $1: GPU
  local dir=$OUT/forward; mkdir -p "$dir"
  export CUDA_VISIBLE_DEVICES=$1 FA4_JAX_CACHE_DIR=/tmp/fa4_cache_gpu$1
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 240 python3 -m pytest -q -rfE -n 12 -p no:cacheprovider $TIMEOUT \
    -m gpu --ignore=tests/test_sanitizer.py --ignore=tests/test_sm90_backward_large_heads.py tests \
    > "$dir/gpu_tests.log" 2>&1
  echo "pytest rc=$? after ${SECONDS} s" >> "$dir/gpu_tests.log"
  timeout 200 python3 benchmarks/attention.py --iterations 20 --xla-max-seq-len 8192 --out "$dir/forward_h200.json" > "$dir/bench.log" 2>&1
  echo "forward bench rc=$? after ${SECONDS} s" >> "$dir/bench.log"
  timeout 90 python3 benchmarks/first_call.py --causal --out "$dir/first_call_h200.json" > "$dir/first_call.log" 2>&1
  echo "first_call rc=$? after ${SECONDS} s" >> "$dir/first_call.log"
}

backward_side() {  # $1: GPU
  local dir=$OUT/backward; mkdir -p "$dir"
  export CUDA_VISIBLE_DEVICES=$1 FA4_JAX_CACHE_DIR=/tmp/fa4_cache_gpu$1
  JAX_PLATFORMS=cpu timeout 150 python3 benchmarks/attention_backward.py --precompile-only --precompile-workers 8 \
    --variants default deterministic --head-dims 128 64 > "$dir/precompile.log" 2>&1 & local pre=$!
  (cd tests && XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 130 python3 -m pytest -q -rA -p no:cacheprovider \
    $TIMEOUT test_sm90_backward_large_heads.py) > "$dir/large_heads_tests.log" 2>&1
  echo "pytest rc=$? after ${SECONDS} s" >> "$dir/large_heads_tests.log"
  timeout 60 python3 benchmarks/sm90_backward_large_heads.py --out "$dir/large_heads.json" --head-dims 256 \
    --seq-lens 1024 4096 --iterations 10 > "$dir/large_heads_bench.log" 2>&1
  wait $pre
  timeout 220 python3 benchmarks/attention_backward.py --variants default deterministic --head-dims 128 64 256 \
    --iterations 10 --out "$dir/backward_h200.json" > "$dir/bench.log" 2>&1
  echo "backward bench rc=$? after ${SECONDS} s" >> "$dir/bench.log"
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout $((570 - SECONDS)) python3 -m pytest -q -rA -n 4 -p no:cacheprovider \
    tests/test_sanitizer.py > "$dir/sanitizer.log" 2>&1
  echo "sanitizer rc=$? after ${SECONDS} s" >> "$dir/sanitizer.log"
}

if [ "$GPUS" -ge 2 ]; then forward_side 0 & backward_side 1 & wait; else forward_side 0; backward_side 0; fi
grep -E "passed|failed|rc=" "$OUT/forward/gpu_tests.log" | tail -3; grep -E "^FAILED|^ERROR" "$OUT/forward/gpu_tests.log" | head -10
grep -E "D=|rc=" "$OUT/forward/bench.log" | tail -32; tail -4 "$OUT/forward/first_call.log"
grep -E "^(FAILED|ERROR)|passed|failed|rc=" "$OUT/backward/large_heads_tests.log" | head -24; grep "^D=" "$OUT/backward/large_heads_bench.log"
tail -26 "$OUT/backward/bench.log"; grep -E "passed|failed|rc=" "$OUT/backward/sanitizer.log" | tail -3
