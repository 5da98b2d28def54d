#!/usr/bin/env bash
# Device calls for the deterministic backward's dQ writer candidates (docs/sm90_backward_tuning.md,
# "Deterministic D = 128 full: where the 0.80 goes"; issue 12 asks deterministic >= 0.85x of the default).
#   small  backward.py: a dQ writer warp per staging buffer (`Tuning.dq_writers`, deterministic mode's
#          default since rev ceba8e5's measurement; deterministic_one_dq_writer is the former one).
#          GPU tests: two writers' gradients equal one writer's bit for bit
#          (and the oracle) on the deterministic, rotated-walk and sanitizer cases, head splits, the tiled
#          staging; then D 64 / 128, 1k / 4k, full and causal: default, deterministic, the candidate.
#   turns  backward.py's turn candidates: the turn passed by a relaxed red after the fence
#          (`Tuning.relaxed_turn_pass`: bits equal the default's) and two dQ chains a tile
#          (`Tuning.dq_chains`: the oracle, ten-run reproducibility, sanitizer shapes); D 64 / 128, 1k / 4k.
#   large  backward_large_heads.py (one staging buffer): freed once read (`Tuning(dq_free_on_read=True)`);
#          bit-for-bit tests against the default and the reproducibility runs, then D 192 / 256, 2k / 8k.
# One call each (~6 min). Usage (device machine, repo root, bundle sourced):
#   bash benchmarks/device/backward_deterministic.sh REV small|turns|large
set -u
HERE=$(dirname "$0")
case "${2:-}" in
  small) exec bash "$HERE/backward_candidates.sh" "$1" backward_deterministic tests/test_sm90_backward.py \
           "two_dq_writers or reproducible" \
           --variants default deterministic deterministic_one_dq_writer \
           --head-dims 64 128 --seq-lens 1024 4096 ;;
  turns) exec bash "$HERE/backward_candidates.sh" "$1" backward_turns tests/test_sm90_backward.py \
           "relaxed_turn_pass or dq_chains_2" \
           --variants default deterministic deterministic_relaxed_turn_pass deterministic_dq_chains_2 \
           --head-dims 64 128 --seq-lens 1024 4096 ;;
  large) exec bash "$HERE/backward_candidates.sh" "$1" backward_deterministic_large \
           tests/test_sm90_backward_large_heads.py "dq_writer or (reproducible and (dq_free_on_read or 1024x4x4))" \
           --variants default deterministic deterministic_dq_free_on_read \
           --head-dims 192 256 --seq-lens 2048 8192 ;;
  *) echo "usage: $0 REV small|turns|large"; exit 2 ;;
esac
