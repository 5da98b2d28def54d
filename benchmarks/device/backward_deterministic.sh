#!/usr/bin/env bash
# Device calls for the deterministic backward (docs/sm90_backward_tuning.md, "Deterministic D = 128 full:
# where the 0.80 goes" and "D = 64 full: a tile's turn chain has one block to fit in"; issue 12 asks
# deterministic >= 0.85x of the default).
#   small  backward.py: a dQ writer warp per staging buffer (`Tuning.dq_writers`, deterministic mode's
#          default since rev ceba8e5's measurement; deterministic_one_dq_writer is the former one).
#          GPU tests: two writers' gradients equal one writer's bit for bit
#          (and the oracle) on the deterministic, rotated-walk and sanitizer cases, head splits, the tiled
#          staging; then D 64 / 128, 1k / 4k, full and causal: default, deterministic, one writer.
#   large_rotated  backward_large_heads.py's rotated turns (`Tuning.rotated_turns`, the deterministic default
#          since rev bc0bd69; docs/sm90_backward_tuning.md, "Large heads: rotated turns"): its GPU tests and
#          the plain walk's (-k "rotated or plain_turns"), then default, deterministic (rotated) and
#          deterministic_large_plain_turns (the plain walk) on D 256 (2k, 4k) and D 192 (2k) rows, full and
#          causal (where rotated turns resolve off: the row records it skipped, with the reason).
# (A `turns` mode timed backward.py's two dQ chains a tile, and at rev a546978 the relaxed turn pass, the
# default since; the chains, measured a loss on an H100 at rev aea2164, were deleted with the mode:
# docs/sm90_backward_tuning.md, "dq_chains on the relaxed pass". A `large` mode timed
# backward_large_heads.py's one-staging-buffer candidate; measured a miss on an H100 at rev ceba8e5, it
# was deleted with the candidate: docs/sm90_backward_tuning.md, "The large-head kernel: one staging buffer".
# A `rows80` mode timed deterministic mode at 80 query rows; a loss on an H200 at rev 64ec724, deleted.)
# One call (~6 min). Usage (device machine, repo root, bundle sourced):
#   bash benchmarks/device/backward_deterministic.sh REV small|large_rotated
set -u
HERE=$(dirname "$0")
case "${2:-}" in
  small) exec bash "$HERE/backward_candidates.sh" "$1" backward_deterministic tests/test_sm90_backward.py \
           "two_dq_writers or reproducible" \
           --variants default deterministic deterministic_one_dq_writer \
           --head-dims 64 128 --seq-lens 1024 4096 ;;
  large_rotated) exec bash "$HERE/backward_candidates.sh" "$1" backward_large_rotated \
           tests/test_sm90_backward_large_heads.py "rotated or plain_turns" \
           --variants default deterministic deterministic_large_plain_turns \
           --shapes grid d192 --head-dims 256 192 --seq-lens 2048 4096 ;;
  *) echo "usage: $0 REV small|large_rotated"; exit 2 ;;
esac
