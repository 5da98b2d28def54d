#!/usr/bin/env bash
# Issue 16's result on an H200: benchmarks/decode.py's whole grid (B 1 / 8 / 64 x contexts 1k-128k x Sq 1 / 4
# x pages of 16 / 64: our kernels, Pallas' where they run, the reference where it fits), one process per
# batch size (each measures its own copy bandwidth, so a process cut short loses only its own rows), merged
# into decode_h200.json and plotted. The rows need ~120 GB at B = 64, 128k (cache and Pallas' copy of it):
# an H200 only; FORCE=1 runs it elsewhere (its rows past memory then fail and are recorded as errors).
# About 9 minutes; LIMITS (seconds per batch size) keeps it inside one call.
# Usage (device machine, repo root, bundle sourced): bash benchmarks/device/decode_h200.sh REV
set -u
REV=$1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
NAME=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
if [[ "$NAME" != *H200* && "${FORCE:-0}" != 1 ]]; then echo "not an H200 ($NAME): FORCE=1 to run anyway"; exit 2; fi
export PYTHONPATH=$PWD:${PYTHONPATH:-} CUTE_DSL_ARCH=sm_90a FA4_GIT_REVISION=$REV PYTHONUNBUFFERED=1 \
  XLA_PYTHON_CLIENT_PREALLOCATE=false FA4_JAX_CACHE_DIR=/tmp/fa4_kernels
read -r -a LIMITS <<< "${LIMITS:-140 160 250}"
BATCHES=(1 8 64)
PARTS=()
for i in 0 1 2; do
  b=${BATCHES[$i]}
  timeout "${LIMITS[$i]}" python3 benchmarks/decode.py --batches "$b" --compile-workers 12 \
    --out "/tmp/decode_b$b.json" > "/tmp/decode_b$b.log" 2>&1
  echo "B=$b rc=$? after $SECONDS s"
  [ -s "/tmp/decode_b$b.json" ] && PARTS+=("/tmp/decode_b$b.json")
done
python3 benchmarks/decode.py --merge "${PARTS[@]}" --out "$OUT/decode_h200.json" && \
  python3 benchmarks/decode.py --plot "$OUT/decode_h200.json" --png "$OUT/decode_h200.png"
cat /tmp/decode_b*.log | grep -E "^B=|copy" > "$OUT/decode_h200.log"
tail -50 "$OUT/decode_h200.log"
