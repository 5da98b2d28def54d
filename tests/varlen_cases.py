"""Packed variable-length cases and their float64 oracle: `tests/numpy_reference.py` applied to each
sequence on its own (shared by the CPU tests and the GPU kernel tests)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp
import numpy as np

import numpy_reference as oracle

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class VarlenCase:
    """One packed configuration; `lengths` are (len_q, len_k) per sequence, or None for a random draw
    of `sequences` sequences that always holds an empty query, an empty key set and len_q != len_k."""

    sequences: int = 5
    max_len: int = 40
    lengths: Optional[tuple] = None
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    value_dim: Optional[int] = None
    dtype: str = "float32"
    causal: bool = False
    window: Optional[tuple] = None
    softcap: Optional[float] = None
    sinks: bool = False

    @property
    def v_dim(self) -> int:
        return self.head_dim if self.value_dim is None else self.value_dim

    @property
    def name(self) -> str:
        drawn = f"n{self.sequences}" + ("" if self.max_len == 40 else f"-max{self.max_len}")
        parts = [drawn if self.lengths is None else "n{}-fixed".format(len(self.lengths)),
                 f"h{self.q_heads}-{self.kv_heads}", f"d{self.head_dim}-v{self.v_dim}", self.dtype]
        if self.causal:
            parts.append("causal")
        if self.window is not None:
            parts.append("w{}-{}".format(*("inf" if side is None else side for side in self.window)))
        if self.softcap is not None:
            parts.append(f"cap{self.softcap:g}")
        if self.sinks:
            parts.append("sinks")
        return "_".join(parts)

    def options(self) -> dict:
        return dict(causal=self.causal, window=self.window, softcap=self.softcap)


def draw_lengths(rng: np.random.Generator, case: VarlenCase) -> np.ndarray:
    """int [N, 2] (len_q, len_k) per sequence."""
    if case.lengths is not None:
        return np.asarray(case.lengths, dtype=np.int64)
    lengths = rng.integers(1, case.max_len + 1, size=(case.sequences, 2))
    lengths[1, 0] = 0                      # a sequence with no query rows
    lengths[2, 1] = 0                      # a sequence whose rows see no key
    lengths[0] = (case.max_len, case.max_len // 3 + 1)  # more rows than keys: causal hides whole rows
    return lengths


def offsets(lengths) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


@dataclasses.dataclass
class Packed:
    query: object
    key: object
    value: object
    sinks: object
    cu_q: np.ndarray
    cu_k: np.ndarray


def build(case: VarlenCase, inputs, lengths) -> Packed:
    cu_q, cu_k = offsets(lengths[:, 0]), offsets(lengths[:, 1])
    dtype = DTYPES[case.dtype]
    query = inputs.normal((int(cu_q[-1]), case.q_heads, case.head_dim), dtype, scale=1.5)
    key = inputs.normal((int(cu_k[-1]), case.kv_heads, case.head_dim), dtype)
    value = inputs.normal((int(cu_k[-1]), case.kv_heads, case.v_dim), dtype)
    sinks = inputs.normal((case.q_heads,), jnp.float32) if case.sinks else None
    return Packed(query, key, value, sinks, cu_q, cu_k)


def _sequence(packed: Packed, b: int):
    """(q, k, v, kv_seq_lengths) of sequence b as batch-1 float64 arrays; an empty key set becomes one
    zero key hidden by kv_seq_lengths = 0, which the oracle's dense form needs."""
    q = oracle.to_float64(packed.query)[packed.cu_q[b]:packed.cu_q[b + 1]][None]
    k = oracle.to_float64(packed.key)[packed.cu_k[b]:packed.cu_k[b + 1]][None]
    v = oracle.to_float64(packed.value)[packed.cu_k[b]:packed.cu_k[b + 1]][None]
    if k.shape[1] == 0:
        return q, np.zeros((1, 1) + k.shape[2:]), np.zeros((1, 1) + v.shape[2:]), np.zeros((1,), np.int64)
    return q, k, v, None


def oracle_forward(case: VarlenCase, packed: Packed):
    """(out [Tq, Hq, Dv], lse [Hq, Tq]) in float64, one sequence at a time."""
    tq = packed.query.shape[0]
    out = np.zeros((tq, case.q_heads, case.v_dim))
    lse = np.full((case.q_heads, tq), -np.inf)
    for b in range(len(packed.cu_q) - 1):
        lo, hi = packed.cu_q[b], packed.cu_q[b + 1]
        if hi == lo:
            continue
        q, k, v, kv_lengths = _sequence(packed, b)
        o, l = oracle.attention_forward(q, k, v, sinks=packed.sinks, kv_seq_lengths=kv_lengths, **case.options())
        out[lo:hi], lse[:, lo:hi] = o[0], l[0]
    return out, lse


def oracle_backward(case: VarlenCase, packed: Packed, d_out, d_lse):
    """{dq, dk, dv, dsinks, dsinks_scale} in float64, one sequence at a time."""
    d_out, d_lse = oracle.to_float64(d_out), oracle.to_float64(d_lse)
    grads = {"dq": np.zeros(packed.query.shape), "dk": np.zeros(packed.key.shape),
             "dv": np.zeros(packed.value.shape), "dsinks": np.zeros((case.q_heads,)), "dsinks_scale": 1e-6}
    for b in range(len(packed.cu_q) - 1):
        lo, hi = packed.cu_q[b], packed.cu_q[b + 1]
        klo, khi = packed.cu_k[b], packed.cu_k[b + 1]
        if hi == lo:
            continue
        q, k, v, kv_lengths = _sequence(packed, b)
        g = oracle.attention_backward(q, k, v, d_out[lo:hi][None], d_lse[:, lo:hi][None], sinks=packed.sinks,
                                      kv_seq_lengths=kv_lengths, **case.options())
        grads["dq"][lo:hi] = g["dq"][0]
        if khi > klo:
            grads["dk"][klo:khi], grads["dv"][klo:khi] = g["dk"][0], g["dv"][0]
        if packed.sinks is not None:
            grads["dsinks"] += g["dsinks"]
            grads["dsinks_scale"] = max(grads["dsinks_scale"], g["dsinks_scale"])
    return grads
