#!/usr/bin/env bash
# The pages of one Nsight Compute report that come back from a device call, the report itself left behind
# (too large): NAME.details.txt, NAME.sass.csv.xz (per-SASS-instruction stall samples: where the warps
# wait) and NAME.raw.csv.xz (every raw metric, smsp__pcsamp_warps_issue_stalled_* among them); then deletes
# NAME.ncu-rep. Usage: bash benchmarks/device/ncu_pages.sh NAME   (NAME.ncu-rep written by ncu -o NAME)
set -u
name=$1
ncu --import "$name.ncu-rep" --page details > "$name.details.txt" 2>&1
ncu --import "$name.ncu-rep" --page source --csv --print-source sass 2>&1 | xz -6 > "$name.sass.csv.xz"
ncu --import "$name.ncu-rep" --page raw --csv 2>&1 | xz -6 > "$name.raw.csv.xz"
rm -f "$name.ncu-rep"
