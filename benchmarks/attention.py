"""Attention benchmark: fa4_jax vs cuDNN (through jax.nn.dot_product_attention) vs XLA, one process.

Every implementation runs on the same inputs; times are CUPTI kernel times (all kernels of one call,
summed) from jax.experimental.mosaic.gpu.profiler.measure, median over iterations. TFLOP/s counts
forward FLOPs = 4 * B * H * Sq * Sk * D, halved when causal (backward: 2.5x forward).

Shapes (the issue's grid): B * S = 16k tokens, H * D = 2048, S in {1k, 2k, 4k, 8k, 16k},
D in {64, 128, 256}, causal and not, bf16.

Usage:
    python benchmarks/attention.py --out results.json [--sections forward] [--quick]
    python benchmarks/attention.py --variants --out variants.json    (sm90 tuning sweep, below)
    JAX_PLATFORMS=cpu python benchmarks/attention.py --compile-only --compile-workers 8   (its kernels)
    python benchmarks/attention.py --plot results.json --png results.png   (no GPU needed)

Sections are functions in SECTIONS: name -> callable(shape, inputs, args) -> list of row dicts. The
backward is not a section: benchmarks/attention_backward.py is its benchmark (its own variant table,
precompile and test gating).

--variants: the Hopper forward kernel's tuning options (sm90_forward_variants()) on the rows that were
below the bar (VARIANT_ROWS), each next to cuDNN on the same inputs in the same process; the default
configuration is timed first and again last on every row, so the JSON carries the run's own noise.
See docs/sm90_forward_tuning.md for what each variant is and what it is predicted to do.

The git revision comes from $FA4_GIT_REVISION when set (the device copy of the tree has no .git),
else from `git rev-parse HEAD`.
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
import time

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
    """2 B H Sq Sk (D + Dv), Q K^T and P V (4 B H S^2 D when Dv = D), halved when causal; Dv is
    shape["v_head_dim"] where given and not None, else D."""
    v_head_dim = shape.get("v_head_dim") or shape["head_dim"]
    flops = 2.0 * shape["batch"] * shape["heads"] * shape["seq_len"] ** 2 * (shape["head_dim"] + v_head_dim)
    return flops / 2 if shape["causal"] else flops


def _median_ms(function, arguments, iterations):
    from jax.experimental.mosaic.gpu import profiler
    outputs, times = profiler.measure(function, iterations=iterations)(*arguments)
    if times is None:
        raise RuntimeError("CUPTI returned no kernel timings")
    times = times if isinstance(times, list) else [times]
    return outputs, statistics.median(times)


def per_kernel_us(function, arguments, iterations):
    """({"index:name": median us}, their sum) of every kernel one call of `function` launches (CUPTI;
    the names cut to 48 characters, times rounded to ns)."""
    import collections

    from jax.experimental.mosaic.gpu import profiler
    _, runs = profiler.measure(function, aggregate=False, iterations=iterations)(*arguments)
    if runs and isinstance(runs[0], tuple):   # one iteration: one list, not a list of them
        runs = [runs]
    times = collections.defaultdict(list)
    for run in runs:
        for index, (kernel, ms) in enumerate(run):
            times[f"{index}:{kernel[:48]}"].append(ms * 1e3)
    kernels = {kernel: round(statistics.median(us), 3) for kernel, us in times.items()}
    return kernels, round(sum(kernels.values()), 3)


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

# The Hopper forward kernel's tuning candidates (fa4_jax.kernels.sm90.forward.TUNING_CANDIDATES) plus
# "default", the tuned configuration of sm90.forward.options each is compared with:
# name -> (KernelOptions overrides, head dims (D, or a (D, Dv) pair), causal settings).
def sm90_forward_variants():
    from fa4_jax.kernels.sm90 import forward as sm90_forward
    return {"default": ({}, (64, 128, 192, 256, (192, 128)), (False, True)), **sm90_forward.TUNING_CANDIDATES}


# (head dims, causal, seq_len) rows for the candidates (sm90.forward.TUNING_CANDIDATES), head dims a D
# or a (D, Dv) pair: D = 64 causal at 2k and 4k (three warpgroups: the tile order's one open row), the
# causal rows of the tile order (D = 64 1k, MLA's 192/128 2k, short ones with many heads, 4k, 8k), MLA
# full 8k, D = 64 full and causal at 16k and 1k (the polynomial exp2), D = 192 full at 8k and 2k; first, the
# full rows furthest below FA4's forward: D = 256 at 1k and 2k (d256-full-*), D = 128 at 16k, 4k and 1k.
# Ordered by priority, so that a run cut short by --max-seconds still covers the first rows.
VARIANT_ROWS = [(256, False, 1024), (256, False, 2048), (128, False, 16384), (128, False, 4096), (128, False, 1024),
                (64, True, 2048), (64, True, 4096), (64, True, 1024), ((192, 128), True, 2048),
                ((192, 128), False, 8192), (128, True, 1024), (128, True, 2048), (256, True, 1024),
                (192, True, 2048), (128, True, 4096), (128, True, 8192), (64, False, 16384), (64, True, 16384),
                (64, False, 1024), (192, False, 8192), (192, False, 2048)]


def head_dims_of(shape) -> tuple:
    """A row's (D, Dv)."""
    return shape["head_dim"], shape.get("v_head_dim") or shape["head_dim"]


def variants_for(head_dims: tuple, causal: bool, excluded=()):
    """The sm90_forward_variants() names that apply to one row of (D, Dv) `head_dims`, default first."""
    from fa4_jax.kernels.sm90 import forward as sm90_forward
    return [name for name, (_, candidate_dims, causal_settings) in sm90_forward_variants().items()
            if tuple(head_dims) in sm90_forward.candidate_head_dim_pairs(candidate_dims)
            and causal in causal_settings and name not in excluded]


def failed_variants(junit_path: str) -> dict:
    """{variant: [failed test ids]} from a pytest --junitxml report of tests/test_sm90_forward.py -k variant
    (test ids "test_variant_matches_oracle[<variant>+<case>+d<D>]", "...+d<D>-v<Dv>]" where Dv differs). A
    variant that computed a wrong answer, or crashed, is not timed: a crash would also take every later
    timing in the process down."""
    import xml.etree.ElementTree as ElementTree

    failed = {}
    for case in ElementTree.parse(junit_path).getroot().iter("testcase"):
        name = case.get("name", "")
        if not name.startswith("test_variant_matches_oracle["):
            continue
        if case.find("failure") is not None or case.find("error") is not None:
            variant = name[len("test_variant_matches_oracle["):].split("+")[0]
            failed.setdefault(variant, []).append(name)
    return failed


def variant_shapes():
    from fa4_jax.kernels.sm90 import forward as sm90_forward
    for head_dims, causal, length in VARIANT_ROWS:
        [(head_dim, v_head_dim)] = sm90_forward.candidate_head_dim_pairs((head_dims,))
        yield dict(batch=TOKENS // length, seq_len=length, heads=MODEL_WIDTH // head_dim,
                   head_dim=head_dim, v_head_dim=v_head_dim, causal=causal)


def input_shapes(shape) -> tuple:
    """The row's query, key and value shapes [B, S, H, D] (value: Dv)."""
    head_dim, v_head_dim = head_dims_of(shape)
    query = (shape["batch"], shape["seq_len"], shape["heads"], head_dim)
    return query, query, query[:3] + (v_head_dim,)


def _variant_function(shape, overrides):
    """The jitted sm90 forward (out only) for one row and one set of KernelOptions overrides."""
    import jax
    from fa4_jax.config import AttentionConfig
    from fa4_jax.kernels import host
    from fa4_jax.kernels.sm90 import forward as sm90_forward

    config = AttentionConfig(scale=shape["head_dim"] ** -0.5, causal=shape["causal"])

    def forward(q, k, v):
        options = sm90_forward.options(config, host.Problem.of(q, k, v), **overrides)
        return sm90_forward.run(options, q, k, v, {})[0]
    return jax.jit(forward)


def _compile_variant(task):
    """Pool worker: lower one variant for CUDA on the CPU, which compiles the kernel into the on-disk
    cache (fa4_jax.kernels.compile_cache), so the timing process loads it instead of compiling."""
    name, shape = task
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import jax
    import jax.numpy as jnp

    started = time.perf_counter()
    specs = [jax.ShapeDtypeStruct(dims, jnp.bfloat16) for dims in input_shapes(shape)]
    try:
        _variant_function(shape, sm90_forward_variants()[name][0]).trace(*specs).lower(
            lowering_platforms=("cuda",))
    except Exception as error:  # the timing process compiles it again and reports the error
        return name, time.perf_counter() - started, f"{type(error).__name__}: {str(error)[:200]}"
    return name, time.perf_counter() - started, None


def cpu_only_worker():
    """Initializer of the benchmarks' compile workers: they compile, so they must not take GPU memory."""
    os.environ["JAX_PLATFORMS"] = "cpu"


def compile_variants_in_parallel(shape_list, excluded, workers: int) -> dict:
    """Compile every (row, variant) kernel of the sweep in `workers` processes (kernel compilation is
    single-threaded Python: serially it would take most of a device call)."""
    import multiprocessing

    tasks = [(name, shape) for shape in shape_list
             for name in variants_for(head_dims_of(shape), shape["causal"], excluded)]
    started = time.perf_counter()
    errors = {}
    with multiprocessing.get_context("spawn").Pool(workers, initializer=cpu_only_worker) as pool:
        for name, _, error in pool.imap_unordered(_compile_variant, tasks):
            if error:
                errors.setdefault(name, error)
    summary = dict(kernels=len(tasks), workers=workers, seconds=time.perf_counter() - started, errors=errors)
    print(f"compiled {len(tasks)} kernels in {summary['seconds']:.0f} s with {workers} processes"
          + (f"; errors: {errors}" if errors else ""), flush=True)
    return summary


def cudnn_attention(head_dim: int, v_head_dim: int, causal: bool):
    """cuDNN's forward through JAX for one (D, Dv), with jax.nn's scale and mask."""
    import jax
    if v_head_dim == head_dim:
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
    # jax.nn.dot_product_attention refuses Dv != D (it checks value against key's shape), while cuDNN
    # runs it (multi-head latent attention: cuDNN >= 9.10 on sm_90): JAX's cuDNN wrapper that jax.nn
    # calls. A private module: if it moves, the row says so in its cuDNN error.
    from jax._src.cudnn import fused_attention_stablehlo as cudnn
    mask_type = cudnn.MaskType.CAUSAL if causal else cudnn.MaskType.NO_MASK
    return lambda q, k, v: cudnn.dot_product_attention(q, k, v, scale=head_dim ** -0.5, mask_type=mask_type)


def forward_variants_section(shape, arguments, args):
    """cuDNN once, then the sm90 kernel with each applicable variant; default first and last. A row cuDNN
    cannot run keeps its variants' timings (`cudnn_error`; outputs compared with the first default's)."""
    import jax
    import jax.numpy as jnp

    causal = shape["causal"]
    cudnn = {}
    try:
        reference, cudnn_ms = _median_ms(jax.jit(cudnn_attention(*head_dims_of(shape), causal)), arguments,
                                         args.iterations)
        cudnn = dict(cudnn_ms=cudnn_ms, cudnn_tflops=forward_flops(shape) / (cudnn_ms * 1e-3) / 1e12)
    except Exception as error:  # e.g. a cuDNN without MLA's Dv != D: the variants still compare
        reference, cudnn = None, dict(cudnn_error=f"{type(error).__name__}: {str(error)[:300]}")
    names = variants_for(head_dims_of(shape), causal, args.excluded_variants)
    rows = []
    for name in names + ["default"]:
        overrides = sm90_forward_variants()[name][0]
        row = dict(section="forward_variant", variant=name, overrides=overrides, **cudnn, **shape)
        if name == "default" and rows:
            row["repeat"] = True
        try:
            out, milliseconds = _median_ms(_variant_function(shape, overrides), arguments, args.iterations)
        except Exception as error:  # one failing variant must not hide the others
            row["fa4_jax_error"] = f"{type(error).__name__}: {str(error)[:300]}"
            rows.append(row)
            continue
        row["fa4_jax_ms"] = milliseconds
        row["fa4_jax_tflops"] = forward_flops(shape) / (milliseconds * 1e-3) / 1e12
        if "cudnn_ms" in cudnn:
            row["ratio_vs_cudnn"] = cudnn["cudnn_ms"] / milliseconds
        if reference is None:
            reference = out
        else:
            row["max_abs_diff_vs_" + ("cudnn" if "cudnn_ms" in cudnn else "default")] = float(
                jnp.max(jnp.abs(out.astype(jnp.float32) - reference.astype(jnp.float32))))
        rows.append(row)
    return rows


def variant_summary(rows):
    """One line per row: default's time (first and repeat timing), the fastest variant and its time, and
    the ratios to cuDNN where it ran."""
    lines = []
    keys = sorted({(head_dims_of(r), r["causal"], r["seq_len"]) for r in rows if r["section"] == "forward_variant"})
    for head_dims, causal, seq_len in keys:
        timed = [r for r in rows if r["section"] == "forward_variant" and "fa4_jax_ms" in r
                 and (head_dims_of(r), r["causal"], r["seq_len"]) == (head_dims, causal, seq_len)]

        def timing(row):
            ratio = f" ({row['ratio_vs_cudnn']:.3f}x cuDNN)" if "ratio_vs_cudnn" in row else ""
            return f"{row['fa4_jax_ms']:.4f} ms{ratio}"
        defaults = [timing(r) for r in timed if r["variant"] == "default"]
        best = min(timed, key=lambda r: r["fa4_jax_ms"], default=None)
        best_text = f"best {best['variant']} {timing(best)}" if best else "no timings"
        lines.append(f"D={_dims_label(head_dims):7s} causal={int(causal)} S={seq_len:5d}  default "
                     f"{' / '.join(defaults)}  {best_text}")
    return "\n".join(lines)


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


def git_revision() -> str:
    """$FA4_GIT_REVISION when set (the device copy has no .git), else `git rev-parse HEAD`. Every
    benchmark's reports use this."""
    if os.environ.get("FA4_GIT_REVISION"):
        return os.environ["FA4_GIT_REVISION"]
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run(args):
    import jax
    import jax.numpy as jnp

    if args.compile_only:
        # Fill the on-disk kernel cache for a later --variants run (run with JAX_PLATFORMS=cpu, e.g.
        # next to the GPU tests): no device is touched.
        compile_variants_in_parallel(list(variant_shapes()), {}, max(1, args.compile_workers))
        return None
    device = jax.devices()[0]
    report = dict(device=device.device_kind, date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  versions=_versions(), git_revision=git_revision(),
                  timing="CUPTI kernel time, median of iterations (jax.experimental.mosaic.gpu.profiler.measure)",
                  flops="forward 4*B*H*Sq*Sk*D, halved when causal", dtype="bfloat16", rows=[])
    key = jax.random.key(0)
    sections = args.sections
    shape_list = shapes(args.quick)
    args.excluded_variants = {}
    if args.variants:
        sections = ["forward_variants"]
        shape_list = variant_shapes()
        report["timing"] += "; sm90 variants: default timed first and again last on each row (repeat=true)"
        if args.exclude_failed:
            if os.path.exists(args.exclude_failed):
                args.excluded_variants = failed_variants(args.exclude_failed)
            else:
                report["exclude_failed_missing"] = args.exclude_failed
                print(f"no {args.exclude_failed}: timing every variant", flush=True)
        report["excluded_variants"] = args.excluded_variants
        if args.compile_workers:
            shape_list = list(shape_list)
            report["parallel_compile"] = compile_variants_in_parallel(
                shape_list, args.excluded_variants, args.compile_workers)
    started = time.monotonic()
    for shape in shape_list:
        if args.max_seconds and time.monotonic() - started > args.max_seconds:
            report.setdefault("skipped_rows", []).append(shape)
            continue
        key, *subkeys = jax.random.split(key, 4)
        arguments = [jax.random.normal(k, dims, jnp.float32).astype(jnp.bfloat16)
                     for k, dims in zip(subkeys, input_shapes(shape))]
        for section in sections:
            for row in dict(SECTIONS, forward_variants=forward_variants_section)[section](shape, arguments, args):
                report["rows"].append(row)
                print(_format_row(row), flush=True)
        del arguments
        _write(report, args.out)  # after every shape: a run stopped by a timeout keeps what it measured
    if report.get("skipped_rows"):
        print(f"--max-seconds {args.max_seconds}: {len(report['skipped_rows'])} rows not measured", flush=True)
    _write(report, args.out)
    if args.variants:
        print(variant_summary(report["rows"]))
    print(f"wrote {args.out}")
    return report


def measure_rows(report, row_list, measure_row, out, max_seconds=0.0):
    """Append `measure_row(row)` to report["rows"] for each row, printing it as a `row {json}` line and
    rewriting `out` after every row (a run stopped by a timeout keeps what it measured); with
    `max_seconds`, no new row starts after that long (report["stopped_early"] says when)."""
    start = time.time()
    for row in row_list:
        if max_seconds and time.time() - start > max_seconds:
            report["stopped_early"] = f"after {time.time() - start:.0f} s (--max-seconds)"
            break
        record = measure_row(row)
        report["rows"].append(record)
        print("row " + json.dumps(record), flush=True)
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        _write(report, out)


def _write(report, path):
    with open(path, "w") as handle:
        json.dump(report, handle, indent=1)


def _dims_label(head_dims) -> str:
    """D, or D/Dv where they differ."""
    head_dim, v_head_dim = head_dims
    return str(head_dim) if v_head_dim == head_dim else f"{head_dim}/{v_head_dim}"


def _format_row(row):
    def number(name, fmt="{:7.1f}"):
        return fmt.format(row[name]) if name in row else "   -   "
    if row["section"] == "forward_variant":
        return (f"variant  D={_dims_label(head_dims_of(row)):7s} S={row['seq_len']:5d} causal={int(row['causal'])} "
                f"{row['variant'] + (' (repeat)' if row.get('repeat') else ''):22s} fa4 {number('fa4_jax_tflops')} "
                f"cudnn {number('cudnn_tflops')} TFLOP/s  ratio {number('ratio_vs_cudnn', '{:5.2f}')}  "
                f"maxdiff {number('max_abs_diff_vs_cudnn' if 'cudnn_ms' in row else 'max_abs_diff_vs_default', '{:.1e}')}"
                + (f"  [{row['fa4_jax_error'][:120]}]" if "fa4_jax_error" in row else ""))
    return (f"{row['section']:8s} D={row['head_dim']:3d} S={row['seq_len']:5d} causal={int(row['causal'])} "
            f"fa4 {number('fa4_jax_tflops')} cudnn {number('cudnn_tflops')} xla {number('xla_tflops')} "
            f"TFLOP/s  ratio {number('ratio_vs_cudnn', '{:5.2f}')}"
            + "".join(f"  [{name}]" for name in row if name.endswith("_error")))


def save_png(figure, png_path, dpi: int) -> None:
    """Saves a plot as a 256-colour PNG: a third of matplotlib's RGBA size, and every byte of the repository
    travels with each device call next to the ~59 MiB CuTe DSL bundle under a 64 MiB limit."""
    import io

    from PIL import Image

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=dpi)
    image = Image.open(buffer).convert("RGB")
    image.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(png_path, optimize=True)


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
    save_png(figure, png_path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="attention.json")
    parser.add_argument("--sections", nargs="+", default=["forward"], choices=sorted(SECTIONS))
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--xla-max-seq-len", type=int, default=16384)
    parser.add_argument("--quick", action="store_true", help="only the two shortest sequence lengths")
    parser.add_argument("--variants", action="store_true",
                        help="sweep the sm90 forward tuning variants over the below-bar rows (VARIANT_ROWS)")
    parser.add_argument("--exclude-failed", metavar="JUNIT_XML",
                        help="with --variants: skip variants with a failed test in this pytest --junitxml report")
    parser.add_argument("--max-seconds", type=float, default=0,
                        help="start no new shape after this many seconds (0: no limit)")
    parser.add_argument("--compile-workers", type=int, default=0,
                        help="with --variants: first compile all kernels in this many CPU-only processes")
    parser.add_argument("--compile-only", action="store_true",
                        help="only compile the --variants kernels into the on-disk cache (no GPU needed)")
    parser.add_argument("--plot", help="draw this JSON report instead of measuring")
    parser.add_argument("--png", default="attention.png")
    args = parser.parse_args(argv)
    if args.plot:
        plot(args.plot, args.png)
        return
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    # The on-disk kernel cache names files after the CUTE_DSL_* variables: the compile workers (which
    # see no GPU) and this process must agree on the target, the sm90 kernel the variants sweep. The
    # plain forward run leaves it to the DSL, which compiles for the local GPU: sm_90a would fail to
    # compile the sm100 kernel that a Blackwell GPU dispatches to.
    if args.variants or args.compile_only:
        os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    run(args)


if __name__ == "__main__":
    main()
