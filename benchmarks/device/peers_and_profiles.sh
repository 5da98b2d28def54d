#!/usr/bin/env bash
# The peer call of the 2026-12-07 session: carries only .dev/peer, on the machine decode_default_combine.sh
# left warm (the CuTe DSL unpacked there, the grids' kernels precompiled into the cache this uses):
#   1. hopper_vs_peers.py --grid head-dims (the native D = 80 forward, D = 96, MLA 192/128, D = 192 with
#      two Q stages in the backward) against cuDNN and FA4: head_dims.json;
#   2. the issue-12 grid's D = 192 rows (the only ones whose kernels changed since rev 6f403c6):
#      hopper_vs_peers_d192.json;
#   3. ncu, the D = 128 full forward at B 2, S 8k, 16 heads, ours against FA4's (the grid's forward rows
#      furthest below FA4: 0.90-0.94 at 4k-16k on an H100), and our D = 128 full backward at B 4, S 4k,
#      16 heads, deterministic against default (deterministic stays at 0.76-0.77 of the default there;
#      the writer warp's turn waits against the consumers' buffer waits): profiles.tar.
# Four files in $OUT (the logs in logs.tar). Usage: bash benchmarks/device/peers_and_profiles.sh REV
set -u
REV=$1
OUT=${OUT:-/tmp/out}
HERE=$(dirname "$0")
mkdir -p /tmp/peer_logs /tmp/profiles
NAME=head_dims LIMIT=150 MAX_SECONDS=130 OUT=/tmp/peer_logs bash "$HERE/hopper_vs_peers.sh" "$REV" --grid head-dims
NAME=hopper_vs_peers_d192 LIMIT=90 MAX_SECONDS=75 OUT=/tmp/peer_logs bash "$HERE/hopper_vs_peers.sh" "$REV" --rows "D192 "
mv /tmp/peer_logs/*.json "$OUT/"
# The grids' kernel cache: the D = 128 forward and default backward of these shapes are grid rows.
export FA4_JAX_CACHE_DIR=/tmp/fa4_hopper_vs_peers_cache
# Each profile takes ~60-90 s; they run while the call has the time (BUDGET seconds in all, default 420).
[ $SECONDS -lt $(( ${BUDGET:-420} - 100 )) ] && OUT=/tmp/profiles bash "$HERE/profile_attention.sh" forward "2 8192 16/16 128"
[ $SECONDS -lt $(( ${BUDGET:-420} - 100 )) ] && OUT=/tmp/profiles LIBRARIES="fa4_jax fa4_jax_deterministic" \
  bash "$HERE/profile_attention.sh" backward "4 4096 16/16 128"
tar cf "$OUT/profiles.tar" -C /tmp/profiles .
tar cf "$OUT/logs.tar" -C /tmp/peer_logs .
