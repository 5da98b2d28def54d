#!/usr/bin/env bash
# One device call after the mirrored causal order was measured (docs/sm90_forward_tuning.md, fifth round):
#   tests   MLA's 192/128 forward with its promoted set (128-key blocks, the store in two chunks), the
#           D = 64 causal warp-group candidates (d64-causal-two-warpgroups / -three-warpgroups) and the
#           tangent (jvp) kernel, whose causal calls with an even query-block count now walk mirrored
#           units (not yet run on a GPU)
#   timing  the forward variant rows, D = 64 causal 2k / 4k / 1k first (three warpgroups from 1472 rows:
#           hopper_vs_peers read D = 64 causal 2k slower with the mirrored order, 0.98 -> 0.94 of the
#           faster peer), against the old order and the other warp-group count; then MLA
#   (the deterministic backward candidates moved to backward_deterministic.sh, a call of their own)
# Meanwhile the CPU precompiles hopper_vs_peers.py's kernels into /tmp/fa4_kernels for the next call.
# Usage (device machine, repo root, bundle sourced): bash benchmarks/device/verify_sweeps.sh REV
set -u
REV=$1
OUT=${OUT:-/tmp/out}
export PYTHONPATH=$PWD:$PYTHONPATH CUTE_DSL_ARCH=sm_90a FA4_GIT_REVISION=$REV FA4_JAX_CACHE_DIR=/tmp/fa4_kernels \
  PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
JAX_PLATFORMS=cpu timeout 150 python3 benchmarks/attention.py --compile-only --compile-workers 6 \
  > "$OUT/compile_variants.log" 2>&1 &
VARIANTS=$!
# For the next call on the warm machine (the peer grids, with .dev/peer carried instead of .dev/cute).
(JAX_PLATFORMS=cpu timeout 400 python3 benchmarks/hopper_vs_peers.py --precompile-only --precompile-workers 3
 JAX_PLATFORMS=cpu timeout 150 python3 benchmarks/hopper_vs_peers.py --grid head-dims --precompile-only --precompile-workers 3) \
  > "$OUT/precompile_peers.log" 2>&1 &
PEERS_PRE=$!
timeout 200 python3 -m pytest -v -n 12 -p no:cacheprovider --timeout 190 tests/test_sm90_tangent.py \
  tests/test_sm90_forward.py -k "test_sm90_tangent or mla or d64-causal-t" --junitxml="$OUT/forward_tests.xml" > "$OUT/gpu_tests.log" 2>&1
echo "pytest rc=$?" >> "$OUT/gpu_tests.log"
grep -E "^(FAILED|ERROR)|passed|failed|pytest rc" "$OUT/gpu_tests.log" | tail -8
wait $VARIANTS; tail -1 "$OUT/compile_variants.log"
timeout 90 python3 benchmarks/attention.py --variants --iterations 10 --max-seconds 50 \
  --exclude-failed "$OUT/forward_tests.xml" --out "$OUT/forward_variants.json" > "$OUT/forward_bench.log" 2>&1
echo "forward bench rc=$?"; grep -E "^D=" "$OUT/forward_bench.log" | tail -16
wait $PEERS_PRE; grep -E "precompiled" "$OUT/precompile_peers.log"
