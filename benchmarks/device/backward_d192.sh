#!/usr/bin/env bash
# One device call for the D = 192 backward candidate Tuning.two_groups_by_keys (backward_large_heads: two
# consumer warp groups splitting 96 keys, docs/sm90_backward_tuning.md, "D = 192: two groups split by
# keys"): its GPU tests (the D = 192 cases, unordered and deterministic), then hopper_vs_peers' D = 192
# rows against the default (three warp groups).
# Usage (device machine, repo root, bundle sourced): bash benchmarks/device/backward_d192.sh REV
exec bash "$(dirname "$0")/backward_candidates.sh" "$1" backward_d192_by_keys \
  tests/test_sm90_backward_large_heads.py "two_groups_by_keys" \
  --variants default deterministic two_groups_by_keys deterministic_two_groups_by_keys --shapes d192 \
  --head-dims 192 --seq-lens 2048 8192
