#!/usr/bin/env bash
# One device call for issue 16 with the combine kernel as the default merge (DecodeOptions.combine = "kernel"):
#   tests    every paged decode case through the API on the default options, and the XLA merge as the
#            variant (`-k xla_combine`), against the float64 oracle (tests/test_sm90_decode.py)
#   grid     benchmarks/decode.py at B = $BATCHES (default 1; GRID_LIMIT s, default 150), every context, page and query length, the XLA
#            merge timed beside the default (fa4_jax_xla_combine_ms, fa4_jax_run_ms): decode_b<BATCHES>.json (commas as _)
#   kernels  CUPTI time of each kernel of one call (the API against the XLA merge): decode_kernel_times.json
# Meanwhile the CPU fills the kernel cache of hopper_vs_peers.py's two grids (the next call's, with the peer),
# so that call spends its time on the GPU. Four files in $OUT. About 300 s, plus GRID_LIMIT beyond 150.
# Usage (device machine, repo root, bundle sourced): bash benchmarks/device/decode_default_combine.sh REV
set -u
REV=$1
OUT=${OUT:-/tmp/out}
BATCHES=${BATCHES:-1}
export PYTHONPATH=$PWD:${PYTHONPATH:-} CUTE_DSL_ARCH=sm_90a FA4_GIT_REVISION=$REV PYTHONUNBUFFERED=1 \
  XLA_PYTHON_CLIENT_PREALLOCATE=false
PEERS_CACHE=/tmp/fa4_hopper_vs_peers_cache
# Its own process group, stopped 300 s after the start (below); the cache's writes are atomic, and what it
# leaves uncompiled the next call compiles.
PRECOMPILE=   # PEER_PRECOMPILE=0: none (no peer call follows)
if [ "${PEER_PRECOMPILE:-1}" = 1 ]; then
  setsid bash -c "for grid in head-dims issue12; do
      JAX_PLATFORMS=cpu FA4_JAX_CACHE_DIR=$PEERS_CACHE python3 benchmarks/hopper_vs_peers.py \
        --grid \$grid --precompile-only --precompile-workers 8 --no-peer --out /tmp/precompile_\$grid.json
    done" > /tmp/precompile_peers.log 2>&1 &
  PRECOMPILE=$!
fi
export FA4_JAX_CACHE_DIR=/tmp/fa4_kernels
LOG=/tmp/decode_default_combine.log
timeout 110 python3 -m pytest -v -n 8 -p no:cacheprovider --timeout 100 tests/test_sm90_decode.py \
  -k "not page_lookahead" > $LOG 2>&1
echo "pytest rc=$?" >> $LOG
grep -E "^(FAILED|ERROR)|passed|failed|pytest rc" $LOG | tail -8
timeout ${GRID_LIMIT:-150} python3 benchmarks/decode.py --batches $BATCHES --option-variants xla_combine --compile-workers 8 \
  --out "$OUT/decode_b${BATCHES//,/_}.json" >> $LOG 2>&1
echo "grid rc=$?"; grep -E "^B=|copy" $LOG | tail -34
[ "${KERNEL_TIMES:-1}" = 1 ] && timeout 50 python3 benchmarks/device/decode_kernel_times.py --variants api,xla_combine \
  --out "$OUT/decode_kernel_times.json" 2>&1 | grep -E "^B=" | tee -a $LOG
xz -9 -c $LOG > "$OUT/decode_default_combine.log.xz"
while [ -n "$PRECOMPILE" ] && kill -0 $PRECOMPILE 2>/dev/null && [ $SECONDS -lt 300 ]; do sleep 5; done
if [ -n "$PRECOMPILE" ]; then
  kill -- -$PRECOMPILE 2>/dev/null
  echo "precompile of the peer grids: $(tail -2 /tmp/precompile_peers.log | tr '\n' ' ')"
fi
