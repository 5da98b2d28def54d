"""One fa4_jax.paged_attention call on benchmarks/decode.py's inputs, inside a CUDA profiler range (Nsight
Compute's --profile-from-start off), after a warm-up call that compiles and loads every kernel: the profile
holds that call's kernels and nothing else (no input generation, no compilation).

Usage: python benchmarks/device/decode_one_call.py BATCH CONTEXT PAGE_SIZE Q_LEN
           [--overrides '{"combine": "xla", "page_lookahead": false}']
       (with --overrides: decode.run with those DecodeOptions fields instead of the public API)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name in ("batch", "context", "page_size", "q_len"):
        parser.add_argument(name, type=int)
    parser.add_argument("--overrides", type=json.loads, default={})
    args = parser.parse_args()

    import jax
    from cuda.bindings import driver

    import fa4_jax
    from benchmarks import decode
    from fa4_jax.kernels.sm90 import DEFAULT_SM_COUNT, decode as decode_kernel

    row = dict(batch=args.batch, context=args.context, q_len=args.q_len, page_size=args.page_size)
    arguments = jax.block_until_ready(decode._inputs(row, jax.random.key(0)))
    if args.overrides:
        options = decode._options(row, DEFAULT_SM_COUNT, **args.overrides)
        call = jax.jit(lambda *a: decode_kernel.run(options, *a))
    else:
        call = jax.jit(lambda *a: fa4_jax.paged_attention(*a, implementation="cute"))
    jax.block_until_ready(call(*arguments))
    driver.cuProfilerStart()
    jax.block_until_ready(call(*arguments))
    driver.cuProfilerStop()


if __name__ == "__main__":
    main()
