#!/usr/bin/env bash
# One device call for the D = 192 backward candidate Tuning.prefetch_query (backward_large_heads: two Q stages,
# dO one in a pipeline of its own, one P / dS buffer behind a named barrier; docs/sm90_backward_tuning.md,
# "D = 192: a second Q stage"): its GPU tests (the D = 192 and MLA cases, query shards and bitwise
# reproducibility, unordered and deterministic), then hopper_vs_peers' D = 192 rows against the default (three
# warp groups, one Q / dO stage, two P / dS buffers).
# Usage (device machine, repo root, bundle sourced): bash benchmarks/device/backward_d192_prefetch.sh REV
exec bash "$(dirname "$0")/backward_candidates.sh" "$1" backward_d192_prefetch \
  tests/test_sm90_backward_large_heads.py "prefetch_query" \
  --variants default deterministic prefetch_query deterministic_prefetch_query --shapes d192 \
  --head-dims 192 --seq-lens 2048 8192
