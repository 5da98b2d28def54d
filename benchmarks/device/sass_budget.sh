#!/usr/bin/env bash
# The sm90 backward's SASS-budget changes (docs/sm90_backward_tuning.md, "SASS budget of the consumer
# loop"): GPU tests of the default paths they touch and of the `ds_stmatrix` candidate, then the default
# timed before (rev 03bcea4, a copy in .dev/before) and after, and `ds_stmatrix`, on one H200.
# Before the call, from the repository root:
#   mkdir -p .dev/before && git archive 03bcea4 fa4_jax benchmarks tests | tar -x -C .dev/before
# then, carry [".dev/cute", ".dev/before"], kind nvidia-h200, one call per part:
#   source .dev/cute/setup.sh && bash benchmarks/device/sass_budget.sh tests REV          (<= 480 s)
#   source .dev/cute/setup.sh && bash benchmarks/device/sass_budget.sh bench REV [LOG]    (<= 560 s)
# LOG: the tests part's gpu_tests.log (put it in the tree first); with it `ds_stmatrix` is timed only if
# its tests passed (benchmarks/attention_backward.py --variants-passing).
PART=$1
REV=$2
LOG=$3
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:$PYTHONPATH CUTE_DSL_ARCH=sm_90a FA4_GIT_REVISION=$REV FA4_JAX_CACHE_DIR=/tmp/fa4_kernels \
  PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false

if [ "$PART" = tests ]; then
  # Every path of the default the change reaches (the walk with and without head splits, key blocks
  # outer, 64 and 128 query rows, deterministic turns) and the candidate's 47 tests.
  K="(default or ds_stmatrix or flat_dq or key_blocks_outer or query_rows_128 or reproducible or public_api)"
  K="$K and not tiled_dq and not sanitizer_shapes"
  timeout 470 python3 -m pytest -q -rA -n 14 -p no:cacheprovider --timeout 200 --timeout-method thread \
    tests/test_sm90_backward.py -k "$K" > "$OUT/gpu_tests.log" 2>&1
  echo "pytest rc=$?" >> "$OUT/gpu_tests.log"
  grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20
  tail -2 "$OUT/gpu_tests.log"
  exit 0
fi

G="--head-dims 128 64 --seq-lens 1024 4096 16384 --iterations 10"
AFTER="--variants default ds_stmatrix"
[ -n "$LOG" ] && AFTER="$AFTER --variants-passing $LOG"
(cd .dev/before && PYTHONPATH=$PWD:$PYTHONPATH JAX_PLATFORMS=cpu timeout 150 python3 benchmarks/attention_backward.py \
  --precompile-only --precompile-workers 7 --variants default $G > "$OUT/precompile_before.log" 2>&1) &
PRE=$!
JAX_PLATFORMS=cpu timeout 150 python3 benchmarks/attention_backward.py --precompile-only --precompile-workers 7 \
  --variants default ds_stmatrix $G > "$OUT/precompile_after.log" 2>&1
wait $PRE
tail -qn1 "$OUT/precompile_before.log" "$OUT/precompile_after.log"
(cd .dev/before && PYTHONPATH=$PWD:$PYTHONPATH FA4_GIT_REVISION=03bcea4 timeout 180 python3 benchmarks/attention_backward.py --variants default $G \
  --out "$OUT/backward_before_h200.json" > "$OUT/bench_before.log" 2>&1)
echo "before rc=$?"
timeout 200 python3 benchmarks/attention_backward.py $AFTER $G --out "$OUT/backward_sass_budget_h200.json" \
  > "$OUT/bench_after.log" 2>&1
echo "after rc=$?"
python3 - "$OUT/backward_before_h200.json" "$OUT/backward_sass_budget_h200.json" <<'EOF'
import json, sys
before, after = (json.load(open(path))["rows"] for path in sys.argv[1:])
print("D causal S | cuDNN ms | default before -> after ms (speedup) | ds_stmatrix ms (vs after) | x cuDNN before/after/stmatrix")
for old, new in zip(before, after):
    b, a, s = old.get("default_ms"), new.get("default_ms"), new.get("ds_stmatrix_ms")
    ratio = lambda row, name: row.get(f"{name}_vs_cudnn", float("nan"))
    print(f"{new['head_dim']} {int(new['causal'])} {new['seq_len']:5d} | {new.get('cudnn_ms', float('nan')):.3f} | "
          f"{b:.3f} -> {a:.3f} ({b / a:.3f}x) | " + (f"{s:.3f} ({a / s:.3f}x)" if s else "-") +
          f" | {ratio(old, 'default'):.2f} / {ratio(new, 'default'):.2f} / {ratio(new, 'ds_stmatrix'):.2f}"
          f" | repeat {old.get('default_repeat_ms', 0):.3f} / {new.get('default_repeat_ms', 0):.3f}")
EOF
