"""Write benchmarks/results/sm100_compile_report.json: what the sm100 forward kernel compiles to.

Per configuration: TMEM columns, shared memory, K/V stages, the per-role register split and what
ptxas makes of it (registers at launch, spills), and counts of the instructions that make the FA4
design real. Compiled for sm_100a on the CPU; tests/test_kernel_compile_sm100.py checks the report
is current.

    python benchmarks/sm100_report.py
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
    parser.parse_args(argv)  # no options: --help describes the script instead of rebuilding the report
    with tempfile.TemporaryDirectory() as directory:
        report = sm100_inspect.build_report(directory)
    os.makedirs(os.path.dirname(sm100_inspect.REPORT_PATH), exist_ok=True)
    with open(sm100_inspect.REPORT_PATH, "w") as handle:
        json.dump(report, handle, indent=1, sort_keys=True)
        handle.write("\n")
    print(f"{'config':28s} {'tiles':>5s} {'n':>4s} {'kv':>3s} {'tmem':>5s} {'smem':>7s} {'regs':>5s} {'spill':>5s}")
    for name, record in report["configs"].items():
        print(f"{name:28s} {record['query_tiles_per_cta']:5d} {record['key_block']:4d} "
              f"{record['kv_stages']:3d} {record['tmem_columns_used']:5d} {record['shared_memory_bytes']:7d} "
              f"{record.get('registers_at_launch', -1):5d} {record.get('spill_store_bytes', -1):5d}")


if __name__ == "__main__":
    main()
