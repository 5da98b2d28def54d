#!/usr/bin/env bash
# One device call for `backward_large_heads.Tuning.prefetch_query` at DeepSeek MLA's D / Dv = 192 / 128 (two Q
# stages, dO one in a pipeline of its own, one P / dS buffer: the default at D = Dv = 192 since it measured
# +3 to +17 % there; docs/sm90_backward_tuning.md, "D = 192: a second Q stage"): its MLA GPU tests, then
# attention_backward.py's MLA rows (`--shapes mla`) against the default (one Q stage, two P / dS buffers).
# Usage (device machine, repo root, bundle sourced): bash benchmarks/device/backward_mla_prefetch.sh REV
exec bash "$(dirname "$0")/backward_candidates.sh" "$1" backward_mla_prefetch \
  tests/test_sm90_backward_large_heads.py "mla and prefetch_query" \
  --variants default deterministic prefetch_query deterministic_prefetch_query --shapes mla \
  --head-dims 192 --seq-lens 2048 8192
