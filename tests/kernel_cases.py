"""What the per-kernel GPU tests (test_sm90_forward, test_sm90_backward, its large-head twin,
test_sm100_forward) share: the `Case` they describe a problem with, one rounding of each input type,
and the NaN poisoning of device memory that makes an unwritten output element show up."""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp

ROUNDING = {jnp.bfloat16: 2.0 ** -8, jnp.float16: 2.0 ** -11}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    head_dim: int = 128
    dtype: object = jnp.bfloat16
    batch: int = 2
    q_len: int = 197
    kv_len: int = 333
    q_heads: int = 4
    kv_heads: int = 4
    causal: bool = False
    window: Optional[tuple] = None
    softcap: Optional[float] = None
    sinks: bool = False
    segments: bool = False
    q_lengths: bool = False
    kv_lengths: bool = False
    d_lse: bool = False      # backward: also differentiate through the LSE output
    scale: Optional[float] = None
    v_head_dim: Optional[int] = None   # MLA cases (sm90 forward, large-head backward): None is head_dim


def poison_device_memory(nbytes: int):
    """Fill and free a NaN buffer so the kernel's fresh output buffers start out as NaN."""
    poison = jnp.full((nbytes // 4 + 1024,), jnp.nan, dtype=jnp.float32)
    poison.block_until_ready()
    del poison
