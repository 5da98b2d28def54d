"""Static configuration of one attention call: one frozen, hashable object.

It is a primitive parameter, a `custom_partitioning` static argument and the key under which kernels
are compiled, so it holds only Python scalars. Which optional operands are present is part of it; the
operands themselves always travel in the order of `OPTIONAL_OPERANDS`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

# Order of the operands after (query, key, value); each is present only when its flag is set.
OPTIONAL_OPERANDS = (
    "sinks",            # float32 [Hq]                      has_sinks
    "q_segment_ids",    # int32 [B, Sq]                      has_segment_ids
    "kv_segment_ids",   # int32 [B, Sk]                      has_segment_ids
    "q_seq_lengths",    # int32 [B]                          has_q_seq_lengths
    "kv_seq_lengths",   # int32 [B]                          has_kv_seq_lengths
    "q_start",          # int32 [1], global row of local row 0 (Q sharded on sequence)   has_q_start
    "kv_start",         # int32 [1], global key of local key 0 (a ring step's K/V chunk)  has_kv_start
    "cu_seqlens_q",     # int32 [N+1], packed query offsets (batch 1 holds N sequences)   has_cu_seqlens
    "cu_seqlens_k",     # int32 [N+1], packed key offsets                                has_cu_seqlens
)

SUPPORTED_HEAD_DIM_MAX = 256
IMPLEMENTATIONS = (None, "cute", "reference")
CONTEXT_PARALLEL_STRATEGIES = (None, "all_gather", "ring")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Everything about an attention call that is not an array.

    Positions: query row i (global) sits at key position i + off, off = Sk - Sq (bottom-right
    alignment), or kv_len[b] - q_len[b] per batch when sequence lengths are given. With q_start (and
    kv_start) the local rows (keys) sit at those global positions, Sq is q_total and Sk kv_total.
    """

    scale: float
    causal: bool = False
    window_left: Optional[int] = None    # None: unbounded to the left
    window_right: Optional[int] = None   # None: unbounded to the right
    softcap: Optional[float] = None
    has_sinks: bool = False
    has_segment_ids: bool = False
    has_q_seq_lengths: bool = False
    has_kv_seq_lengths: bool = False
    # Set only by the sharding rule when Q is split on sequence: the operand q_start gives each shard's
    # first global row and q_total the global query length used for alignment.
    has_q_start: bool = False
    q_total: Optional[int] = None
    # Set only by the context-parallel code for one ring step's K/V chunk: the operand kv_start gives the
    # chunk's first global key and kv_total the global key length (fa4_jax/context_parallel.py).
    has_kv_start: bool = False
    kv_total: Optional[int] = None
    # Context parallelism (the sequence split over devices): the strategy (None: by the cost model),
    # the dual-chunk order of the sequence axis (zigzag_shards), and inside shard_map the mesh axes that
    # split the sequence. The per-shard calls that reach a kernel never carry these.
    # Packed variable-length sequences (`fa4_jax.attention_varlen`): the batch axis is 1 and the
    # operands cu_seqlens_q / cu_seqlens_k cut its tokens into N sequences, each aligned on its own.
    has_cu_seqlens: bool = False
    context_parallel: Optional[str] = None
    zigzag_shards: Optional[int] = None
    context_parallel_axis: Optional[tuple[str, ...]] = None
    deterministic: bool = False
    implementation: Optional[str] = None

    @property
    def has_window(self) -> bool:
        return self.window_left is not None or self.window_right is not None

    @property
    def needs_positions(self) -> bool:
        """Whether the mask depends on absolute row positions (matters when Q is split on sequence)."""
        return (self.causal or self.has_window or self.has_q_seq_lengths or self.has_kv_seq_lengths
                or self.has_cu_seqlens)

    def present_operands(self) -> tuple[str, ...]:
        flags = {
            "sinks": self.has_sinks,
            "q_segment_ids": self.has_segment_ids,
            "kv_segment_ids": self.has_segment_ids,
            "q_seq_lengths": self.has_q_seq_lengths,
            "kv_seq_lengths": self.has_kv_seq_lengths,
            "q_start": self.has_q_start,
            "kv_start": self.has_kv_start,
            "cu_seqlens_q": self.has_cu_seqlens,
            "cu_seqlens_k": self.has_cu_seqlens,
        }
        return tuple(name for name in OPTIONAL_OPERANDS if flags[name])

    def split_operands(self, operands):
        """(query, key, value, *optional) -> (query, key, value, {name: array}) per this config."""
        query, key, value, *rest = operands
        names = self.present_operands()
        if len(rest) != len(names):
            raise ValueError(f"expected optional operands {names}, got {len(rest)} arrays")
        return query, key, value, dict(zip(names, rest))

    def join_operands(self, query, key, value, optional: dict):
        """Inverse of `split_operands`: the operand tuple a primitive is bound with."""
        return (query, key, value) + tuple(optional[name] for name in self.present_operands())

    def replace(self, **changes) -> "AttentionConfig":
        return dataclasses.replace(self, **changes)
