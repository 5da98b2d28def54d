#!/usr/bin/env bash
# GPU checks of the deterministic backward's defaults (two dQ writer warps since rev e3c0509): the oracle,
# head-split, wide-block and sanitizer-shape cases, the ten-run reproducibility tests (more CTAs than the
# GPU holds), packed sequences and the public API; then memcheck and racecheck of every sanitizer case in one
# process (sanitize_all.sh, alone on the GPU). ~7 min on an H100.
# Usage (device machine, repo root, bundle sourced; carry .dev/cute):
#   bash benchmarks/device/deterministic_checks.sh REV
exec bash "$(dirname "$0")/gpu_checks.sh" "$1" deterministic "deterministic or reproducib" \
  tests/test_sm90_backward.py tests/test_sm90_varlen.py tests/test_attention_cute.py
