#!/usr/bin/env bash
# The defaults after a promotion, in one device call: the whole GPU test suite, the issue benchmarks
# (forward and backward against cuDNN), compute-sanitizer, cold/warm first-call time and the one-GPU
# GPT comparison. With two GPUs the forward side (GPU 0) and the backward side (GPU 1) run at once;
# each benchmark is one process on one GPU against cuDNN on the same inputs.
# Everything lands in $OUT/verify.tgz (the device tool returns only a few files).
# Usage (device machine, repo root, bundle sourced; docs/device.md): bash benchmarks/device/verify.sh REV
set -u
export PYTHONPATH=$PWD:${PYTHONPATH:-} CUTE_DSL_ARCH=sm_90a FA4_GIT_REVISION=$1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
WORK=$OUT/verify; mkdir -p "$WORK"
GPUS=$(nvidia-smi -L | wc -l)
TIMEOUT=$(python3 -c "import pytest_timeout" 2>/dev/null && echo "--timeout=150 --timeout-method=thread")

forward_side() {  # $1: GPU
  local dir=$WORK/forward; mkdir -p "$dir"
  export CUDA_VISIBLE_DEVICES=$1 FA4_JAX_CACHE_DIR=/tmp/fa4_cache_gpu$1
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 python3 -m pytest -q -rfE -n 12 -p no:cacheprovider $TIMEOUT \
    -m gpu --ignore=tests/test_sanitizer.py tests > "$dir/gpu_tests.log" 2>&1
  echo "pytest rc=$? after ${SECONDS} s" >> "$dir/gpu_tests.log"
  timeout 160 python3 benchmarks/attention.py --iterations 20 --xla-max-seq-len 8192 --out "$dir/forward_h200.json" \
    > "$dir/bench.log" 2>&1
  echo "forward bench rc=$? after ${SECONDS} s" >> "$dir/bench.log"
  timeout 60 python3 benchmarks/first_call.py --causal --out "$dir/first_call_h200.json" > "$dir/first_call.log" 2>&1
  echo "first_call rc=$? after ${SECONDS} s" >> "$dir/first_call.log"
  timeout $((560 - SECONDS)) python3 benchmarks/train_gpt_compare.py run --out "$dir/gpt" --timeout 80 -- \
    --dtype bfloat16 --layers 6 --d-model 1024 --heads 8 --seq-len 2048 --batch 8 --vocab 1024 --steps 120 \
    --learning-rate 1e-3 > "$dir/gpt.log" 2>&1
  echo "gpt rc=$? after ${SECONDS} s" >> "$dir/gpt.log"
}

backward_side() {  # $1: GPU
  local dir=$WORK/backward; mkdir -p "$dir"
  export CUDA_VISIBLE_DEVICES=$1 FA4_JAX_CACHE_DIR=/tmp/fa4_cache_gpu$1
  JAX_PLATFORMS=cpu timeout 150 python3 benchmarks/attention_backward.py --precompile-only --precompile-workers 10 \
    --variants default deterministic --head-dims 128 64 256 > "$dir/precompile.log" 2>&1 & local pre=$!
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 200 python3 -m pytest -q -rA -n 4 -p no:cacheprovider \
    tests/test_sanitizer.py > "$dir/sanitizer.log" 2>&1
  echo "sanitizer rc=$? after ${SECONDS} s" >> "$dir/sanitizer.log"
  wait $pre
  timeout $((560 - SECONDS)) python3 benchmarks/attention_backward.py --variants default deterministic \
    --head-dims 128 64 256 --iterations 10 --out "$dir/backward_h200.json" > "$dir/bench.log" 2>&1
  echo "backward bench rc=$? after ${SECONDS} s" >> "$dir/bench.log"
}

if [ "$GPUS" -ge 2 ]; then forward_side 0 & backward_side 1 & wait; else forward_side 0; backward_side 0; fi
cd "$WORK"
grep -E "passed|failed|rc=" forward/gpu_tests.log | tail -2; grep -E "^FAILED|^ERROR" forward/gpu_tests.log | head -10
grep -E "D=|rc=" forward/bench.log | tail -31; tail -4 forward/first_call.log
grep -E "exit|rc=" forward/gpt.log; python3 "$OLDPWD/benchmarks/train_gpt_compare.py" table forward/gpt/train_gpt_h200.json 2>&1 | cut -c1-300
tail -32 backward/bench.log | grep -E "D=|rc="; grep -E "passed|failed|rc=" backward/sanitizer.log | tail -3
cd "$OUT" && tar czf verify.tgz verify && rm -rf verify
