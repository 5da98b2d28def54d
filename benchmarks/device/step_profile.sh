#!/usr/bin/env bash
# Issue 7's open question in one device call on two H200s: where the data=1,model=2 GPT step spends
# the ~0.8 ms it loses against cuDNN (and data=2 for contrast). benchmarks/step_kernels.py per mesh and
# attention backend, then the category tables side by side. Outputs in $OUT/step_profile.tgz.
# Usage (device machine, repo root, bundle sourced; docs/device.md): bash benchmarks/device/step_profile.sh REV
export PYTHONPATH=$PWD:${PYTHONPATH:-} CUTE_DSL_ARCH=sm_90a FA4_GIT_REVISION=$1 PYTHONUNBUFFERED=1 \
  FA4_JAX_CACHE_DIR=/tmp/fa4_step_profile_cache
OUT=${OUT:-/tmp/out}
WORK=$OUT/step_profile; mkdir -p "$WORK"
MODEL="--dtype bfloat16 --layers 6 --d-model 1024 --heads 8 --seq-len 2048 --batch 16 --vocab 1024"
for mesh in data=1,model=2 data=2; do
  tag=${mesh//[=,]/_}
  for attention in cudnn fa4; do
    timeout 120 python3 benchmarks/step_kernels.py --attention "$attention" --repeats 10 \
      --out "$WORK/${tag}_$attention.json" -- $MODEL --mesh "$mesh" > "$WORK/${tag}_$attention.log" 2>&1
    echo "$mesh $attention rc=$?"
  done
  echo "== $mesh"; python3 benchmarks/step_kernels.py --compare "$WORK/${tag}_cudnn.json" "$WORK/${tag}_fa4.json"
done
cd "$OUT" && tar czf step_profile.tgz step_profile && rm -rf step_profile
