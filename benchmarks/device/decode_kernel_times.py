"""CUPTI time of each kernel of one decode call (benchmarks/decode.py's inputs), median over iterations: where
a B = 1 step's time goes between the split kernel and what merges its splits: our combine kernel (the
default, `combine="kernel"`) or the XLA pass (`combine="xla"`: `combine_partials`, which XLA emits as three
kernels), and what `page_lookahead` changes in the split kernel itself.

Usage: python benchmarks/device/decode_kernel_times.py --out times.json [--iterations 20]
           [--variants api,xla_combine]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from benchmarks import decode  # noqa: E402  (its inputs, options and DecodeOptions candidates)

ROWS = [dict(batch=1, context=1024, q_len=1, page_size=16), dict(batch=1, context=8192, q_len=1, page_size=16),
        dict(batch=1, context=1024, q_len=4, page_size=16), dict(batch=8, context=1024, q_len=1, page_size=16)]
# The API call and benchmarks/decode.py's DecodeOptions candidates.
VARIANTS = {"api": None, **decode.OPTION_VARIANTS}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--variants", help=f"comma-separated subset of {', '.join(VARIANTS)} (default: all)")
    args = parser.parse_args()
    variants = {name: VARIANTS[name] for name in (args.variants.split(",") if args.variants else VARIANTS)}

    import jax
    import fa4_jax
    from benchmarks import attention
    from fa4_jax.kernels.sm90 import DEFAULT_SM_COUNT, decode as decode_kernel

    report = dict(device=jax.devices()[0].device_kind, versions=attention._versions(),
                  git_revision=attention.git_revision(), timing="CUPTI per kernel, median over iterations (us)",
                  rows=[])
    for row in ROWS:
        arguments = jax.block_until_ready(decode._inputs(row, jax.random.key(0)))
        for name, overrides in variants.items():
            if overrides is None:
                call = jax.jit(lambda *a: fa4_jax.paged_attention(*a, implementation="cute"))
            else:
                options = decode._options(row, DEFAULT_SM_COUNT, **overrides)
                call = jax.jit(lambda *a, options=options: decode_kernel.run(options, *a))
            kernels, total = attention.per_kernel_us(call, arguments, args.iterations)
            record = dict(row, variant=name, kernels_us=kernels, total_us=total)
            report["rows"].append(record)
            print(f"B={row['batch']} ctx={row['context']} q={row['q_len']} {name:15s} total {record['total_us']:7.2f} us  "
                  + "  ".join(f"{k} {v:.2f}" for k, v in kernels.items()), flush=True)
    with open(args.out, "w") as handle:
        json.dump(report, handle, indent=1)


if __name__ == "__main__":
    main()
