#!/usr/bin/env bash
# One device call for the deterministic backward (docs/sm90_backward_tuning.md, last sections; issue 12 asks
# deterministic >= 0.85x of the default). The shipped kernel rotates full-mask walks (`Tuning.rotated_turns`,
# measured +5-15 % on an H100 at 17f1841 with this script's previous form); beside it
# Tuning(rotated_turns=False), deterministic_plain_turns: every walk from the first query block.
# Their GPU tests (deterministic oracle, head splits, bitwise reproducibility, sanitizer shapes, the rotated
# walk's own cases), then D = 64 / 128, 1k / 4k, full and causal (plain turns skip causal rows).
# Usage (device machine, repo root, bundle sourced): bash benchmarks/device/backward_deterministic.sh REV
exec bash "$(dirname "$0")/backward_candidates.sh" "$1" backward_deterministic tests/test_sm90_backward.py \
  "(plain_turns or rotated_turns) and (deterministic or reproducible or test_rotated_turns_match_oracle)" \
  --variants default deterministic deterministic_plain_turns \
  --head-dims 64 128 --seq-lens 1024 4096
