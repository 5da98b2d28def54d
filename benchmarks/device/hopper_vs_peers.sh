#!/usr/bin/env bash
# Issue 12's benchmark in one device call on one H200: fa4_jax vs cuDNN vs FA4's own kernels (the peer
# bundle, imported as fa4peer), forward and backward, every row of benchmarks/hopper_vs_peers.py in one
# process on the same inputs, fa4_jax's kernels precompiled alongside in 12 CPU-only processes.
# Writes into $OUT: hopper_vs_peers_h200.json (rewritten after every row), hopper_vs_peers.log and, where
# matplotlib is, hopper_vs_peers_h200.png; prints the table last. Expected 5-7 minutes (the script's
# docstring says where it goes); --max-seconds and the timeout keep it inside one 9-minute call.
# Usage (device machine, repo root; carry [".dev/cute", ".dev/peer"]):
#   bash benchmarks/device/hopper_vs_peers.sh REV [more benchmark arguments, e.g. --quick or --rows REGEX]
set -u
REV=$1
source .dev/cute/setup.sh || { echo "the CuTe DSL bundle (.dev/cute) did not set up"; exit 1; }
mkdir -p /tmp/peersite && tar xJf .dev/peer/peer-site.tar.xz -C /tmp/peersite
# fa4peer imports jaxtyping (for annotations only), which the peer bundle leaves out; where the machine
# lacks it, .dev/peer/peer-deps.tar.xz (jaxtyping and wadler_lindig, pure Python) supplies it.
python3 -c "import jaxtyping" 2>/dev/null || { [ -f .dev/peer/peer-deps.tar.xz ] && tar xJf .dev/peer/peer-deps.tar.xz -C /tmp/peersite; }
export PYTHONPATH=$PWD:/tmp/peersite:$PYTHONPATH CUTE_DSL_ARCH=sm_90a FA4_GIT_REVISION=$REV PYTHONUNBUFFERED=1 \
  FA4_JAX_CACHE_DIR=/tmp/fa4_hopper_vs_peers_cache
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
LOG=$OUT/hopper_vs_peers.log
RESULT=$OUT/hopper_vs_peers_h200.json

timeout 520 python3 benchmarks/hopper_vs_peers.py --out "$RESULT" --precompile-workers 12 --iterations 20 \
  --max-seconds 430 "${@:2}" > "$LOG" 2>&1
STATUS=$?
echo "benchmark rc=$STATUS after ${SECONDS} s"
timeout 40 python3 benchmarks/hopper_vs_peers.py --plot "$RESULT" "$OUT/hopper_vs_peers_h200.png" > "$OUT/plot.log" 2>&1 \
  || echo "no PNG here (see plot.log): plot $RESULT locally with --plot"
grep -m 3 -E "fa4peer not importable|Traceback" "$LOG"
if [ "$STATUS" -eq 0 ]; then sed -n '/^row /,$p' "$LOG"; else tail -n 60 "$LOG"; fi
