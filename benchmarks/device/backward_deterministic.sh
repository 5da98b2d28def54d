#!/usr/bin/env bash
# One device call for the deterministic backward (docs/sm90_backward_tuning.md, "Deterministic D = 128 full:
# where the 0.80 goes"; issue 12 asks deterministic >= 0.85x of the default). The candidate: a dQ writer warp
# per staging buffer (`Tuning(dq_writers=2)`, deterministic_two_dq_writers), so the consumers stop waiting
# for one writer's serial turn + completion + release chain. Its GPU tests first (the gradients of two
# writers equal one writer's bit for bit, and the oracle, on the deterministic, rotated-walk and sanitizer
# cases, head splits, the tiled staging), then D = 64 / 128, 1k / 4k, full and causal: default,
# deterministic, deterministic with two writers.
# Usage (device machine, repo root, bundle sourced): bash benchmarks/device/backward_deterministic.sh REV
exec bash "$(dirname "$0")/backward_candidates.sh" "$1" backward_deterministic tests/test_sm90_backward.py \
  "two_dq_writers or reproducible" \
  --variants default deterministic deterministic_two_dq_writers \
  --head-dims 64 128 --seq-lens 1024 4096
