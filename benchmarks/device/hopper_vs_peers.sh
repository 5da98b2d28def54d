#!/usr/bin/env bash
# Issue 12's benchmark in one device call on one H200: fa4_jax vs cuDNN vs FA4's own kernels (the peer
# bundle, imported as fa4peer), forward and backward, every row of benchmarks/hopper_vs_peers.py in one
# process on the same inputs, fa4_jax's kernels precompiled alongside in 12 CPU-only processes.
# Writes into $OUT: NAME.json (rewritten after every row), NAME.log and, where matplotlib is, NAME.png
# (NAME from the environment, hopper_vs_peers by default); prints the table last. Expected 5-7 minutes (the script's
# docstring says where it goes); --max-seconds and the timeout keep it inside one 9-minute call.
# Usage (device machine, repo root; carry [".dev/cute", ".dev/peer"], or only .dev/peer on a machine an
# earlier call unpacked the CuTe DSL on: cute_env.sh):
#   bash benchmarks/device/hopper_vs_peers.sh REV [more benchmark arguments, e.g. --quick or --rows REGEX]
set -u
REV=$1
PEER=1 source "$(dirname "$0")/cute_env.sh" || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH CUTE_DSL_ARCH=sm_90a FA4_GIT_REVISION=$REV PYTHONUNBUFFERED=1 \
  FA4_JAX_CACHE_DIR=/tmp/fa4_hopper_vs_peers_cache
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
NAME=${NAME:-hopper_vs_peers}   # the output files' stem (e.g. NAME=head_dims with --grid head-dims)
LOG=$OUT/$NAME.log
RESULT=$OUT/${NAME}.json

# LIMIT / MAX_SECONDS (environment): the run's hard limit and the benchmark's own budget, smaller where one
# call runs both grids.
timeout "${LIMIT:-520}" python3 benchmarks/hopper_vs_peers.py --out "$RESULT" --precompile-workers 12 --iterations 20 \
  --max-seconds "${MAX_SECONDS:-430}" "${@:2}" > "$LOG" 2>&1
STATUS=$?
echo "benchmark rc=$STATUS after ${SECONDS} s"
timeout 40 python3 benchmarks/hopper_vs_peers.py --plot "$RESULT" "$OUT/$NAME.png" > "/tmp/plot_$NAME.log" 2>&1 \
  || echo "no PNG here (see /tmp/plot_$NAME.log): plot $RESULT locally with --plot"
grep -m 3 -E "fa4peer not importable|Traceback" "$LOG"
if [ "$STATUS" -eq 0 ]; then sed -n '/^row /,$p' "$LOG"; else tail -n 60 "$LOG"; fi
