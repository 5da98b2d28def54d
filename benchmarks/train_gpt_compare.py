"""examples/train_gpt.py with fa4_jax attention against cuDNN attention: same seed, data and steps.

    # on the GPU: one process per run (a crash in one cannot take the others' results with it)
    python benchmarks/train_gpt_compare.py run --out DIR -- --dtype bfloat16 --steps 150 ...
    # anywhere with matplotlib: loss curves and tokens/s
    python benchmarks/train_gpt_compare.py plot DIR/train_gpt_h200.json --png OUT.png

`run` trains with --attention cudnn, then fa4 (implementation auto: our kernels where they take the call,
the reference with a warning where not); if the fa4 run fails it retries with the reference and says so.
It writes each run's JSON and log, and one summary JSON holding every run plus the comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_gpt.py"


def train(out_dir: pathlib.Path, name: str, flags: list[str], timeout: float) -> dict:
    """One training run in its own process; its JSON, or a failure record with the log's tail."""
    json_path = out_dir / f"{name}.json"
    log_path = out_dir / f"{name}.log"
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
    print(f"{name}: exit {returncode} after {time.perf_counter() - start:.0f} s", flush=True)
    if returncode == 0 and json_path.exists():
        return {"name": name, "ok": True, **json.loads(json_path.read_text())}
    return {"name": name, "ok": False, "flags": flags, "exit": returncode, "log_tail": output[-4000:]}


def compare(runs: list[dict]) -> dict:
    by_name = {run["name"]: run for run in runs if run["ok"]}
    baseline = by_name.get("cudnn")
    summary = {}
    for name, run in by_name.items():
        if name == "cudnn" or baseline is None:
            continue
        differences = [abs(a - b) for a, b in zip(run["loss"], baseline["loss"])]
        tail = max(1, len(differences) // 5)
        summary[name] = {
            "step_time_ratio_vs_cudnn": run["median_step_seconds"] / baseline["median_step_seconds"],
            "max_abs_loss_difference": max(differences),
            "mean_abs_loss_difference_last_fifth": sum(differences[-tail:]) / tail,
            "final_loss": run["loss"][-1], "cudnn_final_loss": baseline["loss"][-1],
        }
    return summary


def run_command(args):
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    flags = args.train_flags
    runs = [train(out_dir, "cudnn", flags + ["--attention", "cudnn"], args.timeout)]
    fa4 = train(out_dir, "fa4", flags + ["--attention", "fa4"], args.timeout)
    runs.append(fa4)
    if args.also_reference or not fa4["ok"]:
        runs.append(train(out_dir, "fa4_reference",
                          flags + ["--attention", "fa4", "--fa4-implementation", "reference"], args.timeout))
    summary = {"train_flags": flags, "comparison": compare(runs), "runs": runs}
    (out_dir / args.name).write_text(json.dumps(summary, indent=1))
    for name, numbers in summary["comparison"].items():
        print(f"{name}: step time / cudnn = {numbers['step_time_ratio_vs_cudnn']:.3f}, "
              f"max |loss - cudnn loss| = {numbers['max_abs_loss_difference']:.4f}")
    for run in runs:
        if run["ok"]:
            print(f"{run['name']:>14}: {run['tokens_per_second']:>12,.0f} tokens/s, median step "
                  f"{run['median_step_seconds'] * 1e3:.2f} ms, final loss {run['loss'][-1]:.4f}, "
                  f"custom calls {run['custom_calls']}, warnings {run['warnings']}")


def describe(run: dict) -> str:
    """What the run's attention really was, read off its compiled step's custom calls."""
    if run["attention"] != "fa4":
        return {"cudnn": "cuDNN", "xla": "XLA"}[run["attention"]]
    kernels = any(target.startswith("CuteDSLRT") for target in run.get("custom_calls", {}))
    return "fa4_jax (CuTe kernels)" if kernels else "fa4_jax (reference path)"


def plot_command(args):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = json.loads(pathlib.Path(args.result).read_text())
    runs = [run for run in summary["runs"] if run["ok"]]
    labels = {run["name"]: describe(run) for run in runs}
    figure, (loss_axes, speed_axes) = plt.subplots(1, 2, figsize=(12, 4.5),
                                                   gridspec_kw={"width_ratios": [2, 1]})
    for run in runs:
        loss_axes.plot(range(1, len(run["loss"]) + 1), run["loss"], label=labels[run["name"]],
                       linewidth=1.2)
    loss_axes.set_xlabel("step")
    loss_axes.set_ylabel("training loss")
    loss_axes.legend()
    loss_axes.grid(alpha=0.3)
    speeds = [run["tokens_per_second"] for run in runs]
    bars = speed_axes.bar([labels[run["name"]] for run in runs], speeds, color=["C0", "C1", "C2"][:len(runs)])
    speed_axes.bar_label(bars, labels=[f"{speed:,.0f}\n{run['median_step_seconds'] * 1e3:.2f} ms/step"
                                       for speed, run in zip(speeds, runs)])
    speed_axes.set_ylim(0, max(speeds) * 1.2)
    speed_axes.set_ylabel("tokens/s (median step)")
    speed_axes.tick_params(axis="x", labelrotation=15)
    device = runs[0]["devices"]
    config = runs[0]["config"]
    figure.suptitle(f"GPT training, {device['kind']} x{device['used']}: {config['layers']} layers, "
                    f"d_model {config['d_model']}, {config['heads']} heads, seq {config['seq_len']}, "
                    f"batch {config['batch']}, {config['dtype']}")
    figure.tight_layout()
    figure.savefig(args.png, dpi=120)
    print(f"wrote {args.png}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="train cudnn and fa4 (on the GPU)")
    run.add_argument("--out", default=os.environ.get("OUT", "."))
    run.add_argument("--name", default="train_gpt_h200.json", help="summary file name in --out")
    run.add_argument("--timeout", type=float, default=150.0, help="seconds per training run")
    run.add_argument("--also-reference", action="store_true", help="also train fa4 on its reference path")
    run.add_argument("train_flags", nargs=argparse.REMAINDER, help="after --: flags for train_gpt.py")
    plot = commands.add_parser("plot", help="PNG of the loss curves and tokens/s")
    plot.add_argument("result")
    plot.add_argument("--png", required=True)
    args = parser.parse_args(argv)
    if args.command == "run":
        args.train_flags = [flag for flag in args.train_flags if flag != "--"]
        run_command(args)
    else:
        plot_command(args)


if __name__ == "__main__":
    main()
