#!/usr/bin/env bash
# One device call for the two deterministic-backward candidates (docs/sm90_backward_tuning.md, last two
# sections; issue 12 asks deterministic >= 0.85x of the default):
#   Tuning.dq_free_on_read  the dQ writer frees its staging buffer once read, passes the turn at completion
#   Tuning.rotated_turns    full-mask walks start at the key block's own query block, turns in arrival order
# Their GPU tests (deterministic oracle, head splits, bitwise reproducibility, sanitizer shapes, the rotated
# walk's own cases), then D = 64 / 128, 1k / 4k, full and causal (the rotated variant skips causal rows).
# Usage (device machine, repo root, bundle sourced): bash benchmarks/device/backward_deterministic.sh REV
exec bash "$(dirname "$0")/backward_candidates.sh" "$1" backward_deterministic tests/test_sm90_backward.py \
  "(dq_free_on_read or rotated_turns) and (deterministic or reproducible or test_rotated_turns_match_oracle)" \
  --variants default deterministic deterministic_dq_free_on_read deterministic_rotated_turns \
  --head-dims 64 128 --seq-lens 1024 4096
