#!/usr/bin/env bash
# The forward and backward tuning sweeps of docs/sm90_{forward,backward}_tuning.md in one device call.
# With two GPUs they run side by side, one per GPU (each sweep is one process on one GPU timing fa4_jax
# against cuDNN on the same inputs, so the ratios stay same-run ratios); with one GPU, one after the other.
# Outputs in $OUT/tuning_sweeps.tgz (the device tool returns at most 8 files; the two sweeps write 9).
# Usage (device machine, repo root, bundle sourced; docs/device.md):
#   bash benchmarks/device/tuning_sweeps.sh REV [forward|backward]   (both when not named)
# VARIANT_TESTS (environment): the forward variant tests' -k (default every variant's; 65 cases outgrew the
# 220 s at rev bc0bd69, and then every variant is timed, none excluded); e.g. "variant and split" for the
# split-loop candidates alone.
set -u
export PYTHONPATH=$PWD:${PYTHONPATH:-} CUTE_DSL_ARCH=sm_90a FA4_GIT_REVISION=$1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
GPUS=$(nvidia-smi -L | wc -l)
# The results are named after the GPU they ran on (h100, h200, ...), not the one the sweep was written for.
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -i 'h[0-9]\+' | head -1 | tr 'H' 'h')
CARD=${CARD:-gpu}

forward() {  # $1: GPU index
  local dir=$OUT/forward; mkdir -p "$dir"
  export FA4_JAX_CACHE_DIR=/tmp/fa4_forward_cache CUDA_VISIBLE_DEVICES=$1
  JAX_PLATFORMS=cpu timeout 220 python3 benchmarks/attention.py --compile-only --compile-workers 5 \
    > "$dir/compile.log" 2>&1 & local compile=$!
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 220 python3 -m pytest -q -n 8 -p no:cacheprovider \
    tests/test_sm90_forward.py -k "${VARIANT_TESTS:-variant}" --junitxml="$dir/variant_tests.xml" > "$dir/variant_tests.log" 2>&1
  wait $compile
  timeout 300 python3 benchmarks/attention.py --variants --iterations 10 --max-seconds 230 \
    --exclude-failed "$dir/variant_tests.xml" --out "$dir/forward_variants_$CARD.json" > "$dir/bench.log" 2>&1
  echo "forward bench rc=$?" >> "$dir/bench.log"
}

backward() {  # $1: GPU index
  local dir=$OUT/backward; mkdir -p "$dir"
  export FA4_JAX_CACHE_DIR=/tmp/fa4_backward_cache CUDA_VISIBLE_DEVICES=$1
  JAX_PLATFORMS=cpu timeout 210 python3 benchmarks/attention_backward.py --precompile-only --precompile-workers 8 \
    --head-dims 128 64 --seq-lens 1024 4096 16384 > "$dir/precompile.log" 2>&1 & local pre=$!
  XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 220 python3 -m pytest -q -rA -n 6 -p no:cacheprovider \
    --timeout 120 --timeout-method thread tests/test_sm90_backward.py > "$dir/gpu_tests.log" 2>&1
  echo "pytest rc=$?" >> "$dir/gpu_tests.log"
  wait $pre
  timeout 300 python3 benchmarks/attention_backward.py --out "$dir/backward_variants_$CARD.json" \
    --head-dims 128 64 --seq-lens 1024 4096 16384 --iterations 10 --variants-passing "$dir/gpu_tests.log" \
    > "$dir/bench.log" 2>&1
  echo "backward bench rc=$?" >> "$dir/bench.log"
}

case "${2:-both}" in
  forward) forward 0 ;;
  backward) backward 0 ;;
  both) if [ "$GPUS" -ge 2 ]; then forward 0 & backward 1 & wait; else forward 0; backward 0; fi ;;
  *) echo "usage: $0 REV [forward|backward]"; exit 2 ;;
esac
[ -d "$OUT/forward" ] && { tail -3 "$OUT/forward/variant_tests.log"; tail -24 "$OUT/forward/bench.log"; }
[ -d "$OUT/backward" ] && { grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/backward/gpu_tests.log" | tail -8
                            tail -16 "$OUT/backward/bench.log"; }
cd "$OUT" && tar czf tuning_sweeps.tgz $(ls -d forward backward 2>/dev/null) && rm -rf forward backward
