"""Where one GPT training step's GPU time goes, kernel by kernel: fa4_jax attention against cuDNN's.

The step-time comparison (benchmarks/train_gpt_compare.py) says how much slower or faster a whole
step is; this says where. It builds examples/train_gpt.py's step for one attention backend and mesh,
then times single steps with CUPTI (`jax.experimental.mosaic.gpu.profiler.measure`, per kernel, every
GPU of the process) and sums kernel time by category: our attention kernels, cuDNN's attention,
matmuls, NCCL collectives (their time includes waiting for the other GPU, so it grows when the GPUs
fall out of step) and everything else. The step's state is not donated and not advanced: every
measured step runs the same inputs.

    python benchmarks/step_kernels.py --attention fa4 --out fa4.json -- --mesh data=1,model=2 ...
    python benchmarks/step_kernels.py --compare fa4.json cudnn.json     # category table, side by side
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from attention import git_revision  # noqa: E402  (benchmarks/attention.py)

CATEGORIES = ("fa4_jax attention", "cudnn attention", "matmul", "nccl", "other")


def category(kernel_name: str) -> str:
    name = kernel_name.lower()
    if "fa4_jax" in name:
        return "fa4_jax attention"
    if any(word in name for word in ("fmha", "sdpa", "flash", "cudnn")):
        return "cudnn attention"
    if "nccl" in name:
        return "nccl"
    if any(word in name for word in ("gemm", "xmma", "nvjet", "cublas", "cutlass")):
        return "matmul"
    return "other"


def profile(attention: str, train_flags: list, repeats: int) -> dict:
    import jax
    from jax.experimental.mosaic.gpu import profiler

    import train_gpt

    args = train_gpt.parse_args(train_flags + ["--attention", attention, "--quiet"])
    mesh = train_gpt.make_mesh(train_gpt.parse_mesh(args.mesh, jax.device_count()))
    compiled, params, opt_state, data_fn, _, hlo_text = train_gpt.build_training(args, mesh, donate=False)
    tokens = data_fn(0)
    per_step = []
    for _ in range(repeats):  # one step per measurement: kernel order across two GPUs is not fixed
        _, kernels = profiler.measure(compiled, aggregate=False)(params, opt_state, tokens)
        if kernels is None:
            raise RuntimeError("CUPTI returned no kernel timings")
        per_step.append(kernels)
    by_category = {name: [] for name in CATEGORIES}
    by_kernel = collections.defaultdict(list)
    for kernels in per_step:
        sums = collections.Counter()
        names = collections.Counter()
        for kernel_name, milliseconds in kernels:
            sums[category(kernel_name)] += milliseconds
            names[kernel_name[:160]] += milliseconds
        for name in CATEGORIES:
            by_category[name].append(sums[name])
        for name, milliseconds in names.items():
            by_kernel[name].append(milliseconds)
    medians = {name: statistics.median(values) for name, values in by_category.items()}
    top = sorted(((statistics.median(values), name) for name, values in by_kernel.items()), reverse=True)[:25]
    return {
        "attention": attention, "train_flags": train_flags, "mesh": dict(mesh.shape), "repeats": repeats,
        "device": jax.devices()[0].device_kind, "devices_used": mesh.size,
        "what": "median over single steps of summed CUPTI kernel time (ms), all GPUs of the mesh together",
        "kernel_ms_by_category": medians, "kernel_ms_total": sum(medians.values()),
        "kernels_per_step": statistics.median(len(kernels) for kernels in per_step),
        "top_kernels_ms": [{"kernel": name, "ms": ms} for ms, name in top],
        "collectives": train_gpt.collective_counts(hlo_text),
        "git_revision": git_revision(),
        "versions": train_gpt.versions(),
    }


def compare(paths: list) -> str:
    reports = [json.load(open(path)) for path in paths]
    lines = ["category".ljust(20) + "".join(f"{report['attention']:>14s}" for report in reports)]
    for name in CATEGORIES + ("total",):
        values = [report["kernel_ms_total"] if name == "total" else report["kernel_ms_by_category"][name]
                  for report in reports]
        lines.append(name.ljust(20) + "".join(f"{value:11.3f} ms" for value in values))
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attention", choices=("fa4", "cudnn", "xla"), default="fa4")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out", default="step_kernels.json")
    parser.add_argument("--compare", nargs="+", metavar="JSON", help="print these reports side by side")
    parser.add_argument("train_flags", nargs=argparse.REMAINDER, help="after --: flags for train_gpt.py")
    args = parser.parse_args(argv)
    if args.compare:
        print(compare(args.compare))
        return
    flags = args.train_flags[1:] if args.train_flags[:1] == ["--"] else args.train_flags
    report = profile(args.attention, flags, args.repeats)
    with open(args.out, "w") as handle:
        json.dump(report, handle, indent=1)
    print(compare([args.out]))


if __name__ == "__main__":
    main()
