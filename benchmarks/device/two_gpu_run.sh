#!/usr/bin/env bash
# Issue 7 in one device call on two H200s, in under 540 s:
#  1. the two-GPU tests of tests/test_train_gpt.py: heads-sharded attention compiles to the CuTe kernels
#     with no collective, and the model-parallel GPT step has the same collectives with fa4_jax attention
#     as with cuDNN's (attention adds none);
#  2. GPT training (the 1-GPU run's model, global batch 16 so each data shard keeps 8 sequences) with
#     cuDNN, then fa4_jax attention, on a data=2 mesh and on a data=1,model=2 mesh: same seed, data, steps.
# Writes logs, each run's JSON, the summary train_gpt_2xh200.json and (where matplotlib is) its PNG into
# $OUT/two_gpu_run.tgz (the device tool returns at most 8 files; it writes 14 or more); prints the table last.
# Usage (device machine, repo root, bundle sourced; docs/device.md): bash benchmarks/device/two_gpu_run.sh REV
set -u
export PYTHONPATH=$PWD:${PYTHONPATH:-} CUTE_DSL_ARCH=sm_90a FA4_GIT_REVISION=$1 PYTHONUNBUFFERED=1 \
  FA4_JAX_CACHE_DIR=/tmp/fa4_two_gpu_cache
OUT=${OUT:-/tmp/out}
WORK=$OUT/two_gpu_run; mkdir -p "$WORK"
SUMMARY=$WORK/train_gpt_2xh200.json
nvidia-smi -L > "$WORK/gpus.txt" 2>&1

XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 170 python3 -m pytest -q -rA -p no:cacheprovider -m gpu \
  tests/test_train_gpt.py > "$WORK/two_gpu_tests.log" 2>&1
echo "pytest rc=$? after ${SECONDS} s" >> "$WORK/two_gpu_tests.log"

# The summary is rewritten after every run, so a cut-off call keeps the runs that finished.
timeout $((500 - SECONDS)) python3 benchmarks/train_gpt_compare.py run --out "$WORK" \
  --name "$(basename "$SUMMARY")" --timeout 90 --meshes data=2 data=1,model=2 -- \
  --dtype bfloat16 --layers 6 --d-model 1024 --heads 8 --seq-len 2048 --batch 16 --vocab 1024 \
  --steps 120 --learning-rate 1e-3 > "$WORK/compare.log" 2>&1
echo "compare rc=$? after ${SECONDS} s" >> "$WORK/compare.log"

timeout 30 python3 benchmarks/train_gpt_compare.py plot "$SUMMARY" --png "$WORK/train_gpt_2xh200.png" \
  > "$WORK/plot.log" 2>&1 || echo "no PNG here (see plot.log): plot $SUMMARY locally" >> "$WORK/plot.log"

cat "$WORK/gpus.txt"
grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|rc=" "$WORK/two_gpu_tests.log" | tail -8
grep -E "^[a-z0-9_]+: exit|rc=" "$WORK/compare.log"; tail -1 "$WORK/plot.log"
python3 benchmarks/train_gpt_compare.py table "$SUMMARY" | cut -c1-400
cd "$OUT" && tar czf two_gpu_run.tgz two_gpu_run && rm -rf two_gpu_run
