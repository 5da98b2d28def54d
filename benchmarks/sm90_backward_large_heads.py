"""Time the sm90 large-head backward kernel (D = 192 / 256) and its `Tuning` candidates against
cuDNN's backward, same inputs.

Rows of the issue's grid (B*S = 16k tokens, H*D = 2048, bf16), CUPTI kernel time, median of
iterations, through benchmarks/attention_backward.py's helpers (residuals from the forward kernel,
cuDNN's VJP with its residuals precomputed, FLOPs = 2.5x forward). Per shape: every variant of
VARIANTS (`sm90_backward_large_heads.backward_with_options`: preprocess + kernel + postprocess),
cuDNN, then the first variant again (`<variant>_repeat_ms`: the spread of its two timings is the
noise). Each variant's dq/dk/dv are compared with cuDNN's (max |difference|), so a wrong one shows.
The JSON is rewritten after every row.

--precompile-workers N first lowers every (shape, variant) kernel and the residuals' forward for
CUDA in N CPU-platform processes into the on-disk kernel cache; --precompile-only stops there (run
it alongside the GPU tests). --variants-passing LOG keeps the candidates only if their GPU tests
(tests/test_sm90_backward_large_heads.py, ids `no_stagger` / `diagonal_first`) all passed in that
pytest log of a run that finished: a turn order that deadlocks is not timed.

Usage: python benchmarks/sm90_backward_large_heads.py --out large_heads.json [--head-dims 256]
       [--seq-lens 1024 4096 16384] [--iterations 10] [--variants default no_stagger ...]
       [--precompile-workers 8] [--precompile-only] [--variants-passing PYTEST_LOG]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import multiprocessing
import os
import re
import sys
import time

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import attention  # noqa: E402
import attention_backward  # noqa: E402

# Candidate variant -> the id its GPU tests carry in tests/test_sm90_backward_large_heads.py. The
# other variants are the shipped kernel, tested at every revision.
TESTED_BY = {"no_stagger": "no_stagger", "deterministic_diagonal_first": "diagonal_first"}


def variants():
    """name -> (Tuning, deterministic), timed in this order."""
    from fa4_jax.kernels import sm90_backward_large_heads as large_heads

    return {
        "default": (large_heads.DEFAULT_TUNING, False),
        "no_stagger": (large_heads.Tuning(stagger=False), False),
        "deterministic": (large_heads.DEFAULT_TUNING, True),
        "deterministic_diagonal_first": (large_heads.Tuning(diagonal_first=True), True),
    }


def variants_passing(test_log: str):
    """The variants to time after the GPU tests in `test_log` (pytest -v or -rA): the shipped ones,
    and each candidate whose tests passed, none failed, in a run that reached its summary line."""
    with open(test_log) as handle:
        lines = handle.read().splitlines()
    finished = any(re.match(r"=+ .*\d+ (passed|failed).* in [\d.]+s", line) for line in lines)

    def outcomes(test_id):
        found = set()
        for line in lines:
            parameters = re.search(r"::\w+\[([^\]]*)\]", line)
            if parameters and test_id in parameters.group(1).split("-"):
                found.update(word for word in ("PASSED", "FAILED", "ERROR") if word in line)
        return found

    kept = []
    for name in variants():
        test_id = TESTED_BY.get(name)
        if test_id is None or (finished and outcomes(test_id) == {"PASSED"}):
            kept.append(name)
    return kept


def _backward(config, tuning):
    import jax
    from fa4_jax.kernels import sm90_backward_large_heads

    return jax.jit(lambda q, k, v, o, l, g: sm90_backward_large_heads.backward_with_options(
        q, k, v, o, l, g, None, {}, config, tuning)[:3])


def _lower_for_cuda(job):
    """Worker: lower one backward variant (or the residuals' forward) for CUDA into the disk cache."""
    import jax
    import jax.numpy as jnp

    shape, variant = job
    batch, length, heads, dim = attention_backward._dims(shape)
    tensor = jax.ShapeDtypeStruct((batch, length, heads, dim), jnp.bfloat16)
    start = time.perf_counter()
    try:
        if variant == "forward":
            attention_backward._forward(attention_backward._config(shape)).trace(
                tensor, tensor, tensor).lower(lowering_platforms=("cuda",))
        else:
            tuning, deterministic = variants()[variant]
            lse = jax.ShapeDtypeStruct((batch, heads, length), jnp.float32)
            _backward(attention_backward._config(shape, deterministic), tuning).trace(
                tensor, tensor, tensor, tensor, lse, tensor).lower(lowering_platforms=("cuda",))
        return variant, time.perf_counter() - start, None
    except Exception as error:  # the timing process compiles it itself then
        return variant, time.perf_counter() - start, f"{type(error).__name__}: {str(error)[:200]}"


def _cpu_only():
    os.environ["JAX_PLATFORMS"] = "cpu"


def precompile(shapes, names, workers):
    """Fill the on-disk kernel cache for every (shape, variant) in `workers` CPU-platform processes."""
    jobs = [(shape, name) for shape in shapes for name in ["forward", *names]]
    start = time.perf_counter()
    failures = []
    with concurrent.futures.ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("spawn"), initializer=_cpu_only) as pool:
        for (shape, _), (variant, _, error) in zip(jobs, pool.map(_lower_for_cuda, jobs)):
            if error:
                failures.append(dict(variant=variant, **shape, error=error))
    elapsed = time.perf_counter() - start
    print(f"precompiled {len(jobs)} kernels in {elapsed:.0f} s with {workers} workers, "
          f"{len(failures)} failures", flush=True)
    return dict(jobs=len(jobs), seconds=elapsed, failures=failures)


def time_row(shape, names, iterations):
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(0), 4)
    dims = attention_backward._dims(shape)
    query, key, value, d_out = (jax.random.normal(k, dims, jnp.float32).astype(jnp.bfloat16)
                                for k in keys)
    out, lse, source = attention_backward._forward_residuals(
        query, key, value, attention_backward._config(shape))
    row = dict(**shape, residuals=source)
    _, cudnn_vjp = jax.vjp(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=shape["causal"], implementation="cudnn"), query, key, value)
    table = variants()
    ours = (query, key, value, out, lse, d_out)
    candidates = {name: (_backward(attention_backward._config(shape, table[name][1]),
                                   table[name][0]), ours) for name in names}
    candidates["cudnn"] = (jax.jit(lambda vjp, g: vjp(g)), (cudnn_vjp, d_out))
    grads = {}
    for name, (function, arguments) in [*candidates.items(),
                                        (f"{names[0]}_repeat", candidates[names[0]])]:
        try:
            grads[name], row[f"{name}_ms"] = attention._median_ms(function, arguments, iterations)
            row[f"{name}_tflops"] = (attention_backward.backward_flops(shape)
                                     / (row[f"{name}_ms"] * 1e-3) / 1e12)
        except Exception as error:  # report and keep going
            row[f"{name}_error"] = f"{type(error).__name__}: {str(error)[:300]}"
    for name in names:
        if name in grads and "cudnn" in grads:
            row[f"{name}_vs_cudnn"] = row["cudnn_ms"] / row[f"{name}_ms"]
            for label, a, b in zip(("dq", "dk", "dv"), grads[name], grads["cudnn"]):
                row[f"{name}_max_abs_diff_{label}"] = float(jnp.max(jnp.abs(
                    a.astype(jnp.float32) - b.astype(jnp.float32))))
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="large_heads.json")
    parser.add_argument("--head-dims", nargs="+", type=int, default=[256])
    parser.add_argument("--seq-lens", nargs="+", type=int, default=[1024, 4096, 16384])
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--variants", nargs="+", help="names from `variants()` (default: all)")
    parser.add_argument("--precompile-workers", type=int, default=0)
    parser.add_argument("--precompile-only", action="store_true")
    parser.add_argument("--variants-passing", metavar="PYTEST_LOG")
    args = parser.parse_args(argv)
    names = args.variants or list(variants())
    unknown = set(names) - set(variants())
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; known: {sorted(variants())}")
    if args.variants_passing:
        passing = variants_passing(args.variants_passing)
        names = [name for name in names if name in passing]
        print(f"variants to time ({args.variants_passing}): {' '.join(names)}", flush=True)
    shapes = [shape for shape in attention.shapes()
              if shape["head_dim"] in args.head_dims and shape["seq_len"] in args.seq_lens]
    if args.precompile_only:
        precompile(shapes, names, args.precompile_workers or os.cpu_count())
        return
    report = dict(git_revision=attention.git_revision(), dtype="bfloat16",
                  timing="CUPTI kernel time, median of iterations",
                  ratio="<variant>_vs_cudnn = cudnn_ms / <variant>_ms (above 1: faster than cuDNN)",
                  variants={name: dict(dataclasses.asdict(variants()[name][0]),
                                       deterministic=variants()[name][1]) for name in names},
                  rows=[])
    if args.precompile_workers:
        report["precompile"] = precompile(shapes, names, args.precompile_workers)
    for shape in shapes:
        row = time_row(shape, names, args.iterations)
        report["rows"].append(row)
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=1)
        ratios = " ".join(f"{name} {row.get(f'{name}_vs_cudnn', float('nan')):.2f}"
                          for name in names)
        print(f"D={shape['head_dim']} causal={int(shape['causal'])} S={shape['seq_len']:5d} "
              f"cudnn {row.get('cudnn_ms', float('nan')):7.3f} ms | vs cuDNN: {ratios} | "
              f"repeat {row.get(f'{names[0]}_repeat_ms', float('nan')):7.3f} ms", flush=True)


if __name__ == "__main__":
    main()
