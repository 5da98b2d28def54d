#!/usr/bin/env bash
# GPU checks of the 80-query-row default at D = 128 without a mask (rev b636efb; docs/sm90_backward_tuning.md,
# "80 query rows again"): every non-deterministic case of the sm90 backward's GPU tests (the shared oracle
# cases at D = 128 full now run 80 rows, the query-shard cases too) and the public API's gradients, then
# memcheck and racecheck of every sanitizer case in one process (sanitize_all.sh, alone on the GPU; the
# d128-gqa case reaches 80 rows). ~7 min on an H100.
# Usage (device machine, repo root, bundle sourced; carry .dev/cute): bash benchmarks/device/rows80_checks.sh REV
exec bash "$(dirname "$0")/gpu_checks.sh" "$1" rows80_checks "not deterministic and not reproducib and not sanitizer_shapes" \
  tests/test_sm90_backward.py tests/test_attention_cute.py
