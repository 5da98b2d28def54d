"""`fa4_jax.attention`: the public function. It checks and normalises the arguments, builds the static
`AttentionConfig`, and calls the differentiable primitive."""

from __future__ import annotations

import math
import numbers
from typing import Optional, Sequence, Union

import jax
import jax.export
import jax.numpy as jnp
import numpy as np

from fa4_jax import context_parallel as _context_parallel
from fa4_jax.config import CONTEXT_PARALLEL_STRATEGIES, IMPLEMENTATIONS, AttentionConfig
from fa4_jax.primitive import attention_differentiable

Array = jax.Array
# Logits are float32 on every path; Python floats, so that comparisons with them never round to float32.
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_FLOAT32_SMALLEST_NORMAL = float(np.finfo(np.float32).smallest_normal)


def static_number(name: str, value, integer: bool = False):
    """`value` as a Python number, or TypeError when it is traced: scale, softcap and window sides
    select the compiled kernel and the mask, so they must be known when the function is traced."""
    if isinstance(value, jax.core.Tracer):
        raise TypeError(f"{name} must be a static Python {'int' if integer else 'number'}, not a traced value "
                        f"({value.aval}): it selects the compiled kernel. Pass a Python number, or mark the "
                        "argument static (jax.jit(..., static_argnums=...) or functools.partial).")
    if isinstance(value, (np.ndarray, jax.Array)) and value.ndim == 0:
        value = value.item()
    kind = numbers.Integral if integer else numbers.Real
    if isinstance(value, bool) or not isinstance(value, kind):
        raise TypeError(f"{name} must be a static Python {'int' if integer else 'number'}; got {value!r}.")
    return value


def _window(window, q_len: int, kv_len: int) -> tuple[Optional[int], Optional[int]]:
    """(left, right), each a non-negative int or None; a side >= q_len + kv_len becomes None.

    That is the same mask. With lengths clipped to the axes, a visible row i (0 <= i < q_valid) sits at
    key position i + off, off = kv_valid - q_valid, so i + off lies in [-q_len, kv_len - 1], and keys j
    in [0, kv_len - 1]: (i + off) - j <= kv_len - 1 and j - (i + off) <= q_len + kv_len - 1, so no side
    that large hides a key. It also keeps huge sides out of int32 arithmetic and out of the compile key.
    """
    if window is None:
        return None, None
    if not isinstance(window, Sequence) or isinstance(window, str) or len(window) != 2:
        raise ValueError(f"window must be a pair (left, right) of non-negative ints or None; got {window!r}. "
                         "Use (left, None) for a left-only sliding window.")
    sides = []
    for side in window:
        if isinstance(side, (jax.core.Tracer, jax.Array, np.ndarray)):
            side = static_number("a window side", side, integer=True)
        if side is not None and (isinstance(side, bool) or not isinstance(side, numbers.Integral) or side < 0):
            raise ValueError(f"window sides must be non-negative ints or None (unbounded); got {window!r}.")
        sides.append(None if side is None or side >= q_len + kv_len else int(side))
    return tuple(sides)


def scale_and_softcap(scale, softcap, head_dim: int) -> tuple[float, Optional[float]]:
    """The checked static scale (default 1/sqrt(head_dim)) and softcap (or None)."""
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    elif isinstance(scale, (jax.core.Tracer, jax.Array, np.ndarray)):
        scale = static_number("scale", scale)
    if isinstance(softcap, (jax.core.Tracer, jax.Array, np.ndarray)):
        softcap = static_number("softcap", softcap)
    # A number that float32 rounds to inf (or a softcap it rounds to 0) would give NaN logits.
    if not isinstance(scale, numbers.Real) or not abs(scale) <= _FLOAT32_MAX:
        raise ValueError(f"scale must be a finite Python number within float32's range (|scale| <= "
                         f"{_FLOAT32_MAX:.4g}); got {scale!r}.")
    if softcap is not None and (not isinstance(softcap, numbers.Real)
                                or not _FLOAT32_SMALLEST_NORMAL <= softcap <= _FLOAT32_MAX):
        raise ValueError(f"softcap must be a positive number within float32's range ({_FLOAT32_SMALLEST_NORMAL:.4g} "
                         f"to {_FLOAT32_MAX:.4g}) or None (no capping); got {softcap!r}.")
    return scale, softcap


def sinks_operand(sinks) -> Array:
    """Sinks as float32, or TypeError for a non-float array."""
    sinks = jnp.asarray(sinks)
    if not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise TypeError(f"sinks must be a float array [q_heads] (float32); got {sinks.dtype}.")
    return sinks.astype(jnp.float32)


def _integer_operand(name: str, value, clip_to: Optional[int] = None) -> Array:
    """`value` as int32; lengths (`clip_to` = the axis) are clipped to [0, axis] before narrowing, so
    that a wide length past int32 still means the whole axis rather than wrapping."""
    value = jnp.asarray(value)
    if not jnp.issubdtype(value.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array (int32); got {value.dtype}. Cast it with "
                        ".astype(jnp.int32).")
    if clip_to is not None:
        value = jnp.clip(value, 0, clip_to)
    return value.astype(jnp.int32)


def _segment_operands(segment_ids, q_len: int, kv_len: int):
    if isinstance(segment_ids, (tuple, list)):
        if len(segment_ids) != 2:
            raise ValueError("segment_ids must be one [batch, seq] array (self-attention) or a pair "
                             f"(q_segment_ids [batch, q_len], kv_segment_ids [batch, kv_len]); got {len(segment_ids)} items.")
        q_ids, kv_ids = segment_ids
    else:
        if q_len != kv_len:
            raise ValueError(f"a single segment_ids array needs q_len == kv_len (got {q_len} and {kv_len}); pass a pair "
                             "(q_segment_ids, kv_segment_ids) for cross-attention.")
        q_ids = kv_ids = segment_ids
    return _integer_operand("q_segment_ids", q_ids), _integer_operand("kv_segment_ids", kv_ids)


def _vary_together(arrays: dict) -> dict:
    """Inside shard_map, cast every operand to vary over the union of the operands' varying mesh axes.

    JAX's own operations do this implicitly. A replicated operand (say the keys, or the sinks) that
    meets a sharded one (the query) is then one value seen by every device: the output varies over
    both, and the cast's transpose sums the gradient of the replicated operand over those axes (without
    it each device returned only its own partial gradient, typed as replicated). Outside shard_map
    nothing varies and this is the identity.
    """
    varying = {name: jax.typeof(x).manual_axis_type.varying for name, x in arrays.items()}
    union = frozenset().union(*varying.values())
    cast = lambda x, missing: jax.lax.pcast(x, tuple(sorted(missing, key=str)), to="varying") if missing else x
    return {name: cast(x, union - varying[name]) for name, x in arrays.items()}


def attention(
    query: Array,
    key: Array,
    value: Array,
    *,
    scale: Optional[float] = None,
    causal: bool = False,
    window: Optional[tuple[Optional[int], Optional[int]]] = None,
    softcap: Optional[float] = None,
    sinks: Optional[Array] = None,
    segment_ids: Union[Array, tuple[Array, Array], None] = None,
    q_seq_lengths: Optional[Array] = None,
    kv_seq_lengths: Optional[Array] = None,
    return_lse: bool = False,
    deterministic: bool = False,
    implementation: Optional[str] = None,
    context_parallel: Optional[str] = None,
    zigzag_shards: Optional[int] = None,
    context_parallel_axis: Union[str, Sequence[str], None] = None,
):
    """Scaled dot-product attention, FlashAttention-style: fused, O(S) memory, differentiable in both
    modes (forward mode's tangent: a fused kernel on Hopper, else a blocked pure-JAX pass; see the README).

    Args:
      query: [batch, q_len, q_heads, head_dim]; key: [batch, kv_len, kv_heads, head_dim];
        value: [batch, kv_len, kv_heads, v_head_dim]. q_heads must be a multiple of kv_heads (GQA/MQA).
        bfloat16 or float16 (float32 on the reference path).
      scale: multiplies the logits; default 1/sqrt(head_dim).
      causal: key j is visible to query row i iff j <= i + off, off = kv_len - q_len (bottom-right
        alignment, as in FlashAttention; `jax.nn.dot_product_attention` aligns top-left instead).
      window: (left, right) sliding window, either side None for unbounded: visible iff
        i + off - left <= j <= i + off + right. Combined with causal, both apply.
      softcap: logits <- softcap * tanh(logits / softcap), after scaling.
      sinks: [q_heads] one learnable logit per head added to the softmax denominator only.
      segment_ids: [batch, seq] int (self-attention) or a pair ([batch, q_len], [batch, kv_len]): a query
        sees only keys with the same id (packed sequences).
      q_seq_lengths, kv_seq_lengths: [batch] int valid prefix lengths (padding at the end), clipped to
        [0, q_len] / [0, kv_len]. With lengths, off = kv_seq_lengths[b] - q_seq_lengths[b] for each batch
        element (after clipping).
      return_lse: also return lse [batch, q_heads, q_len] float32, the natural log of the softmax
        denominator (sink included); gradients flow through it.
      deterministic: make the backward pass bitwise reproducible from run to run.
      implementation: None (fastest available), "cute" (our GPU kernels, or NotImplementedError naming
        what they cannot take) or "reference" (pure JAX, any platform).
      context_parallel: with q/k/v split on sequence, how K/V reach every query shard: "all_gather"
        (gather once, reduce-scatter dK/dV), "ring" (pass K/V around the devices, overlapped with the
        attention), or None (by the cost model in the README). Ignored when the sequence is not split.
      zigzag_shards: n when the sequence axis of every operand is in `zigzag(x, n)` order (balances
        causal work over n sequence shards); positions (causal, window, lengths) are those of the
        original order and the results come back in the zigzag order.
      context_parallel_axis: inside shard_map, the mesh axis (or axes) that splits the sequence of the
        local q/k/v (under jit the sharding says it).

    Returns:
      out [batch, q_len, q_heads, v_head_dim] in query's dtype, or (out, lse) with return_lse. A query
      row with no visible key (including rows past q_seq_lengths) gets out 0 and lse -inf (the sink
      logit when sinks are given).
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}; got {implementation!r}.")
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    if query.ndim != 4 or key.ndim != 4:
        raise ValueError(f"query and key must be rank 4 [batch, seq, heads, head_dim]; got shapes {query.shape} "
                         f"and {key.shape}. Add a batch axis with x[None] if you have [seq, heads, dim] inputs.")
    if any(jax.export.is_symbolic_dim(dim) for x in (query, key, value) for dim in x.shape[1:]):
        raise ValueError(f"only the batch size may be symbolic (jax.export shape polymorphism); got query "
                         f"{query.shape}, key {key.shape}, value {value.shape}. Sequence lengths, head counts "
                         "and head dims select the compiled kernel and the mask, so export one function per "
                         "value of each; pad sequences to a few fixed lengths and pass q_seq_lengths / "
                         "kv_seq_lengths.")
    scale, softcap = scale_and_softcap(scale, softcap, query.shape[-1])
    if context_parallel not in CONTEXT_PARALLEL_STRATEGIES:
        raise ValueError(f"context_parallel must be one of {CONTEXT_PARALLEL_STRATEGIES}; got {context_parallel!r}.")
    if isinstance(context_parallel_axis, str):
        context_parallel_axis = (context_parallel_axis,)
    elif context_parallel_axis is not None:
        context_parallel_axis = tuple(context_parallel_axis)
        if not context_parallel_axis or not all(isinstance(a, str) for a in context_parallel_axis):
            raise ValueError("context_parallel_axis must be a mesh axis name or a sequence of them; got "
                             f"{context_parallel_axis!r}.")
    # Positions, lengths and windows are global; inside shard_map with context_parallel_axis the
    # operands hold 1/shards of the sequence.
    shards = math.prod(jax.lax.axis_size(a) for a in context_parallel_axis) if context_parallel_axis else 1
    q_total, kv_total = query.shape[1] * shards, key.shape[1] * shards
    window_left, window_right = _window(window, q_total, kv_total)
    if zigzag_shards is not None:
        # Shards of the zigzag order are checked against the mesh where it is known (the partition
        # rule); the chunks must be whole on every path.
        _context_parallel.check_zigzag(q_total, zigzag_shards, "query sequence")
        _context_parallel.check_zigzag(kv_total, zigzag_shards, "key/value sequence")
        zigzag_shards = int(zigzag_shards)

    optional = {}
    if sinks is not None:
        optional["sinks"] = sinks_operand(sinks)
    if segment_ids is not None:
        optional["q_segment_ids"], optional["kv_segment_ids"] = _segment_operands(
            segment_ids, query.shape[1], key.shape[1])
    # Lengths are clipped to [0, axis] here, once, so that the alignment offset is the same on every
    # path (reference, kernels, shards): a length past the axis means the whole axis, below 0 nothing.
    if q_seq_lengths is not None:
        optional["q_seq_lengths"] = _integer_operand("q_seq_lengths", q_seq_lengths, clip_to=q_total)
    if kv_seq_lengths is not None:
        optional["kv_seq_lengths"] = _integer_operand("kv_seq_lengths", kv_seq_lengths, clip_to=kv_total)

    arrays = _vary_together(dict(optional, query=query, key=key, value=value))
    query, key, value = arrays.pop("query"), arrays.pop("key"), arrays.pop("value")

    config = AttentionConfig(
        scale=float(scale), causal=bool(causal), window_left=window_left, window_right=window_right,
        softcap=None if softcap is None else float(softcap), has_sinks=sinks is not None,
        has_segment_ids=segment_ids is not None, has_q_seq_lengths=q_seq_lengths is not None,
        has_kv_seq_lengths=kv_seq_lengths is not None, deterministic=bool(deterministic),
        implementation=implementation, context_parallel=context_parallel, zigzag_shards=zigzag_shards,
        context_parallel_axis=context_parallel_axis)
    _context_parallel.check_placement(config, query)
    return attention_differentiable(config, bool(return_lse), query, key, value, arrays)
