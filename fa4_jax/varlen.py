"""`fa4_jax.attention_varlen`: packed variable-length batches (the flash-attention varlen convention).

N sequences of different lengths are concatenated along the token axis; `cu_seqlens_q` / `cu_seqlens_k`
(int32 [N+1], 0 first, non-decreasing, the token count last) say where each starts. It runs on the
same primitives as `fa4_jax.attention`, with the packing as one batch element and the offsets as two
runtime operands (`AttentionConfig.has_cu_seqlens`): the mask is "same sequence" plus causal / window
around each sequence's own bottom-right diagonal, so autodiff (both modes), sharding over heads and
the reference come from the existing machinery, and one compiled program serves every packing of
the same token counts.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from fa4_jax.api import _vary_together, _window, scale_and_softcap, sinks_operand
from fa4_jax.config import IMPLEMENTATIONS, AttentionConfig
from fa4_jax.primitive import attention_differentiable

Array = jax.Array


def _offsets(name: str, cu_seqlens, total: int) -> Array:
    """cu_seqlens as int32 [N+1]; its values are checked when they are concrete (under jit they are
    runtime data, which no Python check can see)."""
    # NumPy (or concrete JAX) offsets are read before jnp.asarray, which inside a trace may stage them.
    concrete = None if isinstance(cu_seqlens, jax.core.Tracer) else np.asarray(cu_seqlens)
    cu_seqlens = jnp.asarray(cu_seqlens)
    if not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array (int32 [num_sequences + 1]); got {cu_seqlens.dtype}. "
                        "Cast it with .astype(jnp.int32).")
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"{name} must be rank 1 with num_sequences + 1 >= 2 entries (0, the end of each sequence); "
                         f"got shape {tuple(cu_seqlens.shape)}.")
    if concrete is not None:
        values = concrete.astype(np.int64)
        if values[0] != 0 or np.any(np.diff(values) < 0) or values[-1] != total:
            raise ValueError(f"{name} must start at 0, never decrease and end at the packed token count {total}; "
                             f"got {values.tolist()}.")
    return cu_seqlens.astype(jnp.int32)


def attention_varlen(
    query: Array,
    key: Array,
    value: Array,
    cu_seqlens_q: Array,
    cu_seqlens_k: Array,
    *,
    scale: Optional[float] = None,
    causal: bool = False,
    window: Optional[tuple[Optional[int], Optional[int]]] = None,
    softcap: Optional[float] = None,
    sinks: Optional[Array] = None,
    return_lse: bool = False,
    deterministic: bool = False,
    implementation: Optional[str] = None,
):
    """Attention over packed variable-length sequences.

    Args:
      query: [Tq, q_heads, head_dim]; key: [Tk, kv_heads, head_dim]; value: [Tk, kv_heads, v_head_dim]:
        the tokens of N sequences, concatenated. q_heads must be a multiple of kv_heads (GQA/MQA).
      cu_seqlens_q, cu_seqlens_k: int [N+1] offsets: sequence b is query[cu_seqlens_q[b]:cu_seqlens_q[b+1]]
        against key/value[cu_seqlens_k[b]:cu_seqlens_k[b+1]]. Both start at 0, never decrease, and end
        at Tq / Tk; empty sequences (equal neighbours) are fine. Checked when concrete; under jit they
        are runtime data (one compile serves every packing) and are not checked: a token past the last
        offset (or before the first) sees no key and is seen by no query (out 0, lse -inf), and
        decreasing offsets give an unspecified result.
      scale, causal, window, softcap, sinks, deterministic, implementation: as for `fa4_jax.attention`,
        with causal and window aligned bottom-right **per sequence**: row i of sequence b sits at its
        key position i + len_k[b] - len_q[b].
      return_lse: also return lse [q_heads, Tq] float32.

    Returns:
      out [Tq, q_heads, v_head_dim] in query's dtype, or (out, lse). A row that sees no key (its
      sequence has no keys, or the mask hides them all) gets out 0 and lse -inf (the sink logit with
      sinks). Not vmappable (the packing is the batch): a ValueError says so.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}; got {implementation!r}.")
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    if query.ndim != 3 or key.ndim != 3 or value.ndim != 3:
        raise ValueError(f"attention_varlen takes packed rank-3 arrays query [Tq, q_heads, head_dim], key "
                         f"[Tk, kv_heads, head_dim], value [Tk, kv_heads, v_head_dim]; got shapes {query.shape}, "
                         f"{key.shape}, {value.shape}. For batched [batch, seq, heads, dim] arrays use "
                         "fa4_jax.attention (with q_seq_lengths / kv_seq_lengths for padding).")
    cu_q = _offsets("cu_seqlens_q", cu_seqlens_q, query.shape[0])
    cu_k = _offsets("cu_seqlens_k", cu_seqlens_k, key.shape[0])
    if cu_q.shape != cu_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences; got "
                         f"{cu_q.shape[0] - 1} and {cu_k.shape[0] - 1} (shapes {cu_q.shape} and {cu_k.shape}).")
    scale, softcap = scale_and_softcap(scale, softcap, query.shape[-1])
    # Within one sequence a row's diagonal and its keys lie inside [-Tq, Tk), as in `attention`.
    window_left, window_right = _window(window, query.shape[0], key.shape[0])

    optional = {"cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k}
    if sinks is not None:
        optional["sinks"] = sinks_operand(sinks)
    arrays = _vary_together(dict(optional, query=query[None], key=key[None], value=value[None]))
    query, key, value = arrays.pop("query"), arrays.pop("key"), arrays.pop("value")
    config = AttentionConfig(
        scale=float(scale), causal=bool(causal), window_left=window_left, window_right=window_right,
        softcap=None if softcap is None else float(softcap), has_sinks=sinks is not None, has_cu_seqlens=True,
        deterministic=bool(deterministic), implementation=implementation)
    out, lse = attention_differentiable(config, True, query, key, value, arrays)
    return (out[0], lse[0]) if return_lse else out[0]
