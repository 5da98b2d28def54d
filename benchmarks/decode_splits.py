"""Decode split-count / stage / tile sweep (issue 16: B = 1 at 1k and 8k keys are short of the bar).

Times `decode.run` (the split kernel and the XLA combine, CUPTI kernel time summed) for forced
`DecodeOptions` on the decode benchmark's shapes (Hq / Hkv 32 / 8, D 128, bf16, Sq 1, page 64), next to
the options `choose_num_splits` picks, and checks every variant's output against the default's.
Prints one line per variant and writes a JSON report; no change of defaults follows from it until a
variant beats the default by more than the run's repeat noise.

Usage: python benchmarks/decode_splits.py --out benchmarks/results/decode_splits_h200.json
"""
import argparse
import datetime
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks import attention, decode as decode_bench  # noqa: E402

TILES = ((64, 3), (64, 4), (128, 2), (128, 3))   # (tile_n, num_stages) that fit the shared memory at D 128
# (batch, context) -> forced options; the second sweep (after the first showed one CTA per SM winning at 8k)
# adds fewer splits, 128-key tiles and the longer contexts / B = 8 where the same question applies.
SWEEP = {
    (1, 1024): [dict(num_splits=s, num_stages=t) for s in (2, 4, 8, 16) for t in (2, 3, 4)],
    (1, 8192): [dict(num_splits=s, tile_n=n, num_stages=t) for s in (8, 12, 16, 32, 64) for n, t in TILES],
    (1, 32768): [dict(num_splits=s, tile_n=n, num_stages=t) for s in (16, 32) for n, t in TILES],
    (1, 131072): [dict(num_splits=s, tile_n=n, num_stages=t) for s in (16, 32) for n, t in TILES],
    (8, 1024): [dict(num_splits=s) for s in (1, 2, 4)],
    (8, 8192): [dict(num_splits=s, tile_n=n, num_stages=t) for s in (2, 4) for n, t in TILES],
}


def main(argv=None):
    import jax
    import numpy as np
    from fa4_jax.kernels.sm90 import DEFAULT_SM_COUNT, decode

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--iterations", type=int, default=20)
    args = parser.parse_args(argv)
    sm_count = DEFAULT_SM_COUNT   # as benchmarks/decode.py: the H200's 132 SMs
    report = dict(device=jax.devices()[0].device_kind, date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  versions=attention._versions(), git_revision=attention.git_revision(),
                  timing="CUPTI kernel time of decode.run (split kernel + XLA combine), median", rows=[])
    for (batch, context), variants in SWEEP.items():
        row = dict(batch=batch, context=context, q_len=1, page_size=64)
        arguments = decode_bench._inputs(row, jax.random.PRNGKey(context + batch))
        default = decode_bench._options(row, sm_count)
        base_out = None
        for overrides in [{}] + variants + [{}]:   # the default first and again last (noise)
            options = decode_bench._options(row, sm_count, **overrides)
            record = dict(batch=batch, context=context, overrides=overrides, num_splits=options.num_splits,
                          tile_n=options.tile_n, num_stages=options.num_stages, is_default=options == default)
            try:
                (out, _), ms = attention._median_ms(jax.jit(lambda *a, o=options: decode.run(o, *a)),
                                                    arguments, args.iterations)
                record["ms"] = ms
                record["tbps"] = decode_bench.kv_bytes(row) / (ms * 1e-3) / 1e12
                out = np.asarray(out, dtype=np.float32)
                if base_out is None:
                    base_out = out
                record["max_abs_diff_vs_default"] = float(np.abs(out - base_out).max())
            except Exception as error:
                record["error"] = decode_bench.attention_error(error)
            report["rows"].append(record)
            print("row", json.dumps(record), flush=True)
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=1)
    for batch, context in SWEEP:
        timed = [r for r in report["rows"] if (r["batch"], r["context"]) == (batch, context) and "ms" in r]
        best = min(timed, key=lambda r: r["ms"])
        defaults = [r["ms"] for r in timed if r["is_default"]]
        print(f"B {batch} ctx {context}: default {defaults} ms; best {best['ms']:.5f} ms with {best['overrides']}")


if __name__ == "__main__":
    main()
