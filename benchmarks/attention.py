"""Attention benchmark: fa4_jax vs cuDNN (through jax.nn.dot_product_attention) vs XLA, one process.

Every implementation runs on the same inputs; times are CUPTI kernel times (all kernels of one call,
summed) from jax.experimental.mosaic.gpu.profiler.measure, median over iterations. TFLOP/s counts
forward FLOPs = 4 * B * H * Sq * Sk * D, halved when causal (backward: 2.5x forward).

Shapes (the issue's grid): B * S = 16k tokens, H * D = 2048, S in {1k, 2k, 4k, 8k, 16k},
D in {64, 128, 256}, causal and not, bf16.

Usage:
    python benchmarks/attention.py --out results.json [--sections forward] [--quick]
    python benchmarks/attention.py --plot results.json --png results.png   (no GPU needed)

Sections are functions in SECTIONS: name -> callable(shape, inputs, args) -> list of row dicts. A
backward section is added by writing one more such function and registering it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys

TOKENS = 16 * 1024
MODEL_WIDTH = 2048
SEQUENCE_LENGTHS = (1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128, 256)


def shapes(quick: bool = False):
    lengths = SEQUENCE_LENGTHS[:2] if quick else SEQUENCE_LENGTHS
    for head_dim in HEAD_DIMS:
        for causal in (False, True):
            for length in lengths:
                yield dict(batch=TOKENS // length, seq_len=length, heads=MODEL_WIDTH // head_dim,
                           head_dim=head_dim, causal=causal)


def forward_flops(shape) -> float:
    flops = 4.0 * shape["batch"] * shape["heads"] * shape["seq_len"] ** 2 * shape["head_dim"]
    return flops / 2 if shape["causal"] else flops


def _median_ms(function, arguments, iterations):
    from jax.experimental.mosaic.gpu import profiler
    outputs, times = profiler.measure(function, iterations=iterations)(*arguments)
    if times is None:
        raise RuntimeError("CUPTI returned no kernel timings")
    times = times if isinstance(times, list) else [times]
    return outputs, statistics.median(times)


def forward_section(shape, arguments, args):
    """fa4_jax (implementation='cute'), cuDNN and XLA forward on the same q, k, v."""
    import jax
    import jax.numpy as jnp
    import fa4_jax

    causal = shape["causal"]
    implementations = {
        "fa4_jax": lambda q, k, v: fa4_jax.attention(q, k, v, causal=causal, implementation="cute"),
        "cudnn": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn"),
        "xla": lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla"),
    }
    row = dict(section="forward", **shape)
    outputs = {}
    for name, function in implementations.items():
        if name == "xla" and shape["seq_len"] > args.xla_max_seq_len:
            continue
        iterations = args.iterations if name != "xla" else max(3, args.iterations // 4)
        try:
            out, milliseconds = _median_ms(jax.jit(function), arguments, iterations)
        except Exception as error:  # report and keep going: one failing backend must not hide the others
            row[f"{name}_error"] = f"{type(error).__name__}: {str(error)[:300]}"
            continue
        outputs[name] = out
        row[f"{name}_ms"] = milliseconds
        row[f"{name}_tflops"] = forward_flops(shape) / (milliseconds * 1e-3) / 1e12
    if "fa4_jax" in outputs and "cudnn" in outputs:
        difference = jnp.abs(outputs["fa4_jax"].astype(jnp.float32) - outputs["cudnn"].astype(jnp.float32))
        row["max_abs_diff_vs_cudnn"] = float(jnp.max(difference))
    if "fa4_jax_ms" in row and "cudnn_ms" in row:
        row["ratio_vs_cudnn"] = row["cudnn_ms"] / row["fa4_jax_ms"]
    return [row]


SECTIONS = {"forward": forward_section}


def _versions():
    import jax
    versions = {"python": platform.python_version(), "jax": jax.__version__}
    try:
        import jaxlib
        versions["jaxlib"] = jaxlib.__version__
    except ImportError:
        pass
    try:
        from importlib.metadata import version
        versions["nvidia-cutlass-dsl"] = version("nvidia-cutlass-dsl")
    except Exception:
        import cutlass
        versions["nvidia-cutlass-dsl"] = getattr(cutlass, "__version__", "unknown")
    return versions


def _git_revision():
    revision = os.environ.get("FA4_GIT_REVISION")
    if revision:
        return revision
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run(args):
    import jax
    import jax.numpy as jnp

    device = jax.devices()[0]
    report = dict(device=device.device_kind, date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  versions=_versions(), git_revision=_git_revision(),
                  timing="CUPTI kernel time, median of iterations (jax.experimental.mosaic.gpu.profiler.measure)",
                  flops="forward 4*B*H*Sq*Sk*D, halved when causal", dtype="bfloat16", rows=[])
    key = jax.random.key(0)
    for shape in shapes(args.quick):
        key, *subkeys = jax.random.split(key, 4)
        dims = (shape["batch"], shape["seq_len"], shape["heads"], shape["head_dim"])
        arguments = [jax.random.normal(k, dims, jnp.float32).astype(jnp.bfloat16) for k in subkeys]
        for section in args.sections:
            for row in SECTIONS[section](shape, arguments, args):
                report["rows"].append(row)
                print(_format_row(row), flush=True)
        del arguments
    with open(args.out, "w") as handle:
        json.dump(report, handle, indent=1)
    print(f"wrote {args.out}")
    return report


def _format_row(row):
    def number(name, fmt="{:7.1f}"):
        return fmt.format(row[name]) if name in row else "   -   "
    return (f"{row['section']:8s} D={row['head_dim']:3d} S={row['seq_len']:5d} causal={int(row['causal'])} "
            f"fa4 {number('fa4_jax_tflops')} cudnn {number('cudnn_tflops')} xla {number('xla_tflops')} "
            f"TFLOP/s  ratio {number('ratio_vs_cudnn', '{:5.2f}')}"
            + "".join(f"  [{name}]" for name in row if name.endswith("_error")))


def plot(json_path, png_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(json_path) as handle:
        report = json.load(handle)
    rows = [row for row in report["rows"] if row["section"] == "forward"]
    panels = [(d, c) for d in HEAD_DIMS for c in (False, True)]
    figure, axes = plt.subplots(len(HEAD_DIMS), 2, figsize=(11, 3.2 * len(HEAD_DIMS)), squeeze=False)
    for axis, (head_dim, causal) in zip(axes.flat, panels):
        subset = sorted((r for r in rows if r["head_dim"] == head_dim and r["causal"] == causal),
                        key=lambda r: r["seq_len"])
        for name in ("fa4_jax", "cudnn", "xla"):
            points = [(r["seq_len"], r[f"{name}_tflops"]) for r in subset if f"{name}_tflops" in r]
            if points:
                axis.plot(*zip(*points), marker="o", label=name)
        axis.set_xscale("log", base=2)
        axis.set_title(f"forward D={head_dim} {'causal' if causal else 'non-causal'}")
        axis.set_xlabel("sequence length (B*S = 16k)")
        axis.set_ylabel("TFLOP/s")
        axis.grid(alpha=0.3)
        axis.legend()
    figure.suptitle(f"{report['device']}  {report['date'][:10]}  rev {report['git_revision'][:10]}")
    figure.tight_layout()
    figure.savefig(png_path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="attention.json")
    parser.add_argument("--sections", nargs="+", default=["forward"], choices=sorted(SECTIONS))
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--xla-max-seq-len", type=int, default=16384)
    parser.add_argument("--quick", action="store_true", help="only the two shortest sequence lengths")
    parser.add_argument("--plot", help="draw this JSON report instead of measuring")
    parser.add_argument("--png", default="attention.png")
    args = parser.parse_args(argv)
    if args.plot:
        plot(args.plot, args.png)
        return
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    run(args)


if __name__ == "__main__":
    main()
