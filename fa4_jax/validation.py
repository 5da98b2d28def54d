"""Checks of shapes and dtypes, run in abstract evaluation so bad input fails before lowering.

Every message says what was wrong and what to change.
"""

from __future__ import annotations

import numpy as np

from fa4_jax.config import SUPPORTED_HEAD_DIM_MAX, AttentionConfig

_ATTENTION_DTYPES = ("bfloat16", "float16", "float32")


def _dtype_name(aval) -> str:
    return np.dtype(aval.dtype).name


def validate_operands(config: AttentionConfig, query, key, value, optional: dict) -> None:
    """Raise ValueError / TypeError for inconsistent operands (avals or arrays)."""
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        raise ValueError(
            "query, key and value must be rank 4 in BSHD layout: query [batch, q_len, q_heads, head_dim], "
            "key [batch, kv_len, kv_heads, head_dim], value [batch, kv_len, kv_heads, v_head_dim]; got "
            f"shapes {query.shape}, {key.shape}, {value.shape}. Add a batch axis with x[None] if you have "
            "[seq, heads, dim] inputs.")
    batch, q_len, q_heads, head_dim = query.shape
    k_batch, kv_len, kv_heads, k_head_dim = key.shape
    v_batch, v_len, v_heads, v_head_dim = value.shape
    if not (batch == k_batch == v_batch):
        raise ValueError(f"query, key and value must have the same batch size; got {batch}, {k_batch}, {v_batch}.")
    if kv_len != v_len or kv_heads != v_heads:
        raise ValueError(
            f"key {key.shape} and value {value.shape} must agree on kv_len and kv_heads (axes 1 and 2).")
    if k_head_dim != head_dim:
        raise ValueError(
            f"query and key must have the same head_dim (axis 3); got {head_dim} and {k_head_dim}.")
    if min(q_len, kv_len, q_heads, kv_heads, head_dim, v_head_dim) < 1:
        raise ValueError(f"empty attention: q_len, kv_len, q_heads, kv_heads, head_dim and v_head_dim must be >= 1 "
                         f"(batch may be 0); got query {query.shape}, key {key.shape}, value {value.shape}.")
    if q_heads % kv_heads:
        raise ValueError(
            f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads}) for grouped-query attention; "
            "repeat the key/value heads or change the number of heads.")
    for name, dim in (("head_dim", head_dim), ("v_head_dim", v_head_dim)):
        if dim > SUPPORTED_HEAD_DIM_MAX:
            raise ValueError(
                f"{name} {dim} is larger than the supported maximum {SUPPORTED_HEAD_DIM_MAX}; split the heads "
                "into more heads of a smaller head_dim.")
    dtypes = {_dtype_name(x) for x in (query, key, value)}
    if len(dtypes) != 1:
        raise TypeError(
            f"query, key and value must share one dtype; got {_dtype_name(query)}, {_dtype_name(key)}, "
            f"{_dtype_name(value)}. Cast them to one of {', '.join(_ATTENTION_DTYPES)}.")
    (dtype,) = dtypes
    if dtype not in _ATTENTION_DTYPES:
        raise TypeError(f"attention inputs must be bfloat16, float16 or float32 (float32 runs on the reference "
                        f"path only); got {dtype}.")

    q_total = config.q_total if config.q_total is not None else q_len
    expected = {
        "sinks": ((q_heads,), "float32", "one sink logit per query head"),
        "q_segment_ids": ((batch, q_len), "int32", "[batch, q_len]"),
        "kv_segment_ids": ((batch, kv_len), "int32", "[batch, kv_len]"),
        "q_seq_lengths": ((batch,), "int32", "one valid query length per batch element"),
        "kv_seq_lengths": ((batch,), "int32", "one valid key length per batch element"),
        "q_start": ((1,), "int32", "the global row of the first local query row"),
        "kv_start": ((1,), "int32", "the global key of the first local key"),
    }
    if config.has_cu_seqlens:
        num_offsets = optional["cu_seqlens_q"].shape[0] if optional["cu_seqlens_q"].ndim == 1 else -1
        expected["cu_seqlens_q"] = ((num_offsets,), "int32", "the packed query offsets [N+1]")
        expected["cu_seqlens_k"] = ((num_offsets,), "int32", "the packed key offsets [N+1], as many as cu_seqlens_q")
        if batch != 1 or num_offsets < 2:
            raise ValueError(f"packed variable-length attention takes one packed batch (batch 1) and at least one "
                             f"sequence (cu_seqlens of length N+1 >= 2); got batch {batch} and cu_seqlens_q "
                             f"{tuple(optional['cu_seqlens_q'].shape)}.")
    for name, array in optional.items():
        shape, dtype_name, meaning = expected[name]
        if tuple(array.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} ({meaning}); got {tuple(array.shape)}.")
        if _dtype_name(array) != dtype_name:
            raise TypeError(f"{name} must be {dtype_name}; got {_dtype_name(array)}. Cast it with "
                            f".astype(jnp.{dtype_name}).")
    if q_total < q_len:
        raise ValueError(f"q_total ({q_total}) cannot be smaller than the local q_len ({q_len}).")
    if config.kv_total is not None and config.kv_total < kv_len:
        raise ValueError(f"kv_total ({config.kv_total}) cannot be smaller than the local kv_len ({kv_len}).")
