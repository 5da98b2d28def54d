"""`fa4_jax.paged_attention`: inference attention of a few new query tokens against a paged KV cache.

The cache holds fixed-size pages (blocks) of keys and values shared by all sequences; `block_tables[b, j]`
names the cache block that holds tokens [j * block_size, (j + 1) * block_size) of sequence b. The
new query tokens are the last Sq positions of each sequence (bottom-right alignment, as everywhere in
fa4_jax) and causal among themselves.

One primitive, `paged_attention_p`, forward only: it has no derivative rule (a clear error under
`grad`), a batching rule that maps over vmapped axes, the pure-JAX reference lowering on every
platform (`reference_paged_forward`) and, on CUDA, the decode kernel where `fa4_jax/lowering/cuda.py`
routes it.
"""

from __future__ import annotations

import math
import numbers
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from fa4_jax.api import _FLOAT32_MAX, _FLOAT32_SMALLEST_NORMAL, _window
from fa4_jax.config import IMPLEMENTATIONS, SUPPORTED_HEAD_DIM_MAX, AttentionConfig
from fa4_jax.kernels import host
from fa4_jax.lowering import cuda as cuda_lowering
from fa4_jax.primitive import eager_impl
from fa4_jax.reference import reference_forward

Array = jax.Array

paged_attention_p = Primitive("fa4_paged_attention")
paged_attention_p.multiple_results = True

_CACHE_DTYPES = ("bfloat16", "float16", "float32")


def _dtype_name(x) -> str:
    return np.dtype(x.dtype).name


def validate_paged_operands(config: AttentionConfig, query, key_cache, value_cache, block_tables,
                            kv_seq_lengths, sinks=None) -> None:
    """Raise ValueError / TypeError for inconsistent paged operands (arrays or abstract values)."""
    if query.ndim != 4:
        raise ValueError(f"query must be rank 4 [batch, q_len, q_heads, head_dim]; got shape {query.shape}.")
    if key_cache.ndim != 4 or value_cache.ndim != 4:
        raise ValueError(
            "key_cache and value_cache must be rank 4 [num_blocks, block_size, kv_heads, head_dim]; got "
            f"shapes {key_cache.shape} and {value_cache.shape}.")
    batch, q_len, q_heads, head_dim = query.shape
    num_blocks, block_size, kv_heads, k_head_dim = key_cache.shape
    if tuple(value_cache.shape[:3]) != (num_blocks, block_size, kv_heads):
        raise ValueError(f"key_cache {key_cache.shape} and value_cache {value_cache.shape} must agree on "
                         "num_blocks, block_size and kv_heads (axes 0-2).")
    v_head_dim = value_cache.shape[3]
    if k_head_dim != head_dim:
        raise ValueError(f"query and key_cache must have the same head_dim (axis 3); got {head_dim} and {k_head_dim}.")
    if min(q_len, q_heads, head_dim, v_head_dim, num_blocks, block_size, kv_heads) < 1:
        raise ValueError(f"empty paged attention: every axis but the batch must be >= 1; got query {query.shape}, "
                         f"key_cache {key_cache.shape}, value_cache {value_cache.shape}.")
    if q_heads % kv_heads:
        raise ValueError(f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads}) for grouped-query "
                         "attention.")
    for name, dim in (("head_dim", head_dim), ("v_head_dim", v_head_dim)):
        if dim > SUPPORTED_HEAD_DIM_MAX:
            raise ValueError(f"{name} {dim} is larger than the supported maximum {SUPPORTED_HEAD_DIM_MAX}.")
    dtypes = {_dtype_name(x) for x in (query, key_cache, value_cache)}
    if len(dtypes) != 1:
        raise TypeError(f"query, key_cache and value_cache must share one dtype; got {_dtype_name(query)}, "
                        f"{_dtype_name(key_cache)}, {_dtype_name(value_cache)}.")
    if dtypes.pop() not in _CACHE_DTYPES:
        raise TypeError(f"paged attention inputs must be bfloat16, float16 or float32 (float32 on the reference "
                        f"path only); got {_dtype_name(query)}.")
    if block_tables.ndim != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables must be [batch, max_blocks_per_seq] = [{batch}, ...] (the cache block of "
                         f"each sequence's j-th page); got shape {block_tables.shape}.")
    if block_tables.shape[1] < 1:
        raise ValueError("block_tables needs at least one column (max_blocks_per_seq >= 1).")
    if tuple(kv_seq_lengths.shape) != (batch,):
        raise ValueError(f"kv_seq_lengths must have shape ({batch},) (valid tokens per sequence, the new ones "
                         f"included); got {tuple(kv_seq_lengths.shape)}.")
    for name, array in (("block_tables", block_tables), ("kv_seq_lengths", kv_seq_lengths)):
        if _dtype_name(array) != "int32":
            raise TypeError(f"{name} must be int32; got {_dtype_name(array)}. Cast it with .astype(jnp.int32).")
    if sinks is not None:
        if tuple(sinks.shape) != (q_heads,) or _dtype_name(sinks) != "float32":
            raise ValueError(f"sinks must be float32 [{q_heads}] (one sink logit per query head); got "
                             f"{_dtype_name(sinks)} {tuple(sinks.shape)}.")


def paged_attention(
    query: Array,
    key_cache: Array,
    value_cache: Array,
    block_tables: Array,
    kv_seq_lengths: Array,
    *,
    scale: Optional[float] = None,
    softcap: Optional[float] = None,
    sinks: Optional[Array] = None,
    window: Optional[tuple[Optional[int], Optional[int]]] = None,
    return_lse: bool = False,
    implementation: Optional[str] = None,
):
    """Attention of Sq new tokens per sequence against a paged KV cache (inference; forward only).

    Args:
      query: [batch, q_len, q_heads, head_dim], the last q_len tokens of each sequence (q_len = 1 for a
        decode step, a few dozen for speculative decoding or chunked prefill).
      key_cache: [num_blocks, block_size, kv_heads, head_dim]; value_cache: [num_blocks, block_size,
        kv_heads, v_head_dim]. q_heads must be a multiple of kv_heads (GQA/MQA).
      block_tables: int32 [batch, max_blocks_per_seq]: the cache block of each sequence's j-th page.
        Entries at or past ceil(kv_seq_lengths[b] / block_size) are never read (they may hold anything).
      kv_seq_lengths: int32 [batch], valid tokens of each sequence, the q_len new ones included; clipped
        to [0, max_blocks_per_seq * block_size].
      scale, softcap, sinks, window: as in `fa4_jax.attention`. The new tokens are causal among
        themselves: query row i sits at key position i + kv_seq_lengths[b] - q_len.
      return_lse: also return lse [batch, q_heads, q_len] float32.
      implementation: None (fastest available), "cute" (our GPU decode kernel, or NotImplementedError
        naming what it cannot take) or "reference" (pure JAX, any platform).

    Returns:
      out [batch, q_len, q_heads, v_head_dim] in query's dtype, or (out, lse) with return_lse. Rows that
      see no key (positions before the sequence start) get out 0 and lse -inf (the sink logit with sinks).
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}; got {implementation!r}.")
    query, key_cache, value_cache = jnp.asarray(query), jnp.asarray(key_cache), jnp.asarray(value_cache)
    block_tables, kv_seq_lengths = jnp.asarray(block_tables), jnp.asarray(kv_seq_lengths)
    for name, array in (("block_tables", block_tables), ("kv_seq_lengths", kv_seq_lengths)):
        if not jnp.issubdtype(array.dtype, jnp.integer):
            raise TypeError(f"{name} must be an int32 array; got {array.dtype}. Cast it with .astype(jnp.int32).")
    if query.ndim != 4 or key_cache.ndim != 4:
        raise ValueError(f"query [batch, q_len, q_heads, head_dim] and key_cache [num_blocks, block_size, "
                         f"kv_heads, head_dim] must be rank 4; got {query.shape} and {key_cache.shape}.")
    if block_tables.ndim != 2:
        raise ValueError(f"block_tables must be [batch, max_blocks_per_seq]; got shape {block_tables.shape}.")
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    if not isinstance(scale, numbers.Real) or not abs(scale) <= _FLOAT32_MAX:
        raise ValueError(f"scale must be a finite Python number within float32's range; got {scale!r}.")
    if softcap is not None and (not isinstance(softcap, numbers.Real)
                                or not _FLOAT32_SMALLEST_NORMAL <= softcap <= _FLOAT32_MAX):
        raise ValueError(f"softcap must be a positive number within float32's range or None; got {softcap!r}.")
    max_kv_len = table_length(block_tables, key_cache)
    window_left, window_right = _window(window, query.shape[1], max_kv_len)
    # Lengths past the table mean the whole table, below 0 nothing: int32 lengths go to the primitive as
    # they are and the kernel and the reference clamp them (a clip here would be one more kernel per
    # decode step); wider ones are clipped before they are narrowed.
    if kv_seq_lengths.dtype != jnp.int32:
        kv_seq_lengths = jnp.clip(kv_seq_lengths, 0, max_kv_len).astype(jnp.int32)
    block_tables = block_tables.astype(jnp.int32)
    operands = [query, key_cache, value_cache, block_tables, kv_seq_lengths]
    if sinks is not None:
        sinks = jnp.asarray(sinks)
        if not jnp.issubdtype(sinks.dtype, jnp.floating):
            raise TypeError(f"sinks must be a float array [q_heads] (float32); got {sinks.dtype}.")
        operands.append(sinks.astype(jnp.float32))
    config = AttentionConfig(
        scale=float(scale), causal=True, window_left=window_left, window_right=window_right,
        softcap=None if softcap is None else float(softcap), has_sinks=sinks is not None,
        has_kv_seq_lengths=True, implementation=implementation)
    out, lse = paged_attention_p.bind(*operands, config=config)
    return (out, lse) if return_lse else out


def split_paged_operands(operands):
    """(query, key_cache, value_cache, block_tables, kv_seq_lengths, sinks or None)."""
    query, key_cache, value_cache, block_tables, kv_seq_lengths, *rest = operands
    return query, key_cache, value_cache, block_tables, kv_seq_lengths, (rest[0] if rest else None)


def _abstract_eval(*operands, config: AttentionConfig):
    query, key_cache, value_cache, block_tables, kv_seq_lengths, sinks = split_paged_operands(operands)
    validate_paged_operands(config, query, key_cache, value_cache, block_tables, kv_seq_lengths, sinks)
    batch, q_len, q_heads, _ = query.shape
    return (jax.core.ShapedArray((batch, q_len, q_heads, value_cache.shape[-1]), query.dtype),
            jax.core.ShapedArray((batch, q_heads, q_len), jnp.float32))


paged_attention_p.def_abstract_eval(_abstract_eval)


paged_attention_p.def_impl(eager_impl(paged_attention_p))


def _no_derivative(primals, tangents, *, config):
    raise TypeError(
        "fa4_jax.paged_attention is forward-only (inference): it has no derivative. Wrap its inputs in "
        "jax.lax.stop_gradient if it sits inside a differentiated function, or train with "
        "fa4_jax.attention, which has a backward pass.")


ad.primitive_jvps[paged_attention_p] = _no_derivative


def _batch_rule(operands, batch_dims, *, config):
    """vmap: one call per vmapped element (lax.map); the kernel already runs all of a call's batch."""
    mapped = [jnp.moveaxis(x, d, 0) for x, d in zip(operands, batch_dims) if d is not None]

    def one(slices):
        slices = iter(slices)
        return paged_attention_p.bind(*[x if d is None else next(slices)
                                        for x, d in zip(operands, batch_dims)], config=config)
    out, lse = jax.lax.map(one, mapped)
    return (out, lse), (0, 0)


batching.primitive_batchers[paged_attention_p] = _batch_rule


# ------------------------------------------------------------------------------------------- reference

def gather_pages(cache, block_tables, kv_seq_lengths):
    """[batch, max_blocks_per_seq * block_size, kv_heads, D]: each sequence's pages in order.

    Table entries at or past a sequence's last page are replaced by that sequence's first entry (or
    block 0 for an empty sequence) before the gather, so their values, whatever they are, are never
    used as indices. Positions past kv_seq_lengths (those pages, and the unwritten tail of the last
    page) come out as zeros: they are masked, and zeros keep a NaN left in unused cache memory out of
    the P V product (0 * NaN is NaN).
    """
    block_size = cache.shape[1]
    pages_used = (kv_seq_lengths + block_size - 1) // block_size
    entry = jnp.arange(block_tables.shape[1], dtype=jnp.int32)[None, :]
    fallback = jnp.where(pages_used[:, None] > 0, block_tables[:, :1], 0)
    safe_tables = jnp.where(entry < pages_used[:, None], block_tables, fallback)
    gathered = cache[safe_tables]            # [B, max_blocks, block_size, Hkv, D]
    batch, max_blocks = block_tables.shape
    gathered = gathered.reshape((batch, max_blocks * block_size) + cache.shape[2:])
    position = jnp.arange(max_blocks * block_size, dtype=jnp.int32)[None, :, None, None]
    return jnp.where(position < kv_seq_lengths[:, None, None, None], gathered, jnp.zeros((), cache.dtype))


def reference_paged_forward(query, key_cache, value_cache, block_tables, kv_seq_lengths, sinks,
                            config: AttentionConfig):
    """(out, lse) of the reference: dense attention over the gathered pages (memory O(B · L · D))."""
    key = gather_pages(key_cache, block_tables, kv_seq_lengths)
    value = gather_pages(value_cache, block_tables, kv_seq_lengths)
    optional = {"kv_seq_lengths": kv_seq_lengths}
    if sinks is not None:
        optional["sinks"] = sinks
    return reference_forward(query, key, value, optional, config)


def reference_lowering(*operands, config: AttentionConfig):
    query, key_cache, value_cache, block_tables, kv_seq_lengths, sinks = split_paged_operands(operands)
    kv_seq_lengths = jnp.clip(kv_seq_lengths, 0, table_length(block_tables, key_cache))
    return reference_paged_forward(query, key_cache, value_cache, block_tables, kv_seq_lengths, sinks, config)


def _refuse_cute_off_gpu(ctx, *operands, config):
    if config.implementation == "cute":
        platforms = ", ".join(ctx.module_context.platforms)
        raise NotImplementedError(
            f"implementation='cute' needs an NVIDIA GPU (sm_90 Hopper), but this paged attention is lowered for "
            f"{platforms}. Use implementation=None or implementation='reference'.")
    return mlir.lower_fun(reference_lowering, multiple_results=True)(ctx, *operands, config=config)


mlir.register_lowering(paged_attention_p, _refuse_cute_off_gpu)


def table_length(block_tables, key_cache) -> int:
    """Tokens a block table addresses: max_blocks_per_seq * block_size (the bound of every length)."""
    return block_tables.shape[1] * key_cache.shape[1]


def paged_problem(query, key_cache, value_cache, block_tables) -> host.Problem:
    """The `Problem` a paged call poses to the kernels: key and value as the logical
    [B, max_blocks_per_seq * block_size, Hkv, D] with the page size."""
    batch = block_tables.shape[0]
    _, block_size, kv_heads, head_dim = key_cache.shape
    length = table_length(block_tables, key_cache)
    return host.Problem(tuple(query.shape), (batch, length, kv_heads, head_dim),
                        (batch, length, kv_heads, value_cache.shape[3]), jnp.dtype(query.dtype).name,
                        page_size=block_size)


def _cuda_rule(ctx, *operands, config: AttentionConfig):
    query, key_cache, value_cache, block_tables, _, _ = split_paged_operands(ctx.avals_in)
    problem = paged_problem(query, key_cache, value_cache, block_tables)
    module = cuda_lowering.kernel_for_problem("decode", config, problem)
    if module is None:
        return mlir.lower_fun(reference_lowering, multiple_results=True)(ctx, *operands, config=config)
    options = module.options(config, problem)

    def kernel(*arrays, config):
        return module.run(options, *split_paged_operands(arrays))
    return mlir.lower_fun(kernel, multiple_results=True)(ctx, *operands, config=config)


mlir.register_lowering(paged_attention_p, _cuda_rule, platform="cuda")
