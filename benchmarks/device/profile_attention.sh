#!/usr/bin/env bash
# Nsight Compute profiles of the attention forward or backward, ours (fa4_jax) against FA4's own kernels
# (fa4peer), on the shapes given, one process per (library, shape). A backward profile catches the first 4
# launches whose name matches backward/bwd (our preprocess, main kernel and dQ convert; FA4's pre-, main and
# post-process), a forward one the second launch whose name matches forward/fwd (the first profiled call's,
# after the warm-up call), with `--set full`; the report's pages come back as text (ncu_pages.sh).
# Usage (device machine, repo root; carry [".dev/cute", ".dev/peer"], or what cute_env.sh says):
#   bash benchmarks/device/profile_attention.sh backward "4 4096 16/16 128" "2 4096 64/8 128 causal" ...
#   bash benchmarks/device/profile_attention.sh forward "2 8192 16/16 128"
# LIBRARIES (environment; default "fa4_jax fa4peer") picks the profiled libraries; fa4_jax_deterministic is
# fa4_jax with deterministic=True.
# NCU_ARGS (environment) goes to ncu before the rest, e.g. "--replay-mode application": our forward's
# process segfaulted under the default kernel replay at rev c09cd79 (an H100, B 2, S 8k, D 128), 9 s in.
set -u
PASS=$1
shift
if [ "$PASS" = forward ]; then SELECT=(--kernel-name "regex:(?i)forward|fwd" --launch-skip 1 --launch-count 1)
else SELECT=(--kernel-name "regex:(?i)backward|bwd" --launch-count 4); fi
LIBRARIES=${LIBRARIES:-fa4_jax fa4peer}
PEER=0; [[ " $LIBRARIES " == *" fa4peer "* ]] && PEER=1   # the peer bundle only where FA4 is profiled
PEER=$PEER source "$(dirname "$0")/cute_env.sh" || exit 1
export PYTHONPATH=$PWD:$PYTHONPATH CUTE_DSL_ARCH=sm_90a PYTHONUNBUFFERED=1 \
  FA4_JAX_CACHE_DIR=${FA4_JAX_CACHE_DIR:-/tmp/fa4_profile_cache} XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
for shape in "$@"; do
  read -r batch seq heads head_dim causal <<< "$shape"
  flag=""; [ "${causal:-}" = "causal" ] && flag="--causal"
  tag="${PASS}_B${batch}_S${seq}_H${heads/\//-}_D${head_dim}${causal:+_causal}"
  for library in $LIBRARIES; do
    name="$OUT/${library}_${tag}"
    extra=$flag
    [ "$library" = fa4_jax_deterministic ] && { library=fa4_jax; extra="$flag --deterministic"; }
    # shellcheck disable=SC2086  # NCU_ARGS: words meant to split
    timeout 150 ncu ${NCU_ARGS:-} --set full --import-source no "${SELECT[@]}" \
      -f -o "$name" python3 benchmarks/profile_attention.py --pass "$PASS" --library "$library" --batch "$batch" \
      --seq "$seq" --heads "$heads" --head-dim "$head_dim" $extra --calls 1 > "$name.log" 2>&1
    echo "$(basename "$name"): ncu rc=$? after ${SECONDS} s"
    bash "$(dirname "$0")/ncu_pages.sh" "$name"   # details, stall samples, raw metrics
    # One line per kernel: name, duration, SM throughput, tensor pipe, registers, stall summary.
    grep -E "^  [A-Za-z_].*\(|^    Duration|^    Compute \(SM\) Throughput|^    Registers Per Thread|^    Achieved Occupancy" \
      "$name.details.txt" | head -40
  done
done
