"""CUPTI time of each kernel of one backward call (the VJP's pullback, as benchmarks/hopper_vs_peers.py times
it), ours against FA4's own kernels (fa4peer) and cuDNN, median over iterations: where the last few percent
of issue 12's backward rows go, main kernel or the zeroing, preprocess and dQ read-back around it (at rev
aea2164 the kernels around it tied and the main kernel was 4 % behind FA4's: docs/sm90_backward_tuning.md,
"80 query rows again").

Usage (device machine, repo root; carry .dev/cute and .dev/peer, or what cute_env.sh says):
    python3 benchmarks/device/backward_kernel_times.py --out times.json [--iterations 20] [--rows REGEX]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hopper_vs_peers as peers  # noqa: E402  (shapes, the libraries, the pullback being timed)
import attention  # noqa: E402  (the same module hopper_vs_peers uses: CUPTI helpers, versions)

ROWS = [peers.Shape(4, 4096, 16, 16, 128, False), peers.Shape(4, 4096, 32, 32, 64, False),
        peers.Shape(8, 2048, 16, 16, 128, True), peers.Shape(2, 8192, 16, 2, 128, True),
        peers.Shape(2, 8192, 16, 16, 128, False)]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--rows", help="regex over the row names (hopper_vs_peers' Row.name)")
    args = parser.parse_args()

    import jax

    peer, peer_version = peers.fa4peer_factory(True)
    libraries = {"fa4_jax": peers.fa4_jax_attention, "cudnn": peers.cudnn_attention, "fa4peer": peer}
    report = dict(device=jax.devices()[0].device_kind, versions=dict(attention._versions(), fa4peer=peer_version),
                  git_revision=attention.git_revision(), timing="CUPTI per kernel of the backward pullback, "
                  "median over iterations (us)", rows=[])
    for shape in ROWS:
        row = peers.Row("backward", shape)
        if args.rows and not re.search(args.rows, row.name):
            continue
        inputs = peers.make_inputs(shape)
        for name, factory in libraries.items():
            record = dict(row=row.name, library=name)
            try:
                function, arguments = peers.timed_function("backward", factory(shape), inputs)
                record["kernels_us"], record["total_us"] = attention.per_kernel_us(function, arguments, args.iterations)
            except Exception as error:   # a library that cannot run the row: recorded, the others go on
                record["error"] = peers.short_error(error)
            report["rows"].append(record)
            print(f"{row.name} {name:8s} total {record.get('total_us', 'n/a')} us  "
                  + "  ".join(f"{k} {v}" for k, v in record.get("kernels_us", {}).items()), flush=True)
            _write(report, args.out)
    _write(report, args.out)


def _write(report, path):
    with open(path, "w") as handle:
        json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
