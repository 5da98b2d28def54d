"""Write benchmarks/results/sm100_compile_report.json and sm100_backward_compile_report.json: what
the sm100 forward and backward kernels compile to.

Per configuration: TMEM columns, shared memory, (forward) K/V stages, the per-role register split and
what ptxas makes of it (registers at launch, spills), and counts of the instructions that make the FA4
design real. Compiled for sm_100a on the CPU; tests/test_kernel_compile_sm100.py and
tests/test_kernel_compile_sm100_backward.py check the reports are current.

    python benchmarks/sm100_report.py [--direction forward|backward|both]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools import sm100_inspect  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--direction", choices=("forward", "backward", "both"), default="both",
                        help="which kernel's report to rebuild (default: both)")
    direction = parser.parse_args(argv).direction
    directions = ("forward", "backward") if direction == "both" else (direction,)
    for direction in directions:
        with tempfile.TemporaryDirectory() as directory:
            report = sm100_inspect.build_report(directory, direction=direction)
        path = sm100_inspect.BACKWARD_REPORT_PATH if direction == "backward" else sm100_inspect.REPORT_PATH
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as handle:
            json.dump(report, handle, indent=1, sort_keys=True)
            handle.write("\n")
        print(f"{direction}: {path}")
        print(f"{'config':44s} {'tmem':>5s} {'smem':>7s} {'regs':>5s} {'spill':>5s}")
        for name, record in report["configs"].items():
            print(f"{name:44s} {record['tmem_columns_used']:5d} {record['shared_memory_bytes']:7d} "
                  f"{record.get('registers_at_launch', -1):5d} {record.get('spill_store_bytes', -1):5d}")


if __name__ == "__main__":
    main()
