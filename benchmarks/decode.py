"""Decode benchmark (issue 16): fa4_jax.paged_attention vs Pallas decode kernels vs the reference, one process.

Rows: batch in {1, 8, 64}, context in {1k, 8k, 32k, 128k} (every sequence full), Hq / Hkv = 32 / 8,
D = 128, page size 16 and 64, Sq in {1, 4}, bf16, block tables a random permutation of the cache.
Per row: our kernel (`fa4_jax.paged_attention(implementation="cute")`: the split kernel and the
combine kernel that merges its splits (one split: the split kernel alone); `num_splits` records how many.
Reports before 2026-12-07 may also hold `fa4_jax_last_cta_combine_ms` (`fa4_jax_fused_combine_ms` before
2026-12-06) and `fa4_jax_cluster_combine_ms` / `cluster_num_splits`: merges measured slower and deleted
(docs/kernels.md). With --option-variants the DecodeOptions candidates (OPTION_VARIANTS) through
decode.run, `fa4_jax_<name>_ms`, beside `fa4_jax_run_ms`, the default options through it), Pallas
`decode_attention.gqa` on the same cache viewed contiguously (its API takes [B, L, Hkv, D] and transposes K
and V to [B, Hkv, L, D] inside the call, which its time includes) and Pallas `paged_attention` (its own
[Hkv, pages, page, D] layout, copied untimed; its default block_h = 16, the smallest it takes) where they
run (Sq = 1 only: both take one query token), and the reference where its gathered float32 copy stays small
(K/V <= 1 GiB). Pallas' outputs are not compared (their scales differ); ours is compared with the
reference's (max_abs_diff_vs_reference).
Times are CUPTI kernel times of one call (all its kernels summed), median over iterations
(jax.experimental.mosaic.gpu.profiler.measure): repeated calls on the same cache, so K / V up to ~40 MB
stays in the 50 MB L2 from one call to the next. With --cold-l2 also ours and Pallas with the L2 emptied
before each call (`*_cold_ms`, `fa4_jax_cold_tbps`, `pallas_best_cold_ms`): what a decode step sees
after the other layers' work. Bandwidth = bytes of K and V read (B · context ·
Hkv · D · 2 bytes · 2) / time; `copy_tbps` is the fastest of four device-to-device copies over 4 GiB
(`copy_kernels`: bf16 and uint32 `x + 1`, `jnp.copy`, by CUPTI, and the driver's cuMemcpyDtoD between CUDA
events, `memcpy_ms`; read + write bytes / time, each in `copy_kernels_tbps`) measured in the same run, the
bar's yardstick (>= 75 % of it at contexts >= 8k).

Our kernels compile first in parallel CPU-only processes into the on-disk kernel cache (one per
distinct DecodeOptions), so the timed process loads them.

Usage:
    python benchmarks/decode.py --out benchmarks/results/decode_h200.json [--batches 1,8] [--quick]
        [--option-variants xla_combine,no_page_lookahead] [--cold-l2]
    python benchmarks/decode.py --plot benchmarks/results/decode_h200.json --png decode_h200.png
    python benchmarks/decode.py --merge b1.json b8.json b64.json --out decode_h200.json   (no GPU needed)

A device call has a time limit, so the grid may run as one process per batch size (--batches 1, ...),
each with its own copy measurement; --merge joins them (rows keep their run's `copy_tbps` and
`fraction_of_copy`; the top-level `copy_tbps` is the highest of the runs, the stricter yardstick, `runs`
lists each).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import multiprocessing
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks import attention  # noqa: E402  (timing, versions, git revision, compile workers)

BATCHES = (1, 8, 64)
CONTEXTS = (1024, 8192, 32768, 131072)
PAGE_SIZES = (16, 64)
Q_LENS = (1, 4)
Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
REFERENCE_MAX_BYTES = 2 ** 30   # K/V bytes up to which the reference runs (it gathers a float32 copy)
COPY_BYTES = 4 * 2 ** 30
L2_FLUSH_BYTES = 512 * 2 ** 20   # --cold-l2: written between timed calls (the H100's / H200's L2: 50 MB)


def rows(batches=BATCHES, contexts=CONTEXTS, quick=False, page_sizes=PAGE_SIZES):
    if quick:
        batches, contexts = [b for b in batches if b in (1, 64)], [c for c in contexts if c in (8192, 32768)]
    return [dict(batch=b, context=c, q_len=q, page_size=p)
            for b in batches for c in contexts for p in page_sizes for q in Q_LENS]


def kv_bytes(row) -> int:
    return row["batch"] * row["context"] * KV_HEADS * HEAD_DIM * 2 * 2


def _problem(row):
    from fa4_jax.kernels import host

    pages = row["context"] // row["page_size"]
    logical = (row["batch"], pages * row["page_size"], KV_HEADS, HEAD_DIM)
    return host.Problem((row["batch"], row["q_len"], Q_HEADS, HEAD_DIM), logical, logical, "bfloat16",
                        page_size=row["page_size"])


def _config():
    from fa4_jax.config import AttentionConfig
    return AttentionConfig(scale=HEAD_DIM ** -0.5, causal=True, has_kv_seq_lengths=True)


def _specs(row):
    import jax
    import jax.numpy as jnp

    pages = row["context"] // row["page_size"]
    cache = jax.ShapeDtypeStruct((row["batch"] * pages, row["page_size"], KV_HEADS, HEAD_DIM), jnp.bfloat16)
    return (jax.ShapeDtypeStruct((row["batch"], row["q_len"], Q_HEADS, HEAD_DIM), jnp.bfloat16), cache, cache,
            jax.ShapeDtypeStruct((row["batch"], pages), jnp.int32), jax.ShapeDtypeStruct((row["batch"],), jnp.int32))


def _options(row, sm_count, **overrides):
    from fa4_jax.kernels.sm90 import decode
    return decode.options(_config(), _problem(row), sm_count=sm_count, **overrides)


def _compile_row(row):
    """Pool worker: lower our decode kernel for one row for CUDA on the CPU (fills the disk cache)."""
    import jax
    from fa4_jax.kernels.sm90 import decode
    from fa4_jax.kernels.sm90 import DEFAULT_SM_COUNT

    started = time.perf_counter()
    try:
        options = _options(row, row["sm_count"] or DEFAULT_SM_COUNT, **row["overrides"])
        jax.jit(lambda *a: decode.run(options, *a)).trace(*_specs(row)).lower(lowering_platforms=("cuda",))
    except Exception as error:  # the timing process compiles it again and reports the error
        return time.perf_counter() - started, f"{type(error).__name__}: {str(error)[:200]}"
    return time.perf_counter() - started, None


def precompile(row_list, workers: int, sm_count: int, variants=({},)):
    distinct = {}
    for row in row_list:
        for overrides in variants:
            distinct.setdefault(_options(row, sm_count, **overrides), dict(row, sm_count=sm_count, overrides=overrides))
    started = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(workers, initializer=attention.cpu_only_worker) as pool:
        errors = [error for _, error in pool.imap_unordered(_compile_row, list(distinct.values())) if error]
    summary = dict(kernels=len(distinct), workers=workers, seconds=round(time.perf_counter() - started, 1),
                   errors=errors[:3])
    print(f"compiled {len(distinct)} decode kernels in {summary['seconds']} s", flush=True)
    return summary


def l2_flush():
    """A function that evicts the L2 (a read and write of L2_FLUSH_BYTES, several times any Hopper L2) and
    returns its result, for --cold-l2; the buffer stays allocated for the run."""
    import jax
    import jax.numpy as jnp

    buffer = jnp.zeros((L2_FLUSH_BYTES // 4,), jnp.float32)
    touch = jax.jit(lambda b: b + 1.0)
    return lambda: touch(buffer)


def _cold_median_ms(function, arguments, iterations, flush) -> float:
    """Median CUPTI kernel time of one call of `function` right after `flush` has emptied the L2 of its
    inputs: one timed call per flush, the flush itself outside the timed region."""
    import jax
    from jax.experimental.mosaic.gpu import profiler

    times = []
    for _ in range(iterations):
        jax.block_until_ready(flush())
        _, ms = profiler.measure(function)(*arguments)
        if ms is None:
            raise RuntimeError("CUPTI returned no kernel timings")
        times.append(ms[0] if isinstance(ms, list) else ms)
    return statistics.median(times)


def copy_kernels():
    """name -> (function, a maker of its input) of the copies `copy_bandwidth` times, each reading and writing
    COPY_BYTES: XLA's elementwise kernel in 2- and 4-byte words, and its plain copy. On an H100 the bf16 `x + 1`
    measured 2.94 TB/s (88 % of the HBM3's 3.35), on the H200 3.37 (70 % of the HBM3e's 4.8), against
    the ~4.3 issue 16 expected there: one kernel's shortfall on one GPU should not lower the bar."""
    import jax.numpy as jnp

    return {
        "bf16 x + 1": (lambda a: a + jnp.bfloat16(1), lambda: jnp.zeros((COPY_BYTES // 2,), jnp.bfloat16)),
        "uint32 x + 1": (lambda a: a + jnp.uint32(1), lambda: jnp.zeros((COPY_BYTES // 4,), jnp.uint32)),
        "copy": (lambda a: jnp.copy(a), lambda: jnp.ones((COPY_BYTES // 4,), jnp.float32)),
    }


def memcpy_ms(iterations: int) -> float:
    """Median ms of one cuMemcpyDtoDAsync of COPY_BYTES between two fresh allocations, between CUDA events
    (CUPTI's kernel list that times the other copies lacks a memcpy): the driver's own device-to-device
    copy, bandwidthTest's yardstick, in JAX's context on the device JAX uses first."""
    import jax
    from cuda.bindings import driver

    def check(result):
        error, *values = result if isinstance(result, tuple) else (result,)
        if error != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA driver: {error}")
        return values[0] if len(values) == 1 else values

    jax.devices()   # JAX's client (and the primary context it uses) first
    check(driver.cuInit(0))
    device = check(driver.cuDeviceGet(jax.devices()[0].local_hardware_id or 0))
    context = check(driver.cuDevicePrimaryCtxRetain(device))
    check(driver.cuCtxPushCurrent(context))
    source = destination = stream = None
    events = []
    try:
        source, destination = check(driver.cuMemAlloc(COPY_BYTES)), check(driver.cuMemAlloc(COPY_BYTES))
        stream = check(driver.cuStreamCreate(0))
        events = [check(driver.cuEventCreate(0)) for _ in range(2)]
        times = []
        for i in range(iterations + 1):   # the first is the warm-up
            check(driver.cuEventRecord(events[0], stream))
            check(driver.cuMemcpyDtoDAsync(destination, source, COPY_BYTES, stream))
            check(driver.cuEventRecord(events[1], stream))
            check(driver.cuEventSynchronize(events[1]))
            if i:
                times.append(check(driver.cuEventElapsedTime(events[0], events[1])))
        return statistics.median(times)
    finally:
        for event in events:
            driver.cuEventDestroy(event)
        if stream is not None:
            driver.cuStreamDestroy(stream)
        for pointer in (source, destination):
            if pointer is not None:
                driver.cuMemFree(pointer)
        driver.cuCtxPopCurrent()
        driver.cuDevicePrimaryCtxRelease(device)


def copy_bandwidth(iterations: int) -> tuple:
    """(the fastest copy's TB/s, {copy: TB/s or its error}): read + write bytes over time, CUPTI kernel time
    for `copy_kernels`, CUDA events for the driver's memcpy (`memcpy_ms`)."""
    import jax

    def kernel_ms(function, make):
        return attention._median_ms(jax.jit(function), (make(),), iterations)[1]   # the input dies here

    timers = {name: functools.partial(kernel_ms, function, make) for name, (function, make) in copy_kernels().items()}
    timers["cuMemcpyDtoD"] = functools.partial(memcpy_ms, iterations)
    measured = {}
    for name, milliseconds in timers.items():
        try:
            measured[name] = 2 * COPY_BYTES / (milliseconds() * 1e-3) / 1e12
        except Exception as error:  # e.g. a copy XLA issues as a memcpy, which CUPTI's kernel list lacks
            measured[name] = f"{type(error).__name__}: {error}"[:200]
    rates = [rate for rate in measured.values() if isinstance(rate, float)]
    if not rates:
        raise RuntimeError(f"no copy could be timed: {measured}")
    return max(rates), measured


def _inputs(row, key):
    import jax
    import jax.numpy as jnp

    batch, pages = row["batch"], row["context"] // row["page_size"]
    k_q, k_k, k_v, k_p = jax.random.split(key, 4)
    shape = (batch * pages, row["page_size"], KV_HEADS, HEAD_DIM)
    query = jax.random.normal(k_q, (batch, row["q_len"], Q_HEADS, HEAD_DIM), jnp.bfloat16)
    key_cache = jax.random.normal(k_k, shape, jnp.bfloat16)
    value_cache = jax.random.normal(k_v, shape, jnp.bfloat16)
    tables = jax.random.permutation(k_p, batch * pages).astype(jnp.int32).reshape(batch, pages)
    lengths = jnp.full((batch,), row["context"], jnp.int32)
    return query, key_cache, value_cache, tables, lengths


def _pallas_functions(row, arguments):
    """name -> (jitted function, its arguments) for the Pallas kernels that take this row (Sq = 1)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.gpu import decode_attention, paged_attention

    if row["q_len"] != 1:
        return {}
    query, key_cache, value_cache, tables, lengths = arguments
    batch = row["batch"]
    # The contiguous view of the same bytes: sequence b is cache blocks b * pages .. in order.
    contiguous = lambda cache: cache.reshape(batch, row["context"], KV_HEADS, HEAD_DIM)
    gqa = jax.jit(lambda q, k, v, n: decode_attention.gqa(q[:, 0], contiguous(k), contiguous(v), kv_seq_len=n))
    functions = {"pallas_gqa": (gqa, (query, key_cache, value_cache, lengths))}
    by_head = lambda cache: jnp.transpose(cache, (2, 0, 1, 3))   # [Hkv, pages, page, D], copied untimed
    paged = jax.jit(lambda q, k, v, t, n: paged_attention.paged_attention(
        q[:, 0], k, v, t, n, pages_per_compute_block=max(1, 128 // row["page_size"])))
    functions["pallas_paged"] = (paged, (query, by_head(key_cache), by_head(value_cache), tables, lengths))
    return functions


# DecodeOptions candidates `--option-variants` times through decode.run, beside the defaults through it.
# xla_combine: the splits merged by XLA's pass (combine_partials) instead of our combine kernel, the default.
OPTION_VARIANTS = {"no_page_lookahead": {"page_lookahead": False}, "xla_combine": {"combine": "xla"}}


def measure(row, key, iterations, sm_count: int = None, option_variants=(), cold_flush=None) -> dict:
    import jax
    import fa4_jax
    from fa4_jax.kernels.sm90 import DEFAULT_SM_COUNT, decode

    sm_count = sm_count or DEFAULT_SM_COUNT
    arguments = _inputs(row, key)
    record = dict(row, kv_bytes=kv_bytes(row), num_splits=_options(row, sm_count).num_splits)
    ours = jax.jit(lambda *a: fa4_jax.paged_attention(*a, implementation="cute"))
    try:
        our_out, ms = attention._median_ms(ours, arguments, iterations)
        record["fa4_jax_ms"] = ms
        record["fa4_jax_tbps"] = kv_bytes(row) / (ms * 1e-3) / 1e12
    except Exception as error:
        our_out = None
        record["fa4_jax_error"] = attention_error(error)
    # The DecodeOptions candidates beside the default options, all through decode.run.
    timed = [("run", {})] + [(name, OPTION_VARIANTS[name]) for name in option_variants] if option_variants else []
    for name, overrides in timed:
        options = _options(row, sm_count, **overrides)
        try:
            _, record[f"fa4_jax_{name}_ms"] = attention._median_ms(
                jax.jit(lambda *a: decode.run(options, *a)), arguments, iterations)
        except Exception as error:
            record[f"fa4_jax_{name}_error"] = attention_error(error)
    pallas_times = {}
    for name, (function, pallas_arguments) in _pallas_functions(row, arguments).items():
        try:
            _, ms = attention._median_ms(function, pallas_arguments, iterations)
            pallas_times[name] = ms
        except Exception as error:
            record[f"{name}_error"] = attention_error(error)
    record.update({f"{name}_ms": ms for name, ms in pallas_times.items()})
    record["pallas_best_ms"] = min(pallas_times.values()) if pallas_times else None
    if cold_flush is not None:   # --cold-l2: each call after the L2 was emptied (no K / V left from the last)
        cold = {"fa4_jax": (ours, arguments), **_pallas_functions(row, arguments)}
        for name, (function, function_arguments) in cold.items():
            try:
                record[f"{name}_cold_ms"] = _cold_median_ms(function, function_arguments, iterations, cold_flush)
            except Exception as error:
                record[f"{name}_cold_error"] = attention_error(error)
        if "fa4_jax_cold_ms" in record:
            record["fa4_jax_cold_tbps"] = kv_bytes(row) / (record["fa4_jax_cold_ms"] * 1e-3) / 1e12
        pallas_cold = [record[f"{name}_cold_ms"] for name in pallas_times if f"{name}_cold_ms" in record]
        record["pallas_best_cold_ms"] = min(pallas_cold) if pallas_cold else None
    if record["pallas_best_ms"] is not None and "fa4_jax_ms" in record:
        record["speedup_vs_pallas_best"] = record["pallas_best_ms"] / record["fa4_jax_ms"]
    if kv_bytes(row) <= REFERENCE_MAX_BYTES:
        reference = jax.jit(lambda *a: fa4_jax.paged_attention(*a, implementation="reference"))
        try:
            ref_out, record["reference_ms"] = attention._median_ms(reference, arguments, max(3, iterations // 4))
            if our_out is not None:
                record["max_abs_diff_vs_reference"] = float(
                    abs(ref_out.astype("float32") - our_out.astype("float32")).max())
        except Exception as error:
            record["reference_error"] = attention_error(error)
    return record


def attention_error(error) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"


def _format(record) -> str:
    def number(name, fmt="{:8.3f}"):
        value = record.get(name)
        return fmt.format(value) if isinstance(value, (int, float)) else "    -   "
    return (f"B={record['batch']:3d} ctx={record['context']:6d} q={record['q_len']} page={record['page_size']:2d}  "
            f"ours {number('fa4_jax_ms')} ms {number('fa4_jax_tbps', '{:5.2f}')} TB/s "
            f"({record.get('num_splits')} splits; run {number('fa4_jax_run_ms')}"
            + "".join(f" / {name} {number(f'fa4_jax_{name}_ms')}" for name in OPTION_VARIANTS
                      if f"fa4_jax_{name}_ms" in record) + " ms)  "
            f"pallas best {number('pallas_best_ms')} ms  ref {number('reference_ms')} ms"
            + (f"  cold L2: ours {number('fa4_jax_cold_ms')} ms {number('fa4_jax_cold_tbps', '{:5.2f}')} TB/s, "
               f"pallas best {number('pallas_best_cold_ms')} ms" if "fa4_jax_cold_ms" in record else "")
            + "".join(f"  [{name}: {record[name][:80]}]" for name in record if name.endswith("_error")))


def run(args):
    import jax
    from fa4_jax.kernels import host
    from fa4_jax.kernels.sm90 import DEFAULT_SM_COUNT

    subset = lambda text, default: tuple(int(n) for n in text.split(",")) if text else default
    row_list = rows(subset(args.batches, BATCHES), subset(args.contexts, CONTEXTS), quick=args.quick,
                    page_sizes=subset(args.page_sizes, PAGE_SIZES))
    device = jax.devices()[0]
    report = dict(device=device.device_kind, date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  versions=attention._versions(), git_revision=attention.git_revision(),
                  shape=dict(q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype="bfloat16"),
                  timing="CUPTI kernel time per call (all kernels), median", rows=[])
    sm_count = host.sm_count(DEFAULT_SM_COUNT)
    option_variants = tuple(args.option_variants.split(",")) if args.option_variants else ()
    variants = ({},) + tuple(OPTION_VARIANTS[name] for name in option_variants)
    if args.compile_workers > 0:
        report["precompile"] = precompile(row_list, args.compile_workers, sm_count, variants)
    flush = l2_flush() if args.cold_l2 else None
    report["cold_l2"] = bool(args.cold_l2)
    report["copy_tbps"], report["copy_kernels_tbps"] = copy_bandwidth(args.iterations)
    print(f"device-to-device copy: {report['copy_tbps']:.2f} TB/s", flush=True)
    key = jax.random.key(0)
    for row in row_list:
        record = measure(row, key, args.iterations, sm_count, option_variants, flush)
        record["copy_tbps"] = report["copy_tbps"]
        if "fa4_jax_tbps" in record:
            record["fraction_of_copy"] = record["fa4_jax_tbps"] / report["copy_tbps"]
        report["rows"].append(record)
        print(_format(record), flush=True)
        if args.out:
            with open(args.out, "w") as handle:
                json.dump(report, handle, indent=1)
    return report


def merge(paths, out):
    """One report from several runs of this script (same device and revision expected)."""
    reports = []
    for path in paths:
        with open(path) as handle:
            reports.append(json.load(handle))
    merged = dict(reports[0], rows=[row for report in reports for row in report["rows"]],
                  copy_tbps=max(report["copy_tbps"] for report in reports),
                  runs=[{key: report.get(key) for key in ("date", "git_revision", "copy_tbps", "copy_kernels_tbps",
                                                          "precompile")}
                        for report in reports])
    with open(out, "w") as handle:
        json.dump(merged, handle, indent=1)
    return merged


def plot(json_path, png_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(json_path) as handle:
        report = json.load(handle)
    figure, axes = plt.subplots(len(Q_LENS), len(PAGE_SIZES), figsize=(11, 7), squeeze=False)
    for axis, (q_len, page) in zip(axes.flat, [(q, p) for q in Q_LENS for p in PAGE_SIZES]):
        for batch in BATCHES:
            subset = sorted((r for r in report["rows"] if "fa4_jax_tbps" in r
                             and (r["q_len"], r["page_size"], r["batch"]) == (q_len, page, batch)),
                            key=lambda r: r["context"])
            if subset:
                axis.plot([r["context"] for r in subset], [r["fa4_jax_tbps"] for r in subset], marker="o",
                          label=f"fa4_jax B={batch}")
                pallas = [(r["context"], r["kv_bytes"] / (r["pallas_best_ms"] * 1e-3) / 1e12)
                          for r in subset if r.get("pallas_best_ms")]
                if pallas:
                    axis.plot(*zip(*pallas), linestyle="--", marker="x", label=f"Pallas best B={batch}")
        axis.axhline(report["copy_tbps"], color="gray", linewidth=0.8, label="d2d copy")
        axis.axhline(0.75 * report["copy_tbps"], color="gray", linestyle=":", linewidth=0.8, label="75 % bar")
        axis.set_xscale("log", base=2)
        axis.set_title(f"Sq={q_len}, page {page}")
        axis.set_xlabel("context")
        axis.set_ylabel("K/V TB/s")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    figure.suptitle(f"decode {report['device']}  {report['date'][:10]}  rev {report['git_revision'][:10]}")
    figure.tight_layout()
    attention.save_png(figure, png_path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out")
    parser.add_argument("--batches", help="comma-separated subset of 1,8,64")
    parser.add_argument("--contexts", help="comma-separated subset of 1024,8192,32768,131072")
    parser.add_argument("--page-sizes", help="comma-separated subset of 16,64")
    parser.add_argument("--quick", action="store_true", help="B in {1, 64}, contexts 8k and 32k")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--option-variants", help="comma-separated DecodeOptions candidates to time through "
                        f"decode.run ({', '.join(OPTION_VARIANTS)}: fa4_jax_<name>_ms) and, beside them, the "
                        "default options through it (fa4_jax_run_ms)")
    parser.add_argument("--cold-l2", action="store_true",
                        help="also time ours and Pallas with the L2 emptied before each call (fa4_jax_cold_ms, "
                             "fa4_jax_cold_tbps, <pallas>_cold_ms, pallas_best_cold_ms): repeated calls otherwise "
                             "find up to ~40 MB of K / V still in the L2, which a step after other layers does not")
    parser.add_argument("--compile-workers", type=int, default=12)
    parser.add_argument("--plot", help="a report to plot (no GPU needed)")
    parser.add_argument("--png")
    parser.add_argument("--merge", nargs="+", help="reports to join into --out")
    args = parser.parse_args(argv)
    if args.merge:
        merge(args.merge, args.out)
        return
    if args.plot:
        plot(args.plot, args.png or args.plot.replace(".json", ".png"))
        return
    run(args)


if __name__ == "__main__":
    main()
