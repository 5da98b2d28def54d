"""Issue 12's benchmark: fa4_jax against cuDNN and FlashAttention-4's own kernels on Hopper, one process.

Three libraries run on the same bf16 inputs, one row after another:
- fa4_jax: `fa4_jax.attention(..., implementation="cute")`;
- cudnn: `jax.nn.dot_product_attention(..., implementation="cudnn")`;
- fa4peer: FA4's kernels for JAX (the fa4-jax 0.1.0 package, renamed by ../shared/device/pack_peer.sh),
  `fa4peer.flash_attn(q, k, v, causal=..., return_lse=True)`. Its forward is timed with the LSE
  written, as fa4_jax's forward always writes it; the backward then reuses that forward kernel
  instead of compiling a second one. Imported only here, and only when importable: otherwise (or
  with --no-peer) its columns are null with `fa4peer_error` "fa4peer not importable: ...".
All three take [batch, seq, heads, head_dim] with fewer key/value heads for GQA/MQA, and align causal
masks alike when q_len == kv_len, as in every row here.

A forward row times the jitted call on (q, k, v). A backward row takes the VJP first (a jitted
`jax.vjp`: the forward and its residuals run outside the timing) and times the jitted pullback applied
to a fixed d_out, so only the backward's kernels run in it. Times are CUPTI kernel times of everything the timed
function launches (jax.experimental.mosaic.gpu.profiler.measure), median over --iterations, taken
--rounds times a row with the libraries in turn and the median round reported (`measure_row` says why); TFLOP/s
counts forward 4*B*Hq*S*S*D (2*B*Hq*S*S*(D+Dv) when Dv differs), halved when causal, and 2.5x that for
the backward. A library that fails
on a row gets null `<lib>_ms` / `<lib>_tflops` and `<lib>_error`, and the run goes on. Each row also
records the max |difference| of fa4_jax's and fa4peer's outputs (forward: out; backward: dq, dk, dv)
from cuDNN's (from fa4peer's when cuDNN failed), so a wrong kernel shows, and `ratio_vs_best_peer`,
fa4_jax's TFLOP/s over the faster peer's (the issue's bar: >= 1.00 on every row).

Rows (`row_grid()`), each shape forward then backward, B*S = 16k tokens:
- the issue-3 grid: Hq = Hkv = 2048 / D, S in {1k, 2k, 4k, 8k, 16k}, D in {64, 128, 256}, causal or not;
- GQA 4, GQA 8 and MQA: 16 query heads over 4, 2 or 1 key/value heads, D 128, S in {2k, 8k}, causal;
- D 192: 16 heads, S in {2k, 8k}, causal or not.
40 shapes, 80 rows. --rows REGEX keeps the rows whose name matches (names read
"backward D128 S8192 B2 H16/4 causal"; "full" when not causal), --quick those with S <= 2k.
`--grid head-dims` instead: head dims fa4_jax has no kernel for and zero-pads
(fa4_jax/lowering/head_padding.py), each beside the kernel dims it pads to: D 80 (-> 96) and DeepSeek
MLA's D 192 / Dv 128 (the backward -> 192 / 192; the sm90 forward unpadded once its gate opens,
EXTRA_HEAD_DIM_PAIRS), with the 96 and 192 rows; 16 heads, S in {2k, 8k}, causal or not,
16 shapes, 32 rows (names read "forward D192/128 S2048 B8 H16/16 causal"). FLOPs count the call's own
head dims, 2*B*Hq*S*S*(D+Dv), so the padding's extra work shows as lower TFLOP/s.

Compiling: fa4_jax's kernels are compiled for every shape into the on-disk kernel cache
(fa4_jax.kernels.compile_cache) by --precompile-workers CPU-only processes, shape by shape in row order,
while the timing process compiles and times cuDNN and fa4peer (which has no disk cache: it compiles in
the timing process, once per heads / head dim / causal / GQA group, 11 configurations); fa4_jax is
timed last in each row, after its shape's kernels are in the cache. --precompile-only fills the cache
without a GPU. CUTE_DSL_ARCH defaults to sm_90a in every process (the cache key includes it).

Run time, estimated (not yet measured) for the 80 rows on one H200 with --precompile-workers 12:
~15 s to start; precompiling ~40 x 11 s of CPU (all 40 shapes took 223 s in 2 processes on a 2-core
development machine) on 12 processes, ~40 s, overlapped with the timing; per shape 9 XLA compiles
(each library's forward, forward with residuals and pullback), ~3-6 s, and < 1 s of timing (the
longest call, backward at 16k, takes ~10 ms; 21 calls a library); fa4peer's kernels ~10-20 s per
configuration, ~3 minutes: 5-8 minutes in all. Each row's `wall_seconds` says where it went.
--max-seconds starts no new shape after that many seconds, so a slow run still ends with its JSON,
its table and its rows (the JSON is rewritten after every row, so even a killed run keeps them).

Usage:
    python benchmarks/hopper_vs_peers.py --out results.json [--precompile-workers 12] [--rows REGEX]
        [--quick] [--iterations 20] [--rounds 5] [--no-peer] [--max-seconds 450] [--grid issue12|head-dims]
    JAX_PLATFORMS=cpu python benchmarks/hopper_vs_peers.py --precompile-only --precompile-workers 2
    python benchmarks/hopper_vs_peers.py --plot results.json results.png      (no GPU needed)
The device command is benchmarks/device/hopper_vs_peers.sh. The git revision comes from
$FA4_GIT_REVISION when set (the device copy has no .git), else `git rev-parse HEAD`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import json
import multiprocessing
import os
import platform
import re
import statistics
import sys
import time
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import attention  # noqa: E402  (the shared benchmark helpers: the issue-3 grid, FLOPs, CUPTI timing, versions)

PASSES = ("forward", "backward")
LIBRARIES = ("fa4_jax", "cudnn", "fa4peer")
# fa4_jax last: its kernels may still be compiling in the precompile processes when a row starts.
TIMING_ORDER = ("cudnn", "fa4peer", "fa4_jax")
PEERS = ("cudnn", "fa4peer")
LIBRARY_LABELS = {"fa4_jax": "fa4_jax", "cudnn": "cuDNN", "fa4peer": "FA4 (fa4peer)"}

GROUPED_QUERY_HEADS = 16
GROUPED_KV_HEADS = (4, 2, 1)            # GQA 4, GQA 8, MQA
GROUPED_SEQ_LENS = (2048, 8192)
LARGE_HEAD_DIM = 192
LARGE_HEAD_HEADS = 16
LARGE_HEAD_SEQ_LENS = (2048, 8192)
QUICK_MAX_SEQ_LEN = 2048
# --grid head-dims: (D, Dv) that fa4_jax pads, each followed by the kernel dims it pads to.
PADDED_HEAD_DIMS = ((80, None), (96, None), (192, 128), (192, None))
PADDED_HEADS = 16
PADDED_SEQ_LENS = (2048, 8192)

# The GPU the kernels are built for: the timing process checks it has one, the precompile processes
# (which see no GPU) route and compile as if they had.
HOPPER_CAPABILITY = (9, 0)
HOPPER_ARCH = "sm_90a"


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    seq_len: int
    q_heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    v_head_dim: Optional[int] = None   # None: equal to head_dim

    @property
    def value_dim(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    def forward_flops(self) -> float:
        return attention.forward_flops(dict(batch=self.batch, seq_len=self.seq_len, heads=self.q_heads,
                                            head_dim=self.head_dim, v_head_dim=self.value_dim,
                                            causal=self.causal))


@dataclasses.dataclass(frozen=True)
class Row:
    pass_name: str   # "forward" or "backward"
    shape: Shape

    @property
    def name(self) -> str:
        shape = self.shape
        head_dims = f"{shape.head_dim}" + (f"/{shape.value_dim}" if shape.value_dim != shape.head_dim else "")
        return (f"{self.pass_name} D{head_dims} S{shape.seq_len} B{shape.batch} "
                f"H{shape.q_heads}/{shape.kv_heads} {'causal' if shape.causal else 'full'}")

    @property
    def flops(self) -> float:
        return self.shape.forward_flops() * (2.5 if self.pass_name == "backward" else 1.0)

    def record(self) -> dict:
        """The row's JSON object before timing: what it is, and every measured field still null."""
        record = {"name": self.name, "pass": self.pass_name, **dataclasses.asdict(self.shape)}
        for library in LIBRARIES:
            record[f"{library}_tflops"] = None
            record[f"{library}_ms"] = None
        labels = _output_labels(self.pass_name)
        for library in ("fa4_jax", "fa4peer"):
            for label in labels:
                record[f"{library}_max_abs_diff_{label}"] = None
        record.update(max_abs_diff_reference=None, best_peer=None, ratio_vs_best_peer=None, wall_seconds={})
        return record


def _output_labels(pass_name):
    return ("out",) if pass_name == "forward" else ("dq", "dk", "dv")


def shape_grid() -> list:
    """The issue's shapes, in the order they are timed."""
    grid = [Shape(s["batch"], s["seq_len"], s["heads"], s["heads"], s["head_dim"], s["causal"])
            for s in attention.shapes()]
    grid += [Shape(attention.TOKENS // length, length, GROUPED_QUERY_HEADS, kv_heads, 128, True)
             for kv_heads in GROUPED_KV_HEADS for length in GROUPED_SEQ_LENS]
    grid += [Shape(attention.TOKENS // length, length, LARGE_HEAD_HEADS, LARGE_HEAD_HEADS, LARGE_HEAD_DIM, causal)
             for causal in (False, True) for length in LARGE_HEAD_SEQ_LENS]
    return grid


def head_dim_grid() -> list:
    """--grid head-dims: the padded head dims and the kernel dims they pad to, in the order timed."""
    return [Shape(attention.TOKENS // length, length, PADDED_HEADS, PADDED_HEADS, head_dim, causal, v_head_dim)
            for head_dim, v_head_dim in PADDED_HEAD_DIMS for causal in (False, True) for length in PADDED_SEQ_LENS]


GRIDS = {"issue12": shape_grid, "head-dims": head_dim_grid}


def row_grid(grid: str = "issue12") -> list:
    return [Row(pass_name, shape) for shape in GRIDS[grid]() for pass_name in PASSES]


def select_rows(rows, pattern=None, quick=False) -> list:
    selected = [row for row in rows if not quick or row.shape.seq_len <= QUICK_MAX_SEQ_LEN]
    return [row for row in selected if pattern is None or re.search(pattern, row.name)]


# ---------------------------------------------------------------- the libraries
# Each is a factory: shape -> attention function (q, k, v) -> out, or an exception saying why not.

def fa4_jax_attention(shape):
    import fa4_jax
    return lambda q, k, v: fa4_jax.attention(q, k, v, causal=shape.causal, implementation="cute")


def cudnn_attention(shape):
    return attention.cudnn_attention(shape.head_dim, shape.value_dim, shape.causal)


def fa4peer_factory(enabled: bool):
    """(factory, version or None). The peer is imported here and nowhere else in the project."""
    if not enabled:
        return _unavailable("fa4peer not importable: --no-peer"), None
    try:
        import fa4peer
    except Exception as error:  # not on the path, or one of its dependencies missing
        return _unavailable(f"fa4peer not importable: {short_error(error)}"), None

    def peer_attention(shape):
        return lambda q, k, v: fa4peer.flash_attn(q, k, v, causal=shape.causal, return_lse=True)[0]
    return peer_attention, fa4peer.__version__


class LibraryUnavailable(Exception):
    """A library that cannot run at all in this process; its message is the rows' `<lib>_error`."""


def _unavailable(message):
    def factory(shape):
        raise LibraryUnavailable(message)
    factory.message = message
    return factory


def short_error(error) -> str:
    text = " ".join(str(error).split())
    if isinstance(error, LibraryUnavailable):
        return text
    message = f"{type(error).__name__}: {text}" if text else type(error).__name__
    return message[:300]


# ---------------------------------------------------------------- one row

def timed_function(pass_name, attention_function, inputs):
    """(function, arguments) to time: the jitted forward on (q, k, v), or the jitted pullback of a VJP
    taken beforehand, applied to d_out, so that only the backward's kernels run in it."""
    import jax

    query, key, value, d_out = inputs
    if pass_name == "forward":
        return jax.jit(attention_function), (query, key, value)
    # One jitted forward with its residuals (jax.vjp's pullback is a pytree of them, so jit returns it).
    _, pullback = jax.jit(lambda q, k, v: jax.vjp(attention_function, q, k, v))(query, key, value)
    return jax.jit(lambda pullback, d_out: pullback(d_out)), (pullback, d_out)


def measure_row(row, inputs, libraries, timer, rounds: int = 1) -> dict:
    """Time every library on one row. `libraries`: name -> factory; `timer(function, arguments)` ->
    (outputs, milliseconds). With `rounds` > 1 the libraries take turns, one timing each a round, and
    `<lib>_ms` is the median of a library's rounds (`<lib>_ms_rounds`): under the H200's power cap the
    SM clock dips for ~100 ms at a time (1700 -> 1400-1600 MHz, nvidia-smi at 100 ms), as long as one
    library's whole timing, so timings taken back to back can put one dip on one library alone."""
    record = row.record()
    outputs, timed, rounds_ms = {}, {}, {}
    for round_index in range(rounds):
        # Each library's functions are built in the first round, just before its first timing: fa4_jax's
        # factory waits for its shape's precompile, which the peers' compiles and timings overlap.
        for name in TIMING_ORDER:
            if round_index and name not in timed:
                continue
            started = time.perf_counter()
            try:
                if not round_index:
                    timed[name] = timed_function(row.pass_name, libraries[name](row.shape), inputs)
                result, milliseconds = timer(*timed[name])
            except Exception as error:  # report and go on: one failing library must not hide the others
                # A library failing in a later round is reported failed: no times, no output compared.
                record[f"{name}_error"] = short_error(error)
                for taken in (timed, rounds_ms, outputs):
                    taken.pop(name, None)
                continue
            finally:
                # Compiles included: where a device call's time goes (fa4peer compiles in this process).
                spent = time.perf_counter() - started
                record["wall_seconds"][name] = round(record["wall_seconds"].get(name, 0.0) + spent, 2)
            outputs[name] = (result,) if row.pass_name == "forward" else tuple(result)
            rounds_ms.setdefault(name, []).append(milliseconds)
    for name, times in rounds_ms.items():
        milliseconds = statistics.median(times)
        record[f"{name}_ms"] = milliseconds
        record[f"{name}_tflops"] = row.flops / (milliseconds * 1e-3) / 1e12
        if rounds > 1:
            record[f"{name}_ms_rounds"] = times
    record.update(_differences(row.pass_name, outputs))
    timed_peers = [name for name in PEERS if record[f"{name}_tflops"] is not None]
    if timed_peers:
        best = max(timed_peers, key=lambda name: record[f"{name}_tflops"])
        record["best_peer"] = best
        if record["fa4_jax_tflops"] is not None:
            record["ratio_vs_best_peer"] = record["fa4_jax_tflops"] / record[f"{best}_tflops"]
    return record


def _differences(pass_name, outputs) -> dict:
    """Max |difference| of fa4_jax's and fa4peer's outputs from cuDNN's, or fa4_jax's from fa4peer's
    when cuDNN has none."""
    import jax.numpy as jnp

    reference = next((name for name in PEERS if name in outputs), None)
    if reference is None:
        return {}
    found = {"max_abs_diff_reference": reference}
    for name in ("fa4_jax", "fa4peer"):
        if name == reference or name not in outputs:
            continue
        for label, ours, theirs in zip(_output_labels(pass_name), outputs[name], outputs[reference]):
            difference = jnp.abs(jnp.asarray(ours, jnp.float32) - jnp.asarray(theirs, jnp.float32))
            found[f"{name}_max_abs_diff_{label}"] = float(jnp.max(difference))
    return found


# ---------------------------------------------------------------- precompiling fa4_jax's kernels

def _precompile_shape(shape):
    """Worker: lower fa4_jax's forward and its VJP for CUDA, which compiles their kernels into the
    on-disk cache. Returns (seconds, error or None)."""
    started = time.perf_counter()
    try:
        import jax
        import jax.numpy as jnp
        from fa4_jax.lowering import cuda

        # The CUDA lowering routes by the local GPU, and these processes see none: they stand in for
        # the timing process's Hopper GPU (as tests/test_dispatch.py does).
        cuda.compute_capability = lambda: HOPPER_CAPABILITY
        forward = fa4_jax_attention(shape)
        query, key, value, d_out = (jax.ShapeDtypeStruct(dims, jnp.bfloat16) for dims in _input_dims(shape))
        jax.jit(forward).trace(query, key, value).lower(lowering_platforms=("cuda",))
        backward = jax.jit(lambda q, k, v, d_out: jax.vjp(forward, q, k, v)[1](d_out))
        backward.trace(query, key, value, d_out).lower(lowering_platforms=("cuda",))
    except Exception as error:  # the timing process compiles it itself then, and reports its own error
        return time.perf_counter() - started, short_error(error)
    return time.perf_counter() - started, None


class Precompiler:
    """Compiles fa4_jax's kernels for `shapes`, in that order, in `workers` CPU-only processes;
    `wait(shape)` returns once that shape's are in the on-disk cache (or failed to compile there)."""

    def __init__(self, shapes, workers: int):
        self.summary = dict(workers=workers, shapes=len(shapes) if workers else 0, seconds=None, failures=[])
        self._futures = {}
        self._pool = None
        self._started = time.perf_counter()
        if workers <= 0:
            return
        self._pool = concurrent.futures.ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("spawn"), initializer=attention.cpu_only_worker)
        for shape in shapes:
            self._futures[shape] = self._pool.submit(_precompile_shape, shape)

    def wait(self, shape):
        future = self._futures.pop(shape, None)
        if future is None:
            return
        try:
            _, error = future.result()
        except Exception as failure:  # a worker died: the timing process compiles for itself
            error = short_error(failure)
        if error:
            self.summary["failures"].append(dict(dataclasses.asdict(shape), error=error))
        if not self._futures:
            self.summary["seconds"] = time.perf_counter() - self._started

    def close(self):
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


def fa4_jax_after_precompile(precompiler):
    def factory(shape):
        precompiler.wait(shape)
        return fa4_jax_attention(shape)
    return factory


# ---------------------------------------------------------------- the sweep

def make_inputs(shape):
    """q, k, v and d_out, bf16 standard normal, the same for every library (and every run)."""
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(0), 4)
    return tuple(jax.random.normal(key, dims, jnp.float32).astype(jnp.bfloat16)
                 for key, dims in zip(keys, _input_dims(shape)))


def _input_dims(shape):
    """The dims of q, k, v and d_out."""
    return ((shape.batch, shape.seq_len, shape.q_heads, shape.head_dim),
            (shape.batch, shape.seq_len, shape.kv_heads, shape.head_dim),
            (shape.batch, shape.seq_len, shape.kv_heads, shape.value_dim),
            (shape.batch, shape.seq_len, shape.q_heads, shape.value_dim))


def cupti_timer(iterations: int):
    def timer(function, arguments):
        return attention._median_ms(function, arguments, iterations)
    return timer


def write_report(report, path):
    with open(path, "w") as handle:
        json.dump(report, handle, indent=1)


def sweep(rows, libraries, timer, report, out, inputs_for=make_inputs, max_seconds=0.0, rounds=1):
    """Measure `rows` shape by shape (both passes of a shape share its inputs) into report["rows"],
    rewriting `out` after every row."""
    by_shape = {}
    for row in rows:
        by_shape.setdefault(row.shape, []).append(row)
    started = time.monotonic()
    for shape, shape_rows in by_shape.items():
        if max_seconds and time.monotonic() - started > max_seconds:
            report.setdefault("skipped_rows", []).extend(row.name for row in shape_rows)
            continue
        inputs = inputs_for(shape)
        for row in shape_rows:
            record = measure_row(row, inputs, libraries, timer, rounds)
            report["rows"].append(record)
            write_report(report, out)
            print(format_row(record), flush=True)
        del inputs
    report["sweep_seconds"] = time.monotonic() - started
    write_report(report, out)
    return report


def _versions(peer_version):
    versions = dict(attention._versions(), fa4peer=peer_version)
    try:
        from jax._src.lib import cuda_versions
        versions["cudnn"] = str(cuda_versions.cudnn_get_version())
    except Exception:  # no CUDA plugin: the report says so rather than guessing
        versions["cudnn"] = None
    return versions


def new_report(device, versions) -> dict:
    return dict(
        device=device, date=datetime.datetime.now(datetime.timezone.utc).isoformat(), versions=versions,
        git_revision=attention.git_revision(), host=platform.node(), dtype="bfloat16",
        timing="CUPTI kernel time of every kernel the timed function launches, median of iterations "
               "(jax.experimental.mosaic.gpu.profiler.measure), timed `rounds` times a row with the libraries "
               "taking turns, the median round reported; backward: the VJP's pullback only",
        flops="forward 2*B*Hq*S*S*(D+Dv) (4*B*Hq*S*S*D when Dv = D), halved when causal; backward 2.5x forward",
        ratio="ratio_vs_best_peer = fa4_jax_tflops / max(cudnn_tflops, fa4peer_tflops)",
        rows=[])


def run(args):
    os.environ.setdefault("CUTE_DSL_ARCH", HOPPER_ARCH)   # before anything imports the DSL
    import jax

    rows = select_rows(row_grid(args.grid), args.rows, args.quick)
    shapes = list(dict.fromkeys(row.shape for row in rows))
    if args.precompile_only:
        precompiler = Precompiler(shapes, max(1, args.precompile_workers))
        for shape in shapes:
            precompiler.wait(shape)
        precompiler.close()
        print(f"precompiled {len(shapes)} shapes in {precompiler.summary['seconds']:.0f} s, "
              f"{len(precompiler.summary['failures'])} failures {precompiler.summary['failures']}")
        return None
    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", "")
    if not capability.startswith(f"{HOPPER_CAPABILITY[0]}."):
        raise SystemExit(f"this benchmark compiles for Hopper ({HOPPER_ARCH}); the GPU here is "
                         f"{device.device_kind!r}, compute capability {capability!r}")
    peer, peer_version = fa4peer_factory(not args.no_peer)
    if peer_version is None:
        print(peer.message, flush=True)
    precompiler = Precompiler(shapes, args.precompile_workers)
    libraries = dict(fa4_jax=fa4_jax_after_precompile(precompiler), cudnn=cudnn_attention, fa4peer=peer)
    report = new_report(device.device_kind, _versions(peer_version))
    report.update(iterations=args.iterations, rounds=args.rounds, precompile=precompiler.summary,
                  selection=dict(grid=args.grid, rows=args.rows, quick=args.quick, count=len(rows)))
    write_report(report, args.out)
    print(f"{len(rows)} rows; {args.precompile_workers} precompile processes", flush=True)
    try:
        sweep(rows, libraries, cupti_timer(args.iterations), report, args.out, max_seconds=args.max_seconds,
              rounds=args.rounds)
    finally:
        precompiler.close()
        write_report(report, args.out)
    if report.get("skipped_rows"):
        print(f"--max-seconds {args.max_seconds}: {len(report['skipped_rows'])} rows not measured", flush=True)
    print(summary_table(report["rows"]))
    print(f"wrote {args.out}")
    return report


# ---------------------------------------------------------------- printing and plotting

def _number(value, fmt):
    return fmt.format(value) if value is not None else "-"


def format_row(record) -> str:
    errors = "".join(f"  [{name}: {record[f'{name}_error'][:100]}]" for name in LIBRARIES
                     if f"{name}_error" in record)
    differences = [record.get(f"fa4_jax_max_abs_diff_{label}") for label in _output_labels(record["pass"])]
    worst = max((value for value in differences if value is not None), default=None)
    return (f"{record['name']:38s} fa4_jax {_number(record['fa4_jax_tflops'], '{:6.1f}'):>6s}  "
            f"cudnn {_number(record['cudnn_tflops'], '{:6.1f}'):>6s}  "
            f"fa4peer {_number(record['fa4peer_tflops'], '{:6.1f}'):>6s} TFLOP/s  "
            f"ratio {_number(record['ratio_vs_best_peer'], '{:.3f}'):>5s}  "
            f"maxdiff {_number(worst, '{:.1e}')}{errors}")


def summary_table(records) -> str:
    """One line per row: TFLOP/s of each library and ours over the faster peer; then the bar's count."""
    lines = [f"{'row':38s} {'ours':>7s} {'cuDNN':>7s} {'FA4':>7s} {'ours/max':>8s}"]
    for record in records:
        ratio = record["ratio_vs_best_peer"]
        mark = "" if ratio is None or ratio >= 1.0 else "  below"
        lines.append(f"{record['name']:38s} {_number(record['fa4_jax_tflops'], '{:7.1f}'):>7s} "
                     f"{_number(record['cudnn_tflops'], '{:7.1f}'):>7s} "
                     f"{_number(record['fa4peer_tflops'], '{:7.1f}'):>7s} {_number(ratio, '{:8.3f}'):>8s}{mark}")
    ratios = [record["ratio_vs_best_peer"] for record in records if record["ratio_vs_best_peer"] is not None]
    lines.append(f"bar (ours >= 1.00x the faster peer): {sum(r >= 1.0 for r in ratios)} of {len(ratios)} "
                 f"rows with a ratio ({len(records)} rows)")
    return "\n".join(lines)


def plot(json_path, png_path):
    """TFLOP/s of the three libraries per row, forward and backward side by side, ours / the faster
    peer written next to each row (red below the bar). Needs matplotlib only."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(json_path) as handle:
        report = json.load(handle)
    panels = [(pass_name, [r for r in report["rows"] if r["pass"] == pass_name]) for pass_name in PASSES]
    height = max(len(records) for _, records in panels)
    inches = 1.9 + 0.36 * max(height, 4)
    figure, axes = plt.subplots(1, 2, figsize=(16, inches), squeeze=False)
    colors = {"fa4_jax": "tab:green", "cudnn": "tab:blue", "fa4peer": "tab:orange"}
    bar = 0.26
    for axis, (pass_name, records) in zip(axes.flat, panels):
        axis.set_title(f"{pass_name} (TFLOP/s; backward FLOPs = 2.5x forward)")
        if not records:
            axis.text(0.5, 0.5, "no rows", ha="center", va="center", transform=axis.transAxes)
            continue
        positions = range(len(records))
        for offset, name in enumerate(LIBRARIES):
            values = [record[f"{name}_tflops"] or 0.0 for record in records]
            axis.barh([p + (offset - 1) * bar for p in positions], values, height=bar,
                      color=colors[name], label=LIBRARY_LABELS[name])
        top = max((record[f"{name}_tflops"] or 0.0) for record in records for name in LIBRARIES) or 1.0
        for position, record in zip(positions, records):
            ratio = record["ratio_vs_best_peer"]
            text = f"{ratio:.3f}x" if ratio is not None else "n/a"
            axis.text(top * 1.02, position, text, va="center", fontsize=8,
                      color="black" if ratio is not None and ratio >= 1.0 else "red")
        axis.set_yticks(list(positions))
        axis.set_yticklabels([record["name"].split(" ", 1)[1] for record in records], fontsize=8)
        axis.invert_yaxis()
        axis.set_xlim(0, top * 1.15)
        axis.set_xlabel("TFLOP/s")
        axis.grid(axis="x", alpha=0.3)
    handles, labels = max((axis.get_legend_handles_labels() for axis in axes.flat), key=lambda found: len(found[0]))
    figure.legend(handles, labels, loc="lower center", ncol=3, fontsize=9)
    figure.suptitle(f"fa4_jax vs cuDNN vs FA4, {report['device']}, {report['date'][:10]}, "
                    f"rev {report['git_revision'][:10]} (ratio: fa4_jax / the faster of the other two)")
    figure.tight_layout(rect=(0, 0.4 / inches, 1, 1 - 0.3 / inches))   # room for the legend and the title
    attention.save_png(figure, png_path, dpi=110)
    plt.close(figure)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="hopper_vs_peers.json")
    parser.add_argument("--grid", choices=sorted(GRIDS), default="issue12",
                        help="issue12: issue 12's rows; head-dims: zero-padded head dims (80, 192/128) "
                             "beside the kernel head dims they pad to")
    parser.add_argument("--rows", metavar="REGEX", help="only the rows whose name matches (re.search)")
    parser.add_argument("--quick", action="store_true", help=f"only rows with S <= {QUICK_MAX_SEQ_LEN}")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5,
                        help="the libraries take turns this many times a row; each one's median round is reported")
    parser.add_argument("--no-peer", action="store_true", help="do not import fa4peer (its columns are null)")
    parser.add_argument("--precompile-workers", type=int, default=0,
                        help="compile fa4_jax's kernels in this many CPU-only processes alongside the timing")
    parser.add_argument("--precompile-only", action="store_true",
                        help="only fill the on-disk kernel cache for the selected rows (no GPU needed)")
    parser.add_argument("--max-seconds", type=float, default=0,
                        help="start no new shape after this many seconds (0: no limit)")
    parser.add_argument("--plot", nargs=2, metavar=("RESULT_JSON", "OUT_PNG"),
                        help="draw a result file instead of measuring")
    args = parser.parse_args(argv)
    if args.plot:
        plot(*args.plot)
        return None
    if args.rows:
        try:
            re.compile(args.rows)
        except re.error as error:
            parser.error(f"--rows {args.rows!r} is not a regular expression: {error}")
    return run(args)


if __name__ == "__main__":
    main()
