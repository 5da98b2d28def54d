"""Paged KV caches for the `fa4_jax.paged_attention` tests (CPU reference and GPU decode kernel): one
`PagedCase` describes a problem, `build` draws it, `expected` is the float64 oracle over the same
tokens laid out densely.

A drawn cache is hostile on purpose: each sequence's pages sit in randomly permuted cache blocks,
lengths are mostly not multiples of the page size (one sequence has length 1), block-table entries
past a sequence's last page hold garbage ids (negative, huge, or ids of other sequences' blocks), and
every cache slot no sequence owns (spare blocks, the tail of each last page) holds NaN, so a kernel
that reads any of them, or multiplies a masked P by one, returns NaN.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp
import numpy as np

import numpy_reference as oracle


@dataclasses.dataclass(frozen=True)
class PagedCase:
    batch: int = 3
    q_len: int = 1
    q_heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    v_head_dim: Optional[int] = None
    block_size: int = 16
    max_blocks: int = 9           # table columns: max context = max_blocks * block_size
    dtype: object = jnp.float32
    window: Optional[tuple] = None
    softcap: Optional[float] = None
    sinks: bool = False
    scale: Optional[float] = None
    lengths: Optional[tuple] = None   # None: random (one of length 1, one full, the rest random)

    @property
    def v_dim(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @property
    def name(self) -> str:
        parts = [f"b{self.batch}", f"q{self.q_len}", f"h{self.q_heads}-{self.kv_heads}", f"d{self.head_dim}",
                 f"page{self.block_size}x{self.max_blocks}", jnp.dtype(self.dtype).name]
        if self.v_head_dim is not None:
            parts.append(f"v{self.v_head_dim}")
        if self.window is not None:
            parts.append("w{}-{}".format(*("inf" if side is None else side for side in self.window)))
        if self.softcap is not None:
            parts.append(f"cap{self.softcap:g}")
        if self.sinks:
            parts.append("sinks")
        if self.lengths is not None:
            parts.append("len" + "-".join(map(str, self.lengths)))
        return "_".join(parts)


def _lengths(case: PagedCase, rng) -> np.ndarray:
    if case.lengths is not None:
        return np.asarray(case.lengths, np.int32)
    max_len = case.max_blocks * case.block_size
    lengths = rng.integers(1, max_len + 1, size=case.batch).astype(np.int32)
    lengths[0] = 1
    if case.batch > 1:
        lengths[-1] = max_len - (1 if case.block_size > 1 else 0)
    return lengths


def build(case: PagedCase, rng) -> dict:
    """The arguments of `paged_attention` (query, key_cache, value_cache, block_tables, kv_seq_lengths,
    sinks or None) as JAX arrays, and dense_key / dense_value [B, max_len, Hkv, D] float64 (zeros past
    each length) for the oracle."""
    lengths = _lengths(case, rng)
    pages = -(-lengths // case.block_size)
    spare = 3
    num_blocks = int(pages.sum()) + spare
    order = rng.permutation(num_blocks)
    max_len = case.max_blocks * case.block_size
    shape_k = (num_blocks, case.block_size, case.kv_heads, case.head_dim)
    shape_v = (num_blocks, case.block_size, case.kv_heads, case.v_dim)
    key_cache = np.full(shape_k, np.nan, np.float32)
    value_cache = np.full(shape_v, np.nan, np.float32)
    dense_key = np.zeros((case.batch, max_len, case.kv_heads, case.head_dim))
    dense_value = np.zeros((case.batch, max_len, case.kv_heads, case.v_dim))
    garbage = np.array([-7, -1, num_blocks, num_blocks + 1000, 2 ** 31 - 1, int(order[0])], np.int64)
    tables = rng.choice(garbage, size=(case.batch, case.max_blocks)).astype(np.int32)
    used = 0
    for b in range(case.batch):
        keys = rng.standard_normal((lengths[b], case.kv_heads, case.head_dim)).astype(np.float32)
        values = rng.standard_normal((lengths[b], case.kv_heads, case.v_dim)).astype(np.float32)
        keys = np.asarray(jnp.asarray(keys).astype(case.dtype).astype(jnp.float32))
        values = np.asarray(jnp.asarray(values).astype(case.dtype).astype(jnp.float32))
        dense_key[b, :lengths[b]] = keys
        dense_value[b, :lengths[b]] = values
        for j in range(pages[b]):
            block = int(order[used])
            used += 1
            tables[b, j] = block
            rows = slice(j * case.block_size, min((j + 1) * case.block_size, lengths[b]))
            count = rows.stop - rows.start
            key_cache[block, :count] = keys[rows]
            value_cache[block, :count] = values[rows]
    query = rng.standard_normal((case.batch, case.q_len, case.q_heads, case.head_dim)).astype(np.float32)
    query = jnp.asarray(query).astype(case.dtype)
    sinks = None
    if case.sinks:
        sinks = jnp.asarray(rng.standard_normal(case.q_heads).astype(np.float32) * 2.0)
    return dict(query=query, key_cache=jnp.asarray(key_cache).astype(case.dtype),
                value_cache=jnp.asarray(value_cache).astype(case.dtype), block_tables=jnp.asarray(tables),
                kv_seq_lengths=jnp.asarray(lengths), sinks=sinks, dense_key=dense_key, dense_value=dense_value)


def arguments(drawn: dict) -> tuple:
    """The positional arguments of `paged_attention`."""
    return tuple(drawn[name] for name in ("query", "key_cache", "value_cache", "block_tables", "kv_seq_lengths"))


def expected(case: PagedCase, drawn: dict):
    """(out, lse) float64 from the dense oracle: causal among the new tokens, bottom-right aligned."""
    return oracle.attention_forward(
        oracle.to_float64(drawn["query"]), drawn["dense_key"], drawn["dense_value"], scale=case.scale,
        causal=True, window=case.window, softcap=case.softcap,
        sinks=None if drawn["sinks"] is None else oracle.to_float64(drawn["sinks"]),
        kv_seq_lengths=np.asarray(drawn["kv_seq_lengths"]))
