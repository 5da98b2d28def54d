"""Backward benchmark: the sm90 backward kernels' variants vs cuDNN's backward, one process, same inputs.

One command sweeps every variant over the grid (by default the whole one: D 128, 64, 256 x S 1k-16k x
causal or not, B*S = 16k tokens; `--shapes gqa`: issue 12's GQA 4, GQA 8 and MQA rows at D 128, causal
first, where the head-split variants differ; `--shapes d192`: hopper_vs_peers.py's D 192 rows, 16 heads,
S 2k / 8k, which the grid does not have; `--shapes mla`: the same rows at DeepSeek MLA's D / Dv = 192 / 128,
a shape's `v_head_dim`) and writes one JSON (rewritten after every row, so a run cut short
by a time limit still leaves its rows). Per shape it times, with CUPTI (all kernels of the call,
median of iterations):
- each VARIANT: preprocess + dq/dk/dv kernel + postprocess (`run(options(config, problem, tuning), ...)`
  of its kernel module, fa4_jax/kernels/sm90/backward.py or sm90/backward_large_heads.py) with one
  `Tuning`, deterministic or not, given the forward's out and LSE. `default` and `deterministic` are
  what fa4_jax runs at every head dim (the routing table sends D 192 / 256 to the large-head kernel);
  a candidate runs at its own kernel's head dims only, and a row of another head dim records
  `<variant>_skipped` with the reason;
- cudnn: the VJP of jax.nn.dot_product_attention(implementation="cudnn"), residuals precomputed, so
  only its backward kernels are timed;
- the first variant again, last (`<variant>_repeat_ms`): the spread of its two timings is the noise.
Every variant's dq/dk/dv are compared with cuDNN's (max |difference|), so a wrong variant shows.
TFLOP/s counts backward FLOPs = 2.5x forward (forward = 4*B*H*Sq*Sk*D, halved when causal).
Each row's `fa4_jax_backward` names the kernel module that ran it (sm90_backward, or
sm90_backward_large_heads at D 192 / 256); a shape neither kernel takes gets `"reference fallback:
<why>"` there and only cuDNN is timed: fa4_jax would run the reference there, which is not ours to
time. The report's `variants` gives, per variant, each kernel module it reaches with that module's
`Tuning` fields.

Compiling every variant x 20 shapes one after another would take most of a device call, so
--precompile-workers N first lowers every (shape, variant) kernel for CUDA in N CPU-platform
processes at once into the on-disk kernel cache (fa4_jax.kernels.compile_cache); the timing process
then loads them. CUTE_DSL_ARCH is set to sm_90a in both (the cache key includes it). With
--variants-passing LOG a candidate is timed only if its GPU tests passed in that pytest log (a turn
order that deadlocks or a wrong result is not timed; `variants_passing` says what counts).

Usage: python benchmarks/attention_backward.py --out results.json [--precompile-workers 12]
       [--variants default deterministic ...] [--head-dims 128 64 256] [--seq-lens 1024 4096] [--quick]
       [--shapes grid|gqa|d192|mla ...]
       [--iterations N] [--precompile-only] [--variants-passing PYTEST_LOG]
The git revision comes from $FA4_GIT_REVISION when set (the device copy has no .git), else `git`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import json
import os
import re
import sys
import time
import types
from typing import Any, Optional

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import attention  # noqa: E402  (the shared benchmark driver: shapes, FLOPs, CUPTI timing)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One way to run the backward: `kernel.run(kernel.options(..., tuning), ...)`, deterministic or not."""
    kernel: types.ModuleType     # fa4_jax.kernels.sm90.backward or .sm90.backward_large_heads
    tuning: Any                  # that module's `Tuning`
    deterministic: bool
    head_dims: tuple             # where it runs; rows of other head dims skip it
    tested_by: Optional[tuple] = None   # (test file, pytest id) of its GPU tests; None: shipped code
    masks: tuple = ("full", "causal")   # the rows' masks (`_mask`) where it runs; rows of others skip it

    def skip_reason(self, shape) -> Optional[str]:
        if shape["head_dim"] not in self.head_dims:
            return f"{_module_name(self.kernel)} variant, head dims {self.head_dims} only"
        if _mask(shape) not in self.masks:
            return f"{_module_name(self.kernel)} variant, {' / '.join(self.masks)} rows only"
        head_splits = getattr(self.tuning, "head_splits", None)
        group = shape["heads"] // _kv_heads(shape)
        if head_splits is not None and group % head_splits:
            return f"head_splits={head_splits} does not divide the group of {group} query heads"
        if self.tuning.rotated_turns != self.kernel.DEFAULT_TUNING.rotated_turns:
            # `options` turns rotated turns off where they cannot run safely, and there a variant that
            # differs from the shipped kernel in that choice alone would time the shipped kernel.
            from fa4_jax.kernels import host
            problem = host.Problem(_dims(shape), _key_dims(shape), _value_dims(shape), "bfloat16")
            reason = self.kernel.rotated_turns_reason(_config(shape, self.deterministic), problem, self.tuning)
            if reason is not None:
                return reason
        return None

    def kernel_at(self, head_dim):
        """(kernel module, its Tuning) that runs at `head_dim`: as in the routing table
        (fa4_jax.lowering.cuda.ROUTES), the large head dims of a small-head variant go to
        sm90.backward_large_heads, which then runs with its own default Tuning."""
        from fa4_jax.kernels.sm90 import backward as sm90_backward
        from fa4_jax.kernels.sm90 import backward_large_heads as sm90_backward_large_heads
        if self.kernel is sm90_backward and head_dim in sm90_backward_large_heads.SUPPORTED_HEAD_DIMS:
            return sm90_backward_large_heads, sm90_backward_large_heads.DEFAULT_TUNING
        return self.kernel, self.tuning

    def kernels(self) -> dict:
        """Kernel module name -> the head dims it runs for this variant and its Tuning fields there."""
        reached = {}
        for head_dim in self.head_dims:
            module, tuning = self.kernel_at(head_dim)
            entry = reached.setdefault(_module_name(module), dict(head_dims=[], **dataclasses.asdict(tuning)))
            entry["head_dims"].append(head_dim)
        return reached


def _mask(shape) -> str:
    """A row's mask: "causal" or "full"."""
    return "causal" if shape["causal"] else "full"


def _module_name(module) -> str:
    """fa4_jax.kernels.sm90.backward -> "sm90_backward" (the name rows and reports carry)."""
    return module.__name__.removeprefix("fa4_jax.kernels.").replace(".", "_")


def _default_and_deterministic(name, kernel, head_dims, tests_file, prefixed_test_id=False, **fields) -> dict:
    """`name` and `deterministic_<name>`: `kernel` with these fields of its `Tuning` set, in both modes, each
    timed only where the GPU tests in `tests_file` whose id contains `name` passed (`<prefix><name>`, with
    `prefixed_test_id`, where the deterministic mode has tests of its own)."""
    tuning = dataclasses.replace(kernel.DEFAULT_TUNING, **fields)
    return {f"{prefix}{name}": Variant(kernel, tuning, deterministic, head_dims,
                                       (tests_file, f"{prefix}{name}" if prefixed_test_id else name))
            for prefix, deterministic in (("", False), ("deterministic_", True))}


def _variants():
    """name -> Variant, timed in this order. A candidate under measurement is added here as one more
    row, with the head dims of the kernel whose `Tuning` it sets and the id of its GPU tests
    (docs/sm90_backward_tuning.md has the past ones)."""
    from fa4_jax.kernels.sm90 import backward as small_heads
    from fa4_jax.kernels.sm90 import backward_large_heads as large_heads

    every_head_dim = small_heads.SUPPORTED_HEAD_DIMS + large_heads.SUPPORTED_HEAD_DIMS
    return {
        "default": Variant(small_heads, small_heads.DEFAULT_TUNING, False, every_head_dim),
        "deterministic": Variant(small_heads, small_heads.DEFAULT_TUNING, True, every_head_dim),
        # dS^T stored before dV is issued (`Tuning.ds_store_first`, a candidate: D = 64, and D = 128 full
        # without determinism; where dV is issued early, 64 query rows, it changes nothing).
        **_default_and_deterministic("ds_store_first", small_heads, small_heads.SUPPORTED_HEAD_DIMS,
                                     "test_sm90_backward.py", ds_store_first=True),
        # The staged LSE and dPsum loaded into registers before the waits for S and dP (`Tuning.row_stats_early`,
        # a candidate; 64 query rows: D 96, D 128 causal and deterministic).
        **_default_and_deterministic("row_stats_early", small_heads, small_heads.SUPPORTED_HEAD_DIMS,
                                     "test_sm90_backward.py", row_stats_early=True),
        # The staged dQ handed to the writer warp (fence, commit) after the dK wait, not right after its
        # stores (`Tuning.dq_publish_after_dk`, a candidate in both kernels wherever dQ is staged under dK).
        **_default_and_deterministic("dq_publish_after_dk", small_heads, small_heads.SUPPORTED_HEAD_DIMS,
                                     "test_sm90_backward.py", dq_publish_after_dk=True),
        **_default_and_deterministic("large_dq_publish_after_dk", large_heads, large_heads.SUPPORTED_HEAD_DIMS,
                                     "test_sm90_backward_large_heads.py", prefixed_test_id=True,
                                     dq_publish_after_dk=True),
        # Every 4th (D 96 / 128; at D = 64's 128 rows it spills) or 6th exp2 of P on the FMA pipe.
        **{f"poly_exp2_{every}": Variant(
            small_heads, dataclasses.replace(small_heads.DEFAULT_TUNING, poly_exp2_every=every), False, head_dims,
            ("test_sm90_backward.py", f"poly_exp2_{every}"))
           for every, head_dims in ((4, (96, 128)), (6, small_heads.SUPPORTED_HEAD_DIMS))},
        "no_stagger": Variant(large_heads, large_heads.Tuning(stagger=False), False,
                              large_heads.SUPPORTED_HEAD_DIMS,
                              ("test_sm90_backward_large_heads.py", "no_stagger")),
        # The deterministic dQ turns lowest key block first (the default takes them highest first).
        "deterministic_lowest_first": Variant(
            large_heads, large_heads.Tuning(diagonal_first=False), True, large_heads.SUPPORTED_HEAD_DIMS,
            ("test_sm90_backward_large_heads.py", "lowest_first")),
        # Deterministic full masks in the plain walk, the dQ turns diagonal first (the shipped kernel takes
        # them in the staggered walk's arrival order, `Tuning.rotated_turns`, where a head's key blocks fit on
        # half the SMs; rows where it resolves off, causal or past 4k at D = 256 and 6k at D = 192, skip this).
        "deterministic_large_plain_turns": Variant(
            large_heads, large_heads.Tuning(rotated_turns=False), True, large_heads.SUPPORTED_HEAD_DIMS,
            ("test_sm90_backward_large_heads.py", "plain_turns"), masks=("full",)),
        # Head splits forced (`default` lets head_splits_for choose): 1 is the kernel before head
        # splits, deterministic too; a split that does not divide a row's group skips the row.
        **{f"head_splits_{splits}": Variant(
            small_heads, dataclasses.replace(small_heads.DEFAULT_TUNING, head_splits=splits), False,
            small_heads.SUPPORTED_HEAD_DIMS, None if splits == 1 else ("test_sm90_backward.py", f"split{splits}"))
           for splits in HEAD_SPLITS},
        # dQ staged as a swizzled tile with TMA tensor reduces (the default: in the accumulator's
        # register order, one 1-D bulk reduce), default and deterministic.
        **_default_and_deterministic("tiled_dq", small_heads, small_heads.SUPPORTED_HEAD_DIMS,
                                     "test_sm90_backward.py", flat_dq=False),
        # dS^T staged with plain 32-bit stores (the default: stmatrix, docs/sm90_backward_tuning.md,
        # "SASS budget"), default and deterministic.
        **_default_and_deterministic("ds_plain_store", small_heads, small_heads.SUPPORTED_HEAD_DIMS,
                                     "test_sm90_backward.py", ds_stmatrix=False),
        # Deterministic full-mask walks from the first query block, the dQ turns highest key block first
        # (the shipped kernel rotates them, `Tuning.rotated_turns`, where a head's key blocks fit on half the
        # SMs: up to 8k at D <= 128; rows past that skip this variant).
        "deterministic_plain_turns": Variant(
            small_heads, dataclasses.replace(small_heads.DEFAULT_TUNING, rotated_turns=False), True,
            small_heads.SUPPORTED_HEAD_DIMS, ("test_sm90_backward.py", "plain_turns"), masks=("full",)),
        # Deterministic with one dQ writer warp (the shipped kernel has one per staging buffer,
        # `Tuning.dq_writers`: one runs each block's turn + completion + release serially).
        "deterministic_one_dq_writer": Variant(
            small_heads, dataclasses.replace(small_heads.DEFAULT_TUNING, dq_writers=1), True,
            small_heads.SUPPORTED_HEAD_DIMS, ("test_sm90_backward.py", "two_dq_writers")),
        # 80 query rows per block at D = 128 forced (`Tuning.query_rows=80`: dQ^T, one dQ staging buffer; the
        # default takes them without a mask, 64 causal); not deterministic, which it refuses.
        "query_rows_80": Variant(
            small_heads, dataclasses.replace(small_heads.DEFAULT_TUNING, query_rows=80), False, (128,),
            ("test_sm90_backward.py", "query_rows_80")),
        # 64 query rows per block forced at D = 64 (the default takes 128 there) and D = 128 (80 without a
        # mask), default and deterministic.
        **_default_and_deterministic("query_rows_64", small_heads, (64, 128), "test_sm90_backward.py",
                                     query_rows=64),
        # dQ split between the warp groups by head-dim columns at D = 64's 128 rows (m64n32 wgmmas where
        # the default's row split issues m64n64), default and deterministic.
        **_default_and_deterministic("dq_column_split", small_heads, (64,), "test_sm90_backward.py",
                                     dq_row_split=False),
        # D = 192 in the two-warp-group layout it ran before three warp groups became its default
        # (docs/sm90_backward_tuning.md, "D = 192: three consumer warp groups"), for comparison.
        **_default_and_deterministic("two_warpgroups", large_heads, (large_heads.THREE_WARPGROUPS_HEAD_DIM,),
                                     "test_sm90_backward_large_heads.py", prefixed_test_id=True,
                                     three_warpgroups=False),
        # Two Q stages and one P / dS buffer (`Tuning.prefetch_query`) asked for: D = Dv = 192's default,
        # at MLA's 192 / 128 (`--shapes mla`) a candidate; and D = 192 with one Q stage and two P / dS
        # buffers, the three-group layout before it became the default there (docs/sm90_backward_tuning.md,
        # "D = 192: a second Q stage"), for comparison.
        **_default_and_deterministic("prefetch_query", large_heads, (large_heads.THREE_WARPGROUPS_HEAD_DIM,),
                                     "test_sm90_backward_large_heads.py", prefixed_test_id=True,
                                     prefetch_query=True),
        **_default_and_deterministic("one_query_stage", large_heads, (large_heads.THREE_WARPGROUPS_HEAD_DIM,),
                                     "test_sm90_backward_large_heads.py", prefixed_test_id=True,
                                     three_warpgroups=True, prefetch_query=False),
        "deterministic_head_splits_1": Variant(
            small_heads, dataclasses.replace(small_heads.DEFAULT_TUNING, head_splits=1), True,
            small_heads.SUPPORTED_HEAD_DIMS),
        # The grid launched key block slowest (deterministic mode ignores it), with head_splits_for's
        # split for that order, and with each split forced.
        **{"key_blocks_outer" + ("" if splits is None else f"_head_splits_{splits}"): Variant(
            small_heads, dataclasses.replace(small_heads.DEFAULT_TUNING, key_blocks_outer=True, head_splits=splits),
            False, small_heads.SUPPORTED_HEAD_DIMS, ("test_sm90_backward.py", "key_blocks_outer"))
           for splits in (None, *HEAD_SPLITS)},
    }


HEAD_SPLITS = (1, 2, 4, 8, 16)

# --shapes gqa: issue 12's rows where one CTA per (key block, KV head, batch) leaves the GPU under-filled
# and, causal, unevenly loaded (B, S, Hq / Hkv at D 128); causal first, so a run cut short has those.
GQA_SHAPES = [dict(batch=batch, seq_len=length, heads=heads, kv_heads=kv_heads, head_dim=128, causal=causal)
              for causal in (True, False)
              for batch, length, heads, kv_heads in ((1, 8192, 32, 8), (2, 4096, 64, 8), (8, 2048, 16, 1))]

# --shapes d192: benchmarks/hopper_vs_peers.py's D = 192 rows (16 heads, B*S = 16k tokens, S 2k and 8k,
# causal first), where the backward trails FA4's own kernel; the grid's head dims are 64, 128, 256.
D192_SHAPES = [dict(batch=attention.TOKENS // length, seq_len=length, heads=16, head_dim=192, causal=causal)
               for causal in (True, False) for length in (2048, 8192)]
# --shapes mla: those rows at D / Dv = 192 / 128 (hopper_vs_peers.py's head-dims grid has them too): V, O,
# dO and dV 128 wide.
MLA_SHAPES = [dict(shape, v_head_dim=128) for shape in D192_SHAPES]
SHAPE_SETS = {"gqa": GQA_SHAPES, "d192": D192_SHAPES, "mla": MLA_SHAPES}


def variants_passing(test_log: str):
    """The variants to time after the GPU tests in `test_log` (pytest -rA or -v, -q or not, with
    xdist or not): the shipped ones, and each candidate with at least one test of its id (in the test's
    name or one of its parameter ids) in its test file passed and none failed or errored, in a run that
    reached its summary line. A run cut short (a hang, a time limit) leaves only the shipped ones."""
    with open(test_log) as handle:
        lines = handle.read().splitlines()
    # pytest's last line, "=== 60 passed, 3 failed in 99.0s ===" (bare under -q).
    finished = any(re.match(r"\W*\d+ (passed|failed)\b.* in [\d.]+s", line) for line in lines)

    def outcomes(test_file, test_id):
        found = set()
        for line in lines:
            test = re.search(rf"\b{re.escape(test_file)}::(\w+)\[([^\]]*)\]", line)
            if test and (test_id in test.group(1) or test_id in test.group(2).split("-")):
                found.update(re.findall(r"\b(PASSED|FAILED|ERROR)\b", line))
        return found

    return [name for name, variant in _variants().items()
            if variant.tested_by is None or (finished and outcomes(*variant.tested_by) == {"PASSED"})]


def backward_flops(shape) -> float:
    return 2.5 * attention.forward_flops(shape)


def _config(shape, deterministic=False):
    from fa4_jax.config import AttentionConfig
    return AttentionConfig(scale=shape["head_dim"] ** -0.5, causal=shape["causal"],
                           deterministic=deterministic)


def _backward(shape, variant):
    import jax
    from fa4_jax.kernels import host
    config = _config(shape, variant.deterministic)
    module, tuning = variant.kernel_at(shape["head_dim"])

    def backward(q, k, v, o, l, g):
        options = module.options(config, host.Problem.of(q, k, v), tuning)
        return module.run(options, q, k, v, o, l, g, None, {})[:3]
    return jax.jit(backward)


def _forward(config):
    import jax
    from fa4_jax.kernels import host
    from fa4_jax.kernels.sm90 import forward as sm90_forward

    def forward(q, k, v):
        return sm90_forward.run(sm90_forward.options(config, host.Problem.of(q, k, v)), q, k, v, {})
    return jax.jit(forward)


def _forward_residuals(query, key, value, config):
    """(out, lse, source): from the fa4_jax forward kernel, else the reference (its scan compiles for
    several seconds per shape on the H200)."""
    import jax
    from fa4_jax import reference

    try:
        out, lse = _forward(config)(query, key, value)
        return out, lse, "fa4_jax forward"
    except Exception:  # no forward kernel for this shape: the reference gives the same residuals
        out, lse = jax.jit(lambda q, k, v: reference.reference_forward(q, k, v, {}, config))(
            query, key, value)
        return out.astype(query.dtype), lse, "reference forward"


def _kv_heads(shape):
    return shape.get("kv_heads", shape["heads"])


def _dims(shape):
    return shape["batch"], shape["seq_len"], shape["heads"], shape["head_dim"]


def _key_dims(shape):
    return shape["batch"], shape["seq_len"], _kv_heads(shape), shape["head_dim"]


def _v_head_dim(shape):
    return shape.get("v_head_dim") or shape["head_dim"]


def _value_dims(shape):
    return shape["batch"], shape["seq_len"], _kv_heads(shape), _v_head_dim(shape)


def _out_dims(shape):
    return shape["batch"], shape["seq_len"], shape["heads"], _v_head_dim(shape)


def _fallback_reason(shape):
    """Why the sm90 backward kernel for this head dim does not take this shape (fa4_jax then runs the
    reference), or None."""
    from fa4_jax.kernels import host

    module, _ = _variants()["default"].kernel_at(shape["head_dim"])
    problem = host.Problem(_dims(shape), _key_dims(shape), _value_dims(shape), "bfloat16")
    return module.unsupported_reason(_config(shape), problem)


def _lower_for_cuda(job):
    """Worker: lower one backward (or the residuals' forward) kernel for CUDA, filling the disk cache."""
    import jax
    import jax.numpy as jnp

    shape, variant = job
    batch, length, heads, dim = _dims(shape)
    tensor = jax.ShapeDtypeStruct((batch, length, heads, dim), jnp.bfloat16)
    key = jax.ShapeDtypeStruct(_key_dims(shape), jnp.bfloat16)
    value = jax.ShapeDtypeStruct(_value_dims(shape), jnp.bfloat16)
    out = jax.ShapeDtypeStruct(_out_dims(shape), jnp.bfloat16)
    start = time.perf_counter()
    try:
        if variant == "forward":
            _forward(_config(shape)).trace(tensor, key, value).lower(lowering_platforms=("cuda",))
        else:
            lse = jax.ShapeDtypeStruct((batch, heads, length), jnp.float32)
            _backward(shape, _variants()[variant]).trace(
                tensor, key, value, out, lse, out).lower(lowering_platforms=("cuda",))
        return variant, time.perf_counter() - start, None
    except Exception as error:  # the timing process compiles it itself then
        return variant, time.perf_counter() - start, f"{type(error).__name__}: {str(error)[:200]}"


def precompile(shapes, variant_names, workers):
    """Fill the on-disk cache for every (shape, variant that runs there) in `workers` CPU-platform
    processes."""
    variants = _variants()
    jobs = [(shape, name) for shape in shapes if _fallback_reason(shape) is None
            for name in ["forward", *variant_names]
            if name == "forward" or variants[name].skip_reason(shape) is None]
    start = time.perf_counter()
    failures = []
    context = __import__("multiprocessing").get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context,
                                                initializer=attention.cpu_only_worker) as pool:
        for (shape, _), (variant, seconds, error) in zip(jobs, pool.map(_lower_for_cuda, jobs)):
            if error:
                failures.append(dict(variant=variant, **shape, error=error))
    elapsed = time.perf_counter() - start
    print(f"precompiled {len(jobs)} kernels in {elapsed:.0f} s with {workers} workers, "
          f"{len(failures)} failures", flush=True)
    return dict(jobs=len(jobs), seconds=elapsed, failures=failures)


def backward_row(shape, arguments, args):
    """The row of one shape: every variant in args.variants (default: all) and cuDNN."""
    import jax
    import jax.numpy as jnp

    query, key, value = arguments
    config = _config(shape)
    d_out = jax.random.normal(jax.random.key(1), _out_dims(shape), jnp.float32).astype(query.dtype)
    row = dict(section="backward", **shape)
    candidates = {}
    reason = _fallback_reason(shape)
    if reason is not None:
        row["fa4_jax_backward"] = f"reference fallback: {reason}"
    else:
        variants = _variants()
        row["fa4_jax_backward"] = _module_name(variants["default"].kernel_at(shape["head_dim"])[0])
        out, lse, row["residuals"] = _forward_residuals(query, key, value, config)
        for name in args.variants or list(variants):
            skip_reason = variants[name].skip_reason(shape)
            if skip_reason is not None:
                row[f"{name}_skipped"] = skip_reason
                continue
            candidates[name] = (_backward(shape, variants[name]), (query, key, value, out, lse, d_out))
    try:
        _, cudnn_vjp = jax.vjp(lambda q, k, v: jax.nn.dot_product_attention(
            q, k, v, is_causal=shape["causal"], implementation="cudnn"), query, key, value)
        candidates["cudnn"] = (jax.jit(lambda vjp, g: vjp(g)), (cudnn_vjp, d_out))
    except Exception as error:
        row["cudnn_error"] = f"{type(error).__name__}: {str(error)[:300]}"
    outputs = {}
    for name, (function, function_arguments) in candidates.items():
        try:
            grads, milliseconds = attention._median_ms(function, function_arguments, args.iterations)
        except Exception as error:  # one failing variant must not hide the others
            row[f"{name}_error"] = f"{type(error).__name__}: {str(error)[:300]}"
            continue
        outputs[name] = grads
        row[f"{name}_ms"] = milliseconds
        row[f"{name}_tflops"] = backward_flops(shape) / (milliseconds * 1e-3) / 1e12
        if getattr(args, "per_kernel", False):
            row[f"{name}_kernels_us"], _ = attention.per_kernel_us(function, function_arguments, args.iterations)
    # The first variant timed again last: the spread between its two timings is the row's noise.
    first = next((name for name in candidates if name != "cudnn" and name in outputs), None)
    if first is not None:
        function, function_arguments = candidates[first]
        _, row[f"{first}_repeat_ms"] = attention._median_ms(function, function_arguments, args.iterations)
    for name in outputs:
        if name == "cudnn" or "cudnn" not in outputs:
            continue
        row[f"{name}_vs_cudnn"] = row["cudnn_ms"] / row[f"{name}_ms"]
        for label, ours, theirs in zip(("dq", "dk", "dv"), outputs[name], outputs["cudnn"]):
            difference = jnp.abs(ours.astype(jnp.float32) - theirs.astype(jnp.float32))
            row[f"{name}_max_abs_diff_{label}"] = float(jnp.max(difference))
    return row


def _summary(row, names):
    cells = []
    for name in names:
        ratio = row.get(f"{name}_vs_cudnn")
        cells.append(f"{ratio:5.2f}" if ratio is not None else "  -  ")
    fallback = " (reference fallback, not timed)" if row["fa4_jax_backward"].startswith("reference") else ""
    dims = f"{row['head_dim']:3d}" + (f"/{row['v_head_dim']}" if row.get("v_head_dim") else "")
    return (f"D={dims} causal={int(row['causal'])} B={row['batch']:2d} S={row['seq_len']:5d} "
            f"H={row['heads']}/{_kv_heads(row)} "
            f"cudnn {row.get('cudnn_ms', float('nan')):7.3f} ms | " + " ".join(cells) + fallback)


def run(args):
    import jax

    # In the order of --head-dims, so a run cut short has measured the first ones whole.
    grid = [shape for name in args.shapes
            for shape in (SHAPE_SETS[name] if name in SHAPE_SETS else attention.shapes(args.quick))]
    shapes = [shape for head_dim in args.head_dims for shape in grid
              if shape["head_dim"] == head_dim and shape["seq_len"] in args.seq_lens]
    names = args.variants or list(_variants())
    if args.precompile_only:
        return precompile(shapes, names, args.precompile_workers or os.cpu_count())
    report = dict(device=jax.devices()[0].device_kind,
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  versions=attention._versions(), git_revision=attention.git_revision(),
                  timing="CUPTI kernel time, median of iterations (jax.experimental.mosaic.gpu.profiler.measure)",
                  flops="backward = 2.5 x forward 4*B*H*Sq*Sk*D, halved when causal", dtype="bfloat16",
                  variants={name: dict(deterministic=variant.deterministic, masks=list(variant.masks),
                                       kernels=variant.kernels())
                            for name, variant in _variants().items() if name in names},
                  ratio="<variant>_vs_cudnn = cudnn_ms / <variant>_ms (above 1: faster than cuDNN)",
                  rows=[])
    if args.precompile_workers:
        report["precompile"] = precompile(shapes, names, args.precompile_workers)

    def write():
        with open(args.out, "w") as handle:
            json.dump(report, handle, indent=1)

    write()
    print("ratio vs cuDNN: " + " ".join(names), flush=True)
    key = jax.random.key(0)
    for shape in shapes:
        key, *subkeys = jax.random.split(key, 4)
        arguments = [jax.random.normal(k, dims, "float32").astype("bfloat16")
                     for k, dims in zip(subkeys, (_dims(shape), _key_dims(shape), _value_dims(shape)))]
        row = backward_row(shape, arguments, args)
        report["rows"].append(row)
        write()
        print(_summary(row, names), flush=True)
        del arguments
    print(f"wrote {args.out}")
    return report


def plot(json_path, png_path):
    """TFLOP/s against sequence length, one panel per (head dim, causal): the shipped variants
    (`default`, `deterministic`) and cuDNN. Needs matplotlib only (no GPU)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(json_path) as handle:
        report = json.load(handle)
    rows = [row for row in report["rows"] if row["section"] == "backward"]
    panels = sorted({(row["head_dim"], row["causal"]) for row in rows})
    head_dims = sorted({head_dim for head_dim, _ in panels})
    figure, axes = plt.subplots(len(head_dims), 2, figsize=(11, 3.2 * len(head_dims)), squeeze=False)
    for head_dim, causal in panels:
        axis = axes[head_dims.index(head_dim), int(causal)]
        subset = sorted((r for r in rows if r["head_dim"] == head_dim and r["causal"] == causal),
                        key=lambda r: r["seq_len"])
        for name, label in (("default", "fa4_jax"), ("deterministic", "fa4_jax deterministic"), ("cudnn", "cudnn")):
            points = [(r["seq_len"], r[f"{name}_tflops"]) for r in subset if f"{name}_tflops" in r]
            if points:
                axis.plot(*zip(*points), marker="o", label=label)
        axis.set_xscale("log", base=2)
        axis.set_title(f"backward D={head_dim} {'causal' if causal else 'non-causal'}")
        axis.set_xlabel("sequence length (B*S = 16k)")
        axis.set_ylabel("TFLOP/s")
        axis.grid(alpha=0.3)
        axis.legend()
    figure.suptitle(f"{report['device']}  {report['date'][:10]}  rev {report['git_revision'][:10]}")
    figure.tight_layout()
    attention.save_png(figure, png_path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="attention_backward.json")
    parser.add_argument("--plot", metavar="JSON", help="draw this report (no GPU needed) instead of measuring")
    parser.add_argument("--png", default="attention_backward.png")
    parser.add_argument("--variants", nargs="+", help="names from the variant table (default: all)")
    parser.add_argument("--head-dims", nargs="+", type=int, default=[128, 64, 256],
                        help="in this order (a run cut short has measured the first ones whole)")
    parser.add_argument("--seq-lens", nargs="+", type=int, default=list(attention.SEQUENCE_LENGTHS))
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--per-kernel", action="store_true",
                        help="also record each variant's per-kernel CUPTI times (<variant>_kernels_us)")
    parser.add_argument("--quick", action="store_true", help="only the two shortest sequence lengths")
    parser.add_argument("--shapes", nargs="+", choices=("grid", *SHAPE_SETS), default=["grid"],
                        help="one or more of grid: B*S = 16k tokens, H*D = 2048; gqa: the GQA / MQA rows "
                             "(GQA_SHAPES); d192: 16 heads at D = 192, S 2k / 8k (D192_SHAPES); mla: those at "
                             "D / Dv = 192 / 128 (MLA_SHAPES)")
    parser.add_argument("--precompile-workers", type=int, default=0,
                        help="lower every kernel in this many CPU processes first (on-disk cache)")
    parser.add_argument("--variants-passing", metavar="PYTEST_LOG",
                        help="time a candidate only if its GPU tests passed in this pytest log")
    parser.add_argument("--precompile-only", action="store_true",
                        help="only fill the on-disk cache (e.g. in the background while tests run)")
    args = parser.parse_args(argv)
    if args.plot:
        plot(args.plot, args.png)
        return
    unknown = set(args.variants or ()) - set(_variants())
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; known: {sorted(_variants())}")
    if args.variants_passing:
        passing = variants_passing(args.variants_passing)
        args.variants = [name for name in args.variants or _variants() if name in passing]
        print(f"variants to time (shipped, or GPU tests passed in {args.variants_passing}): "
              f"{' '.join(args.variants)}")
    run(args)


if __name__ == "__main__":
    main()
