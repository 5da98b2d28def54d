#!/usr/bin/env bash
# The three sweeps prepared at the end of the 2026-11-29 session, in one device call (each is the
# command its document gives, run as written): the forward `warpgroup_key_range` candidate
# (docs/sm90_forward_tuning.md), the backward `per_thread_query_release` racecheck and timing
# (docs/sm90_backward_tuning.md), the large-head backward's `diagonal_first` / `stagger=False` options
# (docs/sm90_backward_tuning.md, "Large head dims: the prepared candidates"; both backward sweeps time
# through benchmarks/attention_backward.py). With two GPUs: forward then large-head on GPU 0, backward on
# GPU 1; with one, one after the other. Outputs in $OUT/next_sweeps.tgz (the device tool returns few files).
# Usage (device machine, repo root, bundle sourced; docs/device.md): bash benchmarks/device/next_sweeps.sh REV
# (no `set -u`: the documents' commands expand variables the bundle may leave unset)
REV=$1
ROOT=$PWD
OUT_ALL=${OUT:-/tmp/out}
GPUS=$(nvidia-smi -L | wc -l)

forward() { mkdir -p "$OUT_ALL/forward"; (OUT=$OUT_ALL/forward; cd "$ROOT"; CUDA_VISIBLE_DEVICES=$1; export CUDA_VISIBLE_DEVICES
  export PYTHONPATH=$PWD:$PYTHONPATH CUTE_DSL_ARCH=sm_90a FA4_GIT_REVISION=$REV; JAX_PLATFORMS=cpu timeout 100 python3 benchmarks/attention.py --compile-only --compile-workers 6 > $OUT/compile.log 2>&1 & COMPILE=$!; XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 110 python3 -m pytest -q -n 4 -p no:cacheprovider tests/test_sm90_forward.py -k "variant or causal-d256" --junitxml=$OUT/variant_tests.xml > $OUT/variant_tests.log 2>&1; tail -4 $OUT/variant_tests.log; wait $COMPILE; tail -2 $OUT/compile.log; timeout 150 python3 benchmarks/attention.py --variants --iterations 10 --max-seconds 110 --exclude-failed $OUT/variant_tests.xml --out $OUT/forward_variants3_h200.json > $OUT/variants_bench.log 2>&1; tail -8 $OUT/variants_bench.log) > "$OUT_ALL/forward/summary.txt" 2>&1; }
backward() { mkdir -p "$OUT_ALL/backward"; (OUT=$OUT_ALL/backward; cd "$ROOT"; CUDA_VISIBLE_DEVICES=$1; export CUDA_VISIBLE_DEVICES
  export PYTHONPATH=$PWD:$PYTHONPATH CUTE_DSL_ARCH=sm_90a FA4_GIT_REVISION=$REV FA4_JAX_CACHE_DIR=/tmp/fa4_kernels PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false; G="--variants default per_thread_release --head-dims 128 64 --seq-lens 1024 4096 16384"; JAX_PLATFORMS=cpu timeout 100 python3 benchmarks/attention_backward.py --precompile-only --precompile-workers 6 $G > $OUT/precompile.log 2>&1 & PRE=$!; timeout 170 compute-sanitizer --tool racecheck --racecheck-report all --print-limit 12 python3 -c "import dataclasses,sys;sys.path[:0]=['.','tests'];from fa4_jax.kernels.sm90 import backward as b;t=dataclasses.replace(b.DEFAULT_TUNING,per_thread_query_release=True);o=b.options;b.options=lambda c,p,tuning=t:o(c,p,tuning);import sanitizer_cases;sanitizer_cases.run('backward')" > $OUT/racecheck_backward_per_thread_release_h200.log 2>&1 & RACE=$!; timeout 110 python3 -m pytest -q -rA -n 6 -p no:cacheprovider --timeout 90 --timeout-method thread tests/test_sm90_backward.py -k per_thread_release > $OUT/gpu_tests.log 2>&1; echo "pytest rc=$?" >> $OUT/gpu_tests.log; wait $PRE $RACE; tail -1 $OUT/precompile.log; timeout 110 python3 benchmarks/attention_backward.py --out $OUT/backward_per_thread_release_h200.json $G --iterations 10 --variants-passing $OUT/gpu_tests.log > $OUT/bench.log 2>&1; echo "bench rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/gpu_tests.log | tail -6; grep -c ": ran" $OUT/racecheck_*.log; grep -E "RACECHECK SUMMARY|Error:" $OUT/racecheck_*.log | sort | uniq -c | head -8; tail -14 $OUT/bench.log) > "$OUT_ALL/backward/summary.txt" 2>&1; }
large_heads() { mkdir -p "$OUT_ALL/large_heads"; (OUT=$OUT_ALL/large_heads; cd "$ROOT"; CUDA_VISIBLE_DEVICES=$1; export CUDA_VISIBLE_DEVICES
  export PYTHONPATH=$PWD:$PYTHONPATH CUTE_DSL_ARCH=sm_90a FA4_GIT_REVISION=$REV FA4_JAX_CACHE_DIR=/tmp/fa4_kernels PYTHONUNBUFFERED=1; G="--variants default no_stagger deterministic deterministic_diagonal_first --head-dims 256 --seq-lens 1024 4096 16384"; JAX_PLATFORMS=cpu timeout 100 python3 benchmarks/attention_backward.py --precompile-only --precompile-workers 6 $G > $OUT/precompile.log 2>&1 & PRE=$!; XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 105 python3 -m pytest -v -rfE -n 8 -p no:cacheprovider --timeout 60 --timeout-method thread tests/test_sm90_backward_large_heads.py -k "no_stagger or diagonal_first or lowest_first" > $OUT/gpu_tests.log 2>&1; echo "pytest rc=$?" >> $OUT/gpu_tests.log; wait $PRE; tail -1 $OUT/precompile.log; timeout 120 python3 benchmarks/attention_backward.py --out $OUT/large_heads_h200.json $G --iterations 10 --variants-passing $OUT/gpu_tests.log > $OUT/bench.log 2>&1; echo "bench rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" $OUT/gpu_tests.log | tail -8; tail -9 $OUT/bench.log) > "$OUT_ALL/large_heads/summary.txt" 2>&1; }

if [ "$GPUS" -ge 2 ]; then
  (forward 0; large_heads 0) & backward 1 & wait
else
  forward 0; backward 0; large_heads 0
fi
for part in forward backward large_heads; do echo "== $part"; tail -20 "$OUT_ALL/$part/summary.txt"; done
cd "$OUT_ALL" && tar czf next_sweeps.tgz forward backward large_heads && rm -rf forward backward large_heads
