"""The host side every CuTe kernel shares: the `Problem` a call poses, the checks no kernel can pass
whatever its design (dtypes, shapes, scale, grid limits), the element-type map, fake tensors for
compiling without a GPU, the `cutlass_call` launches with their compile keys and disk cache (every kernel
call goes through `call_kernel`), and the backward's JAX side around its kernel (preprocess, sinks
gradient, dQ postprocess).

Importing this module imports no cutlass (the dispatch asks kernels' `unsupported_reason` through it on
machines without the DSL); the functions that need it import it when called.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import warnings
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp

KERNEL_DTYPES = ("bfloat16", "float16")
LOG2_E = math.log2(math.e)
MAX_GRID_Y_Z = 65535   # CUDA's limit on gridDim.y and gridDim.z (gridDim.x allows 2^31 - 1)


@dataclasses.dataclass(frozen=True)
class Problem:
    """The shapes and input type of one attention call: what a kernel decides on besides the
    `AttentionConfig`. Shapes are [B, Sq, Hq, D], [B, Sk, Hkv, D], [B, Sk, Hkv, Dv]; for a paged KV
    cache (`fa4_jax.paged_attention`) key and value are the logical shapes, Sk = pages per sequence ·
    page_size, and `page_size` is set (None: a contiguous cache). For packed variable-length sequences
    (`fa4_jax.attention_varlen`) B = 1 and `sequences` is N, the static length of cu_seqlens less one
    (None: not packed); a kernel's search over the offsets is sized by it."""

    query: tuple
    key: tuple
    value: tuple
    dtype: str
    page_size: Optional[int] = None
    sequences: Optional[int] = None

    @classmethod
    def of(cls, query, key, value, optional: Optional[dict] = None) -> "Problem":
        """From arrays or abstract values (anything with `.shape` and `.dtype`); `optional`: the call's
        optional operands by name (or their abstract values), which give N when cu_seqlens_q is there."""
        offsets = (optional or {}).get("cu_seqlens_q")
        return cls(tuple(query.shape), tuple(key.shape), tuple(value.shape), jnp.dtype(query.dtype).name,
                   sequences=None if offsets is None else offsets.shape[0] - 1)

    batch = property(lambda self: self.query[0])
    q_len = property(lambda self: self.query[1])
    q_heads = property(lambda self: self.query[2])
    head_dim = property(lambda self: self.query[3])
    kv_len = property(lambda self: self.key[1])
    kv_heads = property(lambda self: self.key[2])
    v_head_dim = property(lambda self: self.value[3])

    @property
    def group(self) -> int:
        """Query heads per key/value head."""
        return self.q_heads // self.kv_heads


def ceil_div(a, b):
    return (a + b - 1) // b


def cutlass_dtype(name: str):
    """The DSL element type of a kernel input dtype name ("bfloat16" / "float16")."""
    import cutlass

    return {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[name]


def shape_unsupported_reason(kernel_name: str, problem: Problem, head_dims, extra_pairs=()) -> Optional[str]:
    """What a kernel (forward or backward, with its own head dims) cannot take about dtypes and shapes,
    or None: the one shape check behind every kernel's `unsupported_reason`. The kernel takes D = Dv in
    `head_dims` and the (D, Dv) pairs in `extra_pairs`."""
    if problem.dtype not in KERNEL_DTYPES:
        return f"the {kernel_name} kernel takes bfloat16 or float16 inputs, not {problem.dtype}"
    if (problem.head_dim, problem.v_head_dim) not in extra_pairs:
        if problem.head_dim not in head_dims:
            return f"the {kernel_name} kernel takes head dims {head_dims}, not {problem.head_dim}"
        if problem.v_head_dim != problem.head_dim:
            others = f" (or (head dim, value head dim) in {tuple(extra_pairs)})" if extra_pairs else ""
            return (f"the {kernel_name} kernel needs the value head dim ({problem.v_head_dim}) to equal the "
                    f"query/key head dim ({problem.head_dim}){others}")
    if problem.q_heads % problem.kv_heads != 0:
        return f"query heads ({problem.q_heads}) must be a multiple of key/value heads ({problem.kv_heads})"
    if problem.batch == 0 or problem.q_len == 0 or problem.kv_len == 0:
        return f"the {kernel_name} kernel needs non-empty batch and sequence axes"
    return None


def scale_unsupported_reason(kernel_name: str, config) -> Optional[str]:
    """Why a kernel (forward or backward) cannot take `config.scale`, or None.

    Without a softcap the kernels fold the scale into the exp2 of the raw logits: the online softmax
    keeps the row maximum of the unscaled logits (its rescale test (new - old) * scale_log2 > threshold
    never passes from -inf when scale < 0, so the maximum stays -inf and LSE comes out -inf), and masked
    logits (-inf) times the scale give +inf for scale < 0 and NaN for scale 0. A softcap scales the
    logits before the softmax, whose own scale is then log2 e, so any scale works with one."""
    if config.softcap is None and not config.scale > 0:
        return f"the {kernel_name} kernel needs a positive scale unless a softcap is set (got {config.scale})"
    return None


def grid_unsupported_reason(kernel_name: str, problem: Problem) -> Optional[str]:
    """What a (key blocks, key/value heads, batch) grid cannot take: more than MAX_GRID_Y_Z heads or
    batch elements fail to launch. None when it fits."""
    for axis, what, size in (("y", "key/value heads", problem.kv_heads), ("z", "batch elements", problem.batch)):
        if size > MAX_GRID_Y_Z:
            return (f"the {kernel_name} kernel launches one CTA per (key block, key/value head, batch element), "
                    f"and {size} {what} exceed CUDA's grid limit of {MAX_GRID_Y_Z} (gridDim.{axis})")
    return None


def kernel_unsupported_reason(kernel_name: str, config, problem: Problem, head_dims,
                              takes_packed: bool = False, extra_pairs=()) -> Optional[str]:
    """The checks every kernel's `unsupported_reason` starts with: dtypes and shapes, then the scale;
    `takes_packed`: the kernel schedules packed variable-length sequences (cu_seqlens); `extra_pairs`:
    as in `shape_unsupported_reason`."""
    return (shape_unsupported_reason(kernel_name, problem, head_dims, extra_pairs)
            or scale_unsupported_reason(kernel_name, config)
            or key_offset_unsupported_reason(kernel_name, config)
            or (None if takes_packed else packed_unsupported_reason(kernel_name, config)))


def packed_unsupported_reason(kernel_name: str, config) -> Optional[str]:
    """A kernel without a scheduler over (sequence, block) pairs would read the packed batch as one
    sequence: every row would see every key."""
    if config.has_cu_seqlens:
        return (f"{kernel_name} has no scheduler for packed variable-length sequences (attention_varlen's "
                "cu_seqlens)")
    return None


def q_start_unsupported_reason(kernel_name: str, config) -> Optional[str]:
    """The sm90 kernels take q_start (rows at q_start + i, offset kv_len - q_total, a runtime int32[1]
    operand, so one compiled kernel serves every shard and ring step). They count query lengths in
    local rows, while q_seq_lengths with q_start are global: that combination stays on the reference."""
    if config.has_q_start and config.has_q_seq_lengths:
        return (f"{kernel_name} does not combine a sequence-sharded query (q_start) with q_seq_lengths; "
                "pad with kv_seq_lengths only, or leave the query sequence unsplit")
    return None


def key_offset_unsupported_reason(kernel_name: str, config) -> Optional[str]:
    """The kernels place keys at 0..kv_len-1. A ring step with sequence lengths needs its K/V chunk at a
    global offset (kv_start); without lengths the context-parallel code folds that offset into q_start."""
    if config.has_kv_start:
        return (f"{kernel_name} does not take a key offset (kv_start: a ring-attention step combined with "
                "q_seq_lengths / kv_seq_lengths); use context_parallel='all_gather' with sequence lengths")
    return None


def sm_count(default: int) -> int:
    """Streaming multiprocessors of the local GPU (sizes a persistent grid); `default` without one,
    e.g. when compiling on a CPU."""
    try:
        device = jax.local_devices(backend="gpu")[0]
        return int(getattr(device, "core_count", default))
    except (RuntimeError, IndexError):
        return default


def fake_tensor(dtype, dims):
    """A row-major fake tensor of DSL element type `dtype`, for compiling without a GPU."""
    from cutlass.cute.runtime import make_fake_compact_tensor

    return make_fake_compact_tensor(dtype, dims, stride_order=tuple(range(len(dims)))[::-1], assumed_align=16)


def call_kernel(kernel, arguments, outputs, compile_key, input_output_aliases=None):
    """`kernel(stream, *arguments, *outputs)` through `cutlass_call`, compiled under `compile_key` (its
    disk cache filled first, `compile_cache.prepare`): the one place our kernels meet `cutlass_call`.

    The kernel is traced inside `dsl_warning_filters`, whoever compiles it (`prepare`, or
    `cutlass_call`'s own lowering when the disk cache is off), so the caller's warning filters cannot
    break its compile."""
    from cutlass.jax import cutlass_call

    from fa4_jax.kernels import compile_cache

    def traced(stream, *arrays):
        with dsl_warning_filters():
            return kernel(stream, *arrays)

    compile_cache.prepare(traced, arguments, outputs, compile_key, input_output_aliases)
    return cutlass_call(traced, output_shape_dtype=outputs, input_output_aliases=input_output_aliases,
                        compile_key=compile_key)(*arguments)


@contextlib.contextmanager
def dsl_warning_filters():
    """The DSL's DSLOptimizationWarning (a static loop of 64 or more iterations; ours are unrolled on
    purpose) ignored, or shown once per loop with CUTE_DSL_ENABLE_OPTIMIZATION_WARNINGS=1, but never
    raised: the DSL warns from inside a bare `try/except` that reports any exception there as a
    non-constant loop bound (ARG_NON_CONSTANT), so a caller's warnings-as-errors filter (pytest's
    `filterwarnings = error`, `python -W error`) would fail the compile. The DSL adds its own ignore
    filter once, at start-up, which a later `warnings.simplefilter` overrides; this one is in front for
    the trace, whatever came after."""
    from cutlass.base_dsl.ast_helpers import DSLOptimizationWarning
    from cutlass.cutlass_dsl import CuTeDSL

    shown = CuTeDSL._get_dsl().envar.enable_optimization_warnings
    with warnings.catch_warnings():
        warnings.filterwarnings("default" if shown else "ignore", category=DSLOptimizationWarning)
        yield


class OptionalTensors(NamedTuple):
    """The optional operands of a forward kernel, by name (None when absent), in the order its
    launcher takes them after (query, key, value); also how kernel code passes them between roles."""

    sinks: Any = None
    q_segment_ids: Any = None
    kv_segment_ids: Any = None
    q_seq_lengths: Any = None
    kv_seq_lengths: Any = None
    q_start: Any = None
    cu_seqlens_q: Any = None
    cu_seqlens_k: Any = None


FORWARD_OPTIONAL = OptionalTensors._fields


def launch_forward(kernel, options, query, key, value, optional: dict):
    """Run a forward kernel through `cutlass_call`: (out [B, Sq, Hq, Dv], lse [B, Hq, Sq] float32).

    The kernel's inputs after the stream are (query, key, value, *FORWARD_OPTIONAL), absent ones None.
    `options` (hashable) selects the compiled variant, so (kernel name, options) is the compile key.
    """
    batch, q_len, q_heads, _ = query.shape
    outputs = (jax.ShapeDtypeStruct((batch, q_len, q_heads, value.shape[-1]), query.dtype),
               jax.ShapeDtypeStruct((batch, q_heads, q_len), jnp.float32))
    arguments = (query, key, value) + tuple(optional.get(name) for name in FORWARD_OPTIONAL)
    out, lse = call_kernel(kernel, arguments, outputs, (str(kernel), options))
    return out, lse


def forward_fake_arguments(config, shape, dtype_name: str, num_sequences: Optional[int] = None) -> list:
    """Fake tensors in a forward kernel's argument order (inputs as in `launch_forward`, then out and
    lse), for compiling without a GPU. shape = (B, Sq, Sk, Hq, Hkv, D) or (B, Sq, Sk, Hq, Hkv, D, Dv)
    (Dv: value and output head dim, D when not given); with packed sequences B = 1 and `num_sequences`
    sizes the offsets."""
    import cutlass

    batch, q_len, kv_len, q_heads, kv_heads, head_dim, *rest = shape
    v_head_dim = rest[0] if rest else head_dim
    element = cutlass_dtype(dtype_name)
    i32, f32 = cutlass.Int32, cutlass.Float32
    return [
        fake_tensor(element, (batch, q_len, q_heads, head_dim)),
        fake_tensor(element, (batch, kv_len, kv_heads, head_dim)),
        fake_tensor(element, (batch, kv_len, kv_heads, v_head_dim)),
        fake_tensor(f32, (q_heads,)) if config.has_sinks else None,
        fake_tensor(i32, (batch, q_len)) if config.has_segment_ids else None,
        fake_tensor(i32, (batch, kv_len)) if config.has_segment_ids else None,
        fake_tensor(i32, (batch,)) if config.has_q_seq_lengths else None,
        fake_tensor(i32, (batch,)) if config.has_kv_seq_lengths else None,
        fake_tensor(i32, (1,)) if config.has_q_start else None,
        *(fake_tensor(i32, (num_sequences + 1,)) if config.has_cu_seqlens else None for _ in range(2)),
        fake_tensor(element, (batch, q_len, q_heads, v_head_dim)), fake_tensor(f32, (batch, q_heads, q_len)),
    ]


# The tangent kernel's operands after (query, key, value, out, LSE_log2, t_query, t_key, t_value): the
# sinks and their tangents, then the mask operands, in its launcher's order.
TANGENT_OPTIONAL = ("sinks", "t_sinks", "q_segment_ids", "kv_segment_ids", "q_seq_lengths", "kv_seq_lengths",
                    "q_start")


def launch_tangent(kernel, options, query, key, value, out, lse, t_query, t_key, t_value, t_sinks,
                   optional: dict):
    """Run a tangent kernel through `cutlass_call`: (t_out [B, Sq, Hq, Dv] in the query dtype, t_lse
    [B, Hq, Sq] float32). The kernel reads the LSE in the exp2 domain padded to whole query tiles
    (`padded_lse_log2`); the tangents are cast to the primals' type (the tensor cores take one type).
    (kernel name, options) is the compile key."""
    batch, q_len, q_heads, _ = query.shape
    outputs = (jax.ShapeDtypeStruct((batch, q_len, q_heads, value.shape[-1]), query.dtype),
               jax.ShapeDtypeStruct((batch, q_heads, q_len), jnp.float32))
    extra = dict(optional)
    if t_sinks is not None:
        extra["sinks"] = optional["sinks"].astype(jnp.float32)
        extra["t_sinks"] = t_sinks.astype(jnp.float32)
    arguments = (query, key, value, out.astype(query.dtype), padded_lse_log2(lse, options.tile_m),
                 t_query.astype(query.dtype), t_key.astype(key.dtype), t_value.astype(value.dtype))
    arguments += tuple(extra.get(name) for name in TANGENT_OPTIONAL)
    t_out, t_lse = call_kernel(kernel, arguments, outputs, (str(kernel), options))
    return t_out, t_lse


def tangent_fake_arguments(config, shape, dtype_name: str, tile_m: int) -> list:
    """Fake tensors in a tangent kernel's argument order (inputs as in `launch_tangent`, then t_out and
    t_lse), for compiling without a GPU. shape = (B, Sq, Sk, Hq, Hkv, D)."""
    import cutlass

    batch, q_len, kv_len, q_heads, kv_heads, head_dim = shape
    element = cutlass_dtype(dtype_name)
    f32 = cutlass.Float32
    query_shape, key_shape = (batch, q_len, q_heads, head_dim), (batch, kv_len, kv_heads, head_dim)
    present = {"q_segment_ids": config.has_segment_ids, "kv_segment_ids": config.has_segment_ids,
               "q_seq_lengths": config.has_q_seq_lengths, "kv_seq_lengths": config.has_kv_seq_lengths,
               "q_start": config.has_q_start}
    sinks = [fake_tensor(f32, (q_heads,)) if config.has_sinks else None for _ in range(2)]
    return [
        fake_tensor(element, query_shape), fake_tensor(element, key_shape), fake_tensor(element, key_shape),
        fake_tensor(element, query_shape), fake_tensor(f32, (batch, q_heads, backward_padded_rows(q_len, tile_m))),
        fake_tensor(element, query_shape), fake_tensor(element, key_shape), fake_tensor(element, key_shape),
        *sinks,
        *(_fake_optional(name, batch, q_len, kv_len) if present[name] else None for name in TANGENT_OPTIONAL[2:]),
        fake_tensor(element, query_shape), fake_tensor(f32, (batch, q_heads, q_len)),
    ]


def launch_backward(kernel, options, inputs, key, value, dtype, dkv_accumulators: bool = False):
    """Run a backward kernel through `cutlass_call`: (fp32 dQ accumulator, dK, dV).

    `inputs` ends with the dQ accumulator and the deterministic mode's semaphores (None otherwise);
    the kernel updates both in place (input-output aliases). dK and dV are outputs in `dtype`, or with
    `dkv_accumulators` one zeroed fp32 accumulator [2, *key.shape] (dK, then dV), appended to the inputs
    and updated in place like dQ (the caller casts them). One buffer, not two zeroed arrays of the same
    shape: XLA may merge two identical zero operands into one, and inside a loop its dynamic-slice
    fusion then hands the kernel a single buffer for both (seen on the H200 under `lax.map`: dK and dV
    summed into each other, tests/test_context_parallel_gpu.py). (kernel name, options) is the compile
    key."""
    dq_index = len(inputs) - 2
    if dkv_accumulators:
        if key.shape != value.shape:
            raise ValueError(f"fp32 dK / dV accumulators need key and value of one shape; got {key.shape} "
                             f"and {value.shape}")
        inputs = (*inputs, jnp.zeros((2, *key.shape), jnp.float32))
    # The inputs the kernel updates in place: dQ, the semaphores where present, dK and dV with accumulators.
    updated = [index for index in range(dq_index, len(inputs)) if inputs[index] is not None]
    aliases = {index: output for output, index in enumerate(updated)}
    outputs = [jax.ShapeDtypeStruct(inputs[index].shape, inputs[index].dtype) for index in updated]
    if not dkv_accumulators:
        outputs += [jax.ShapeDtypeStruct(key.shape, dtype), jax.ShapeDtypeStruct(value.shape, dtype)]

    results = call_kernel(kernel, inputs, tuple(outputs), (str(kernel), options), aliases)
    if dkv_accumulators:
        return results[0], results[-1][0], results[-1][1]
    return results[0], results[-2], results[-1]


# --------------------------------------------------------------------------------------------------
# The backward's JAX side, shared by every backward kernel (sm90 and sm100): the preprocess, the
# kernel call, the postprocess. `tile_m` is the kernel's query block, to which the row statistics pad.
# --------------------------------------------------------------------------------------------------

def backward_padded_rows(q_len, tile_m):
    return ceil_div(q_len, tile_m) * tile_m


def backward_preprocess(out, lse, d_out, d_lse, tile_m):
    """dPsum [B, Hq, S_pad] = rowsum(dO * O) - d_lse and the LSE in the exp2 domain [B, Hq, S_pad] (+inf
    where no key is visible, so that P = 0 there), padded to whole query blocks of `tile_m` rows."""
    batch, q_len, heads, _ = out.shape
    pad = backward_padded_rows(q_len, tile_m) - q_len
    dpsum = jnp.einsum("bshd,bshd->bhs", d_out.astype(jnp.float32), out.astype(jnp.float32))
    if d_lse is not None:
        dpsum = dpsum - d_lse.astype(jnp.float32)
    dpsum = jnp.pad(dpsum, [(0, 0), (0, 0), (0, pad)])
    return dpsum, padded_lse_log2(lse, tile_m)


def padded_lse_log2(lse, tile_m):
    """The LSE in the exp2 domain [B, Hq, S_pad], +inf where no key is visible (so that P = 0 there)
    and on the padding rows up to whole query blocks of `tile_m`: what kernels recomputing P read."""
    q_len = lse.shape[-1]
    lse_log2 = jnp.where(jnp.isneginf(lse), jnp.inf, lse * LOG2_E).astype(jnp.float32)
    pad = backward_padded_rows(q_len, tile_m) - q_len
    return jnp.pad(lse_log2, [(0, 0), (0, 0), (0, pad)], constant_values=jnp.inf)


def sinks_gradient(sinks, lse, dpsum_unpadded):
    """dsink_h = -sum_{b,i} exp(sink_h - lse_{b,h,i}) * dPsum_{b,h,i}."""
    p_sink = jnp.exp(sinks[None, :, None] - lse)
    p_sink = jnp.where(jnp.isneginf(lse), 0.0, p_sink)
    return -jnp.sum(p_sink * dpsum_unpadded, axis=(0, 2))


def _fake_optional(name, batch, q_len, kv_len, num_sequences=None):
    import cutlass

    offsets = None if num_sequences is None else (num_sequences + 1,)
    shape = {"q_segment_ids": (batch, q_len), "kv_segment_ids": (batch, kv_len), "q_seq_lengths": (batch,),
             "kv_seq_lengths": (batch,), "q_start": (1,), "cu_seqlens_q": offsets, "cu_seqlens_k": offsets}[name]
    return fake_tensor(cutlass.Int32, shape)


def backward_fake_arguments(config, shape, dtype_name: str, optional_inputs, dq_accumulator_shape, tile_m,
                            fp32_dkv: bool = False, num_sequences: Optional[int] = None) -> list:
    """Fake tensors in a backward launcher's order (after the stream: query, key, value, dO, LSE, dPsum,
    `optional_inputs` by name, the fp32 dQ accumulator of `dq_accumulator_shape(batch, padded rows,
    q_heads, head_dim)`, the semaphores, then dK, dV in the input type, or with `fp32_dkv` the one fp32
    accumulator [2, B, Sk, Hkv, D] and None, as `launch_backward` passes them), for compiling without a
    GPU. shape = (B, Sq, Sk, Hq, Hkv, D) or (B, Sq, Sk, Hq, Hkv, D, Dv) (Dv: value, dO and dV head dim, D
    when not given); with packed sequences B = 1 and `num_sequences` N sizes the
    offsets and the turn counters (`backward_query_tiles`)."""
    import cutlass
    from cutlass import Float32

    batch, q_len, kv_len, q_heads, kv_heads, head_dim, *rest = shape
    v_head_dim = rest[0] if rest else head_dim
    element = cutlass_dtype(dtype_name)
    padded = backward_padded_rows(q_len, tile_m)
    present = {"q_segment_ids": config.has_segment_ids, "kv_segment_ids": config.has_segment_ids,
               "q_seq_lengths": config.has_q_seq_lengths, "kv_seq_lengths": config.has_kv_seq_lengths,
               "q_start": config.has_q_start, "cu_seqlens_q": config.has_cu_seqlens,
               "cu_seqlens_k": config.has_cu_seqlens}
    query_shape, key_shape = (batch, q_len, q_heads, head_dim), (batch, kv_len, kv_heads, head_dim)
    value_shape, d_out_shape = (batch, kv_len, kv_heads, v_head_dim), (batch, q_len, q_heads, v_head_dim)
    fake = fake_tensor
    return [
        fake(element, query_shape), fake(element, key_shape), fake(element, value_shape),
        fake(element, d_out_shape), fake(Float32, (batch, q_heads, padded)), fake(Float32, (batch, q_heads, padded)),
        *(_fake_optional(name, batch, q_len, kv_len, num_sequences) if present[name] else None
          for name in optional_inputs),
        fake(Float32, dq_accumulator_shape(batch, padded, q_heads, head_dim)),
        (fake(cutlass.Int32, (batch, q_heads, backward_query_tiles(q_len, tile_m, num_sequences)))
         if config.deterministic else None),
        *((fake(Float32, (2, *key_shape)), None) if fp32_dkv
          else (fake(element, key_shape), fake(element, value_shape))),
    ]


def backward_query_tiles(q_len, tile_m, num_sequences=None):
    """Query tiles per (batch element, query head), each with a turn counter in deterministic mode: the
    blocks of Sq, or with packed sequences (N = `num_sequences`) the scheduler's query slots, one per
    (sequence, query block) (`tile_scheduler.packed_key_item`)."""
    if num_sequences is None:
        return ceil_div(q_len, tile_m)
    from fa4_jax.kernels.common import tile_scheduler

    return tile_scheduler.packed_slots_per_head(num_sequences, q_len, tile_m)


def run_backward(kernel, options, query, key, value, out, lse, d_out, d_lse, optional: dict, optional_inputs,
                 dq_accumulator_shape, dq_rows, tile_m, num_sequences: Optional[int] = None):
    """(dq, dk, dv, dsinks or None): the preprocess, `kernel` through `launch_backward` (its inputs
    after dPsum are `optional_inputs` by name), then dQ read back from the kernel's fp32 accumulator
    layout by `dq_rows(accumulator, q_len)` as [B, Sq, Hq, D], scaled and cast, and the sinks gradient.
    With `options.head_splits` > 1 the kernel adds dK and dV into zeroed fp32 accumulators, cast here.
    With packed sequences (B = 1, `num_sequences` N) the turn counters are per query slot.
    `options` (the kernel's compile key) has `scale`, `deterministic`, `has_sinks` and `head_splits`."""
    batch, q_len, q_heads, head_dim = query.shape
    d_out = d_out.astype(query.dtype)
    dpsum, lse_log2 = backward_preprocess(out, lse, d_out, d_lse, tile_m)
    padded = dpsum.shape[-1]
    dq_accum = jnp.zeros(dq_accumulator_shape(batch, padded, q_heads, head_dim), jnp.float32)
    semaphores = (jnp.zeros((batch, q_heads, backward_query_tiles(q_len, tile_m, num_sequences)), jnp.int32)
                  if options.deterministic else None)
    inputs = (query, key, value, d_out, lse_log2, dpsum, *(optional.get(name) for name in optional_inputs),
              dq_accum, semaphores)
    dq_accum, d_key, d_value = launch_backward(kernel, options, inputs, key, value, query.dtype,
                                               dkv_accumulators=options.head_splits > 1)
    d_key, d_value = d_key.astype(query.dtype), d_value.astype(query.dtype)   # no-ops unless accumulated
    d_query = (dq_rows(dq_accum, q_len) * options.scale).astype(query.dtype)
    d_sinks = None
    if options.has_sinks:
        d_sinks = sinks_gradient(optional["sinks"], lse, dpsum[..., :q_len])
    return d_query, d_key, d_value, d_sinks
