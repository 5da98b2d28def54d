#!/usr/bin/env bash
# Issue 15 part 2 on one H200, one device call (<= 8 minutes): the sm90 tangent kernel's GPU tests (against
# the float64 oracle; jax.jvp / linearize / jacfwd through the API), then benchmarks/tangent.py (jax.jvp of
# fa4_jax.attention vs the peer bundle's fused JVP, and the tangent alone vs the blocked pure-JAX pass).
# Writes into $OUT: tangent_tests.log, tangent_tests.xml, tangent_h200.json, tangent_bench.log.
# Usage (device machine, repo root; carry [".dev/cute", ".dev/peer"]):  bash benchmarks/device/tangent.sh REV
set -u
REV=${1:-unknown}
source .dev/cute/setup.sh || { echo "the CuTe DSL bundle (.dev/cute) did not set up"; exit 1; }
mkdir -p /tmp/peersite && tar xJf .dev/peer/peer-site.tar.xz -C /tmp/peersite
python3 -c "import jaxtyping" 2>/dev/null || { [ -f .dev/peer/peer-deps.tar.xz ] && tar xJf .dev/peer/peer-deps.tar.xz -C /tmp/peersite; }
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false FA4_GIT_REVISION=$REV PYTHONUNBUFFERED=1 \
  FA4_JAX_CACHE_DIR=/tmp/fa4_tangent_cache
timeout 260 python3 -m pytest -p no:cacheprovider -q -x --junitxml="$OUT/tangent_tests.xml" \
  tests/test_sm90_tangent.py "tests/test_forward_mode.py::test_jvp_and_grad_on_gpu" > "$OUT/tangent_tests.log" 2>&1
echo "tests rc=$? after ${SECONDS} s"; tail -n 25 "$OUT/tangent_tests.log"
# The peer only in the benchmark's process (never on the tests' path).
PYTHONPATH=$PYTHONPATH:/tmp/peersite timeout 200 python3 benchmarks/tangent.py --out "$OUT/tangent_h200.json" \
  --iterations 20 --max-seconds 150 > "$OUT/tangent_bench.log" 2>&1
echo "benchmark rc=$? after ${SECONDS} s"; grep -E "^row |fa4peer not importable|Traceback|Error" "$OUT/tangent_bench.log" | head -20
