"""examples/train_gpt.py with fa4_jax attention against cuDNN attention: same seed, data and steps.

    # on the GPU: one process per run (a crash in one cannot take the others' results with it)
    python benchmarks/train_gpt_compare.py run --out DIR -- --dtype bfloat16 --steps 150 ...
    # several meshes in one go: cudnn then fa4 on each
    python benchmarks/train_gpt_compare.py run --out DIR --meshes data=2 data=1,model=2 -- ...
    # anywhere with matplotlib: loss curves and tokens/s
    python benchmarks/train_gpt_compare.py plot DIR/train_gpt_h200.json --png OUT.png
    # the summary's table again
    python benchmarks/train_gpt_compare.py table DIR/train_gpt_h200.json

`run` trains with --attention cudnn, then fa4 (implementation auto: our kernels where they take the call,
the reference with a warning where not); if the fa4 run fails it retries with the reference and says so.
With --meshes it does so once per mesh (train_gpt.py's --mesh). It writes each run's JSON and log, and one
summary JSON holding every run plus the comparison (per mesh with --meshes); the summary is rewritten
after every run, so a call cut short keeps the runs that finished.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time
from typing import Optional

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import attention  # noqa: E402  (save_png)

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"


def train(out_dir: pathlib.Path, file_stem: str, flags: list[str], timeout: float) -> dict:
    """One training run in its own process; its JSON, or a failure record with the log's tail."""
    json_path = out_dir / f"{file_stem}.json"
    log_path = out_dir / f"{file_stem}.log"
    command = [sys.executable, str(EXAMPLE), "--quiet", "--json", str(json_path)] + flags
    start = time.perf_counter()
    try:
        completed = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        returncode, output = completed.returncode, completed.stdout + completed.stderr
    except subprocess.TimeoutExpired as expired:
        returncode = "timeout"
        output = "".join(part.decode() if isinstance(part, bytes) else (part or "")
                         for part in (expired.stdout, expired.stderr))
    log_path.write_text(output)
    print(f"{file_stem}: exit {returncode} after {time.perf_counter() - start:.0f} s", flush=True)
    if returncode == 0 and json_path.exists():
        return {"ok": True, **json.loads(json_path.read_text())}
    return {"ok": False, "flags": flags, "exit": returncode, "log_tail": output[-4000:]}


def compare(runs: list[dict]) -> dict:
    """fa4 runs against the cudnn run, all on one mesh (runs keyed by their name)."""
    by_name = {run["name"]: run for run in runs if run["ok"]}
    baseline = by_name.get("cudnn")
    summary = {}
    for name, run in by_name.items():
        if name == "cudnn" or baseline is None:
            continue
        differences = [abs(a - b) for a, b in zip(run["loss"], baseline["loss"])]
        tail = max(1, len(differences) // 5)
        summary[name] = {
            # auto falls back to the reference where the kernels cannot take the call: say which ran.
            "attention": describe(run),
            "step_time_ratio_vs_cudnn": run["median_step_seconds"] / baseline["median_step_seconds"],
            "max_abs_loss_difference": max(differences),
            "mean_abs_loss_difference_last_fifth": sum(differences[-tail:]) / tail,
            "final_loss": run["loss"][-1], "cudnn_final_loss": baseline["loss"][-1],
            "tokens_per_second": run["tokens_per_second"],
            "cudnn_tokens_per_second": baseline["tokens_per_second"],
            "devices_used": run["devices"]["used"],
            "same_collectives_as_cudnn": run.get("collectives") == baseline.get("collectives"),
        }
    return summary


def mesh_file_prefix(mesh: Optional[str]) -> str:
    """'data=1,model=2' -> 'data1_model2_' (run files of several meshes share one directory)."""
    return "" if mesh is None else mesh.replace("=", "").replace(",", "_") + "_"


def summarize(flags: list[str], meshes: Optional[list[str]], runs: list[dict]) -> dict:
    if meshes is None:
        comparison = compare(runs)
    else:
        comparison = {mesh: compare([run for run in runs if run["mesh_flag"] == mesh]) for mesh in meshes}
    finished = next((run for run in runs if run["ok"]), {})
    return {"train_flags": flags, "meshes": meshes, "comparison": comparison,
            "devices": finished.get("devices"), "versions": finished.get("versions"),
            "git_revision": finished.get("git_revision", os.environ.get("FA4_GIT_REVISION")),
            "runs": runs}


def run_command(args):
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    flags = args.train_flags
    runs = []

    def train_and_record(mesh: Optional[str], name: str, attention_flags: list[str]) -> dict:
        mesh_flags = [] if mesh is None else ["--mesh", mesh]
        run = train(out_dir, mesh_file_prefix(mesh) + name, flags + mesh_flags + attention_flags,
                    args.timeout)
        runs.append({"name": name, "mesh_flag": mesh, **run})
        (out_dir / args.name).write_text(json.dumps(summarize(flags, args.meshes, runs), indent=1))
        return runs[-1]

    for mesh in args.meshes or [None]:
        train_and_record(mesh, "cudnn", ["--attention", "cudnn"])
        fa4 = train_and_record(mesh, "fa4", ["--attention", "fa4"])
        if args.also_reference or not fa4["ok"]:
            train_and_record(mesh, "fa4_reference",
                             ["--attention", "fa4", "--fa4-implementation", "reference"])
    print_table(summarize(flags, args.meshes, runs))


def describe(run: dict) -> str:
    """What the run's attention really was, read off its compiled step's custom calls."""
    if run["attention"] != "fa4":
        return {"cudnn": "cuDNN", "xla": "XLA"}[run["attention"]]
    kernels = any(target.startswith("CuteDSLRT") for target in run.get("custom_calls", {}))
    return "fa4_jax (CuTe kernels)" if kernels else "fa4_jax (reference path)"


def label(run: dict) -> str:
    mesh = run.get("mesh_flag")
    return describe(run) if mesh is None else f"{describe(run)}, {mesh}"


def print_table(summary: dict):
    for mesh, comparison in (summary["comparison"].items() if summary.get("meshes")
                             else [(None, summary["comparison"])]):
        for name, numbers in comparison.items():
            print(f"{' '.join(filter(None, (mesh, name))):>24}: {numbers.get('attention', 'fa4_jax')}, "
                  "step time / cudnn = "
                  f"{numbers['step_time_ratio_vs_cudnn']:.3f}, max |loss - cudnn loss| = "
                  f"{numbers['max_abs_loss_difference']:.4f} (last fifth mean "
                  f"{numbers['mean_abs_loss_difference_last_fifth']:.4f}), same collectives as cudnn: "
                  f"{numbers.get('same_collectives_as_cudnn', 'not recorded')}")
    for run in summary["runs"]:
        title = f"{' '.join(filter(None, (run.get('mesh_flag'), run['name']))):>24}"
        if not run["ok"]:
            print(f"{title}: FAILED (exit {run['exit']}): {run['log_tail'][-300:].strip()!r}")
            continue
        collectives = {kind: count for kind, count in run.get("collectives", {}).items() if count}
        print(f"{title}: {run['tokens_per_second']:>10,.0f} tokens/s, median step "
              f"{run['median_step_seconds'] * 1e3:.2f} ms, final loss {run['loss'][-1]:.4f}, "
              f"{run['devices']['used']} devices, collectives {collectives}, "
              f"custom calls {run.get('custom_calls')}, warnings {run['warnings']}")


def table_command(args):
    print_table(json.loads(pathlib.Path(args.result).read_text()))


def plot_command(args):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = json.loads(pathlib.Path(args.result).read_text())
    runs = [run for run in summary["runs"] if run["ok"]]
    meshes = summary.get("meshes") or [None]
    pairs = [(mesh, [run for run in runs if run.get("mesh_flag") == mesh]) for mesh in meshes]
    pairs = [(mesh, {run["name"]: run for run in group}) for mesh, group in pairs]
    pairs = [(mesh, group) for mesh, group in pairs if "cudnn" in group and "fa4" in group]
    figure, (loss_axes, difference_axes, speed_axes) = plt.subplots(
        1, 3, figsize=(16 + 2 * (len(meshes) - 1), 4.5), gridspec_kw={"width_ratios": [2, 1.3, 1]})
    # With several meshes: one colour per mesh, cuDNN solid and fa4_jax dashed (hatched bars), so each
    # pair whose curves should agree is plain; with one mesh, one colour per run.
    colours = [f"C{meshes.index(run.get('mesh_flag'))}" if len(meshes) > 1 else f"C{index}"
               for index, run in enumerate(runs)]
    for run, colour in zip(runs, colours):
        loss_axes.plot(range(1, len(run["loss"]) + 1), run["loss"], label=label(run), color=colour,
                       linestyle="--" if run["attention"] == "fa4" and len(meshes) > 1 else "-",
                       linewidth=1.2)
    loss_axes.set_xlabel("step")
    loss_axes.set_ylabel("training loss")
    loss_axes.legend()
    loss_axes.grid(alpha=0.3)
    # The curves lie on top of each other; their difference shows whether it is bf16 noise.
    for mesh, group in pairs:
        difference = [a - b for a, b in zip(group["fa4"]["loss"], group["cudnn"]["loss"])]
        difference_axes.plot(range(1, len(difference) + 1), difference, linewidth=1.0,
                             color=f"C{meshes.index(mesh)}" if len(meshes) > 1 else "C1",
                             label=mesh or "fa4_jax - cuDNN")
    difference_axes.axhline(0.0, color="black", linewidth=0.6)
    difference_axes.set_xlabel("step")
    difference_axes.set_ylabel("loss: fa4_jax - cuDNN")
    if pairs:
        difference_axes.legend()
    difference_axes.grid(alpha=0.3)
    speeds = [run["tokens_per_second"] for run in runs]
    bars = speed_axes.bar([label(run) for run in runs], speeds, color=colours,
                          hatch=["//" if run["attention"] == "fa4" and len(meshes) > 1 else None
                                 for run in runs])
    speed_axes.bar_label(bars, labels=[f"{speed:,.0f}\n{run['median_step_seconds'] * 1e3:.2f} ms/step"
                                       for speed, run in zip(speeds, runs)], fontsize=8)
    speed_axes.set_ylim(0, max(speeds) * 1.25)
    speed_axes.set_ylabel("tokens/s (median step)")
    for tick in speed_axes.get_xticklabels():
        tick.set(rotation=15 if len(runs) <= 3 else 25, horizontalalignment="right", fontsize=8)
    device = runs[0]["devices"]
    config = runs[0]["config"]
    figure.suptitle(f"GPT training, {device['kind']} x{device['used']}: {config['layers']} layers, "
                    f"d_model {config['d_model']}, {config['heads']} heads, seq {config['seq_len']}, "
                    f"batch {config['batch']}, {config['dtype']}")
    figure.tight_layout()
    attention.save_png(figure, args.png, dpi=120)
    print(f"wrote {args.png}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="train cudnn and fa4 (on the GPU)")
    run.add_argument("--out", default=os.environ.get("OUT", "."))
    run.add_argument("--name", default="train_gpt_h200.json", help="summary file name in --out")
    run.add_argument("--timeout", type=float, default=150.0, help="seconds per training run")
    run.add_argument("--also-reference", action="store_true", help="also train fa4 on its reference path")
    run.add_argument("--meshes", nargs="+", default=None, metavar="MESH",
                     help="train_gpt.py --mesh values, e.g. data=2 data=1,model=2: cudnn and fa4 on each")
    run.add_argument("train_flags", nargs=argparse.REMAINDER, help="after --: flags for train_gpt.py")
    plot = commands.add_parser("plot", help="PNG of the loss curves and tokens/s")
    plot.add_argument("result")
    plot.add_argument("--png", required=True)
    table = commands.add_parser("table", help="print a summary's comparison and runs")
    table.add_argument("result")
    args = parser.parse_args(argv)
    if args.command == "run":
        args.train_flags = [flag for flag in args.train_flags if flag != "--"]
        run_command(args)
    elif args.command == "plot":
        plot_command(args)
    else:
        table_command(args)


if __name__ == "__main__":
    main()
