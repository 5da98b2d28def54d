"""Sharding of the outer primitives with `custom_partitioning` (a Shardy rule plus the GSPMD callbacks).

What each shard needs, whatever the operands arrive with:
- batch and heads split freely: every (batch, head) pair is independent, so the forward needs no
  communication. Heads are split only when the KV heads split the same way (or there is a single KV
  head), so that each shard's query heads find their own KV group.
- query rows may be split on sequence: each shard then needs every key, and the mask needs each row's
  global position, which the shard computes from its index (`q_start`). The backward sums the partial
  dK / dV (and the sink gradient) over those shards, and over head shards that share one KV head.
- an uneven split of batch, rows or heads is not kept (XLA gathers that axis): its shards' padding
  would enter those sums.
- context parallelism (fa4_jax/context_parallel.py): when the keys are split on sequence like the
  query rows (or `context_parallel="ring"` asks for it), each shard keeps its slice of K/V and either
  gathers them itself and reduce-scatters dK/dV ("all_gather"), or passes them around the ring
  ("ring"); otherwise K/V are whole on each shard (XLA gathers a split because `partition` asks for it).
  With `zigzag_shards` every shard's rows and keys are pieces of the original order.
- the forward-mode tangent is sharded like the forward (its key tangents like the keys): its rows
  are independent, so it needs no reduction; under context parallelism it takes the forward's route.
- inside shard_map with `context_parallel_axis` the operands are already local: the lowering runs the
  sequence split directly (`primitive.split_forward` and co.), each piece through the rules here.
"""

from __future__ import annotations

import math

from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import mlir
from jax.sharding import NamedSharding, PartitionSpec

from fa4_jax import context_parallel
from fa4_jax.config import AttentionConfig
from fa4_jax.primitive import (attention_bwd_inner_p, attention_bwd_p, attention_fwd_inner_p, attention_fwd_p,
                               attention_tangent_inner_p, attention_tangent_p, backward_operand_names,
                               forward_operand_names, gradient_names, split_backward, split_backward_operands,
                               split_forward, split_tangent, split_tangent_operands, tangent_operand_names)


def _mesh_axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _entry(axes: tuple[str, ...]):
    return None if not axes else axes[0] if len(axes) == 1 else axes


class _Plan:
    """Mesh axes for batch, query sequence, query heads and KV heads, chosen from the query's sharding."""

    def __init__(self, config, mesh, query_info, key_info):
        spec = tuple(getattr(query_info.sharding, "spec", ()))
        spec = spec + (None,) * (4 - len(spec))
        self.mesh = mesh
        self.batch, self.seq, self.heads = (_mesh_axes(e) for e in spec[:3])
        batch, self.q_len, q_heads = query_info.shape[:3]
        # An uneven split pads shards with entries of unspecified content, and the backward sums over
        # shards (dK/dV over rows and over the heads sharing one KV head, dsinks over batch and rows):
        # an axis that does not divide stays whole. A context-parallel request says it, rather than
        # quietly computing every row on every shard.
        if batch % self.size(self.batch):
            self.batch = ()
        # Packed sequences: one batch element, and rows of a sequence split across shards would need
        # their sequence's offsets on every shard; the packed axis stays whole (heads still split).
        if config.has_cu_seqlens:
            self.batch = self.seq = ()
        if self.q_len % self.size(self.seq):
            if config.context_parallel is not None:
                context_parallel.pieces(self.q_len, self.size(self.seq), None, "query")  # raises
            self.seq = ()
        kv_heads = key_info.shape[2]
        # Keys split on sequence like the rows stay split (context parallelism); the cost model picks
        # the strategy only then, and "ring" splits them whatever they arrive with.
        key_spec = tuple(getattr(key_info.sharding, "spec", ())) + (None,) * 4
        kv_len = key_info.shape[1]
        keys_split = bool(self.seq) and _mesh_axes(key_spec[1]) == self.seq and kv_len % self.size(self.seq) == 0
        self.strategy = "all_gather"
        if self.seq and (keys_split or config.context_parallel == "ring"):
            self.strategy = context_parallel.choose_strategy(
                config, self.q_len // self.size(self.seq), q_heads, kv_heads)
        self.kv_seq = self.strategy == "ring" or keys_split
        ways = self.size(self.heads)
        if q_heads % ways:
            self.heads = self.kv_heads = ()
        elif kv_heads % ways == 0:
            self.kv_heads = self.heads
        elif kv_heads == 1:
            self.kv_heads = ()
        else:
            self.heads = self.kv_heads = ()

    def size(self, axes) -> int:
        return math.prod(self.mesh.shape[a] for a in axes)

    def spec(self, name):
        b, s, h, g = (_entry(x) for x in (self.batch, self.seq, self.heads, self.kv_heads))
        t = s if self.kv_seq else None
        specs = {
            "query": (b, s, h, None), "out": (b, s, h, None), "d_out": (b, s, h, None),
            "lse": (b, h, s), "d_lse": (b, h, s),
            "key": (b, t, g, None), "value": (b, t, g, None),
            "sinks": (h,), "q_segment_ids": (b, s), "kv_segment_ids": (b, t),
            "q_seq_lengths": (b,), "kv_seq_lengths": (b,), "cu_seqlens_q": (None,), "cu_seqlens_k": (None,),
            "t_query": (b, s, h, None), "t_key": (b, t, g, None), "t_value": (b, t, g, None), "t_sinks": (h,),
        }
        return NamedSharding(self.mesh, PartitionSpec(*specs[name]))

    def split(self) -> context_parallel.SequenceSplit:
        return context_parallel.SequenceSplit(
            axes=self.seq, num_shards=self.size(self.seq), strategy=self.strategy, kv_whole=not self.kv_seq,
            forward_p=attention_fwd_inner_p, backward_p=attention_bwd_inner_p, tangent_p=attention_tangent_inner_p)

    def splits_sequence(self, config: AttentionConfig) -> bool:
        """Whether the rows' positions differ from their local order (the context-parallel code runs)."""
        return bool(self.seq) or config.zigzag_shards is not None


# Shared by the three passes below: the one-shard split a zigzag order runs on (its rows must be
# reordered, so the context-parallel code runs even unsharded), and each operand's Shardy factors.
_UNSPLIT = dict(axes=(), num_shards=1, strategy="all_gather", kv_whole=True,
                forward_p=attention_fwd_inner_p, backward_p=attention_bwd_inner_p, tangent_p=attention_tangent_inner_p)

_FACTORS = {"query": "b s h d", "out": "b s h e", "d_out": "b s h e", "lse": "b h s", "d_lse": "b h s",
            "key": "b t g d", "value": "b t g e", "sinks": "h", "q_segment_ids": "b s",
            "kv_segment_ids": "b t", "q_seq_lengths": "b", "kv_seq_lengths": "b", "cu_seqlens_q": "n",
            "cu_seqlens_k": "n",
            "t_query": "b s h d", "t_key": "b t g d", "t_value": "b t g e", "t_sinks": "h"}


# ---------------------------------------------------------------------------------- forward and tangent

def _row_sharded(inner_p, sequence_split, operand_names):
    """The custom_partitioning of a pass whose results are (out, lse)-shaped rows sharded like the query:
    the forward, and the forward-mode tangent (the tangent of out and lse). Every row is its own
    shard's, so, unlike the backward, nothing sums over shards.

    inner_p: the single-device primitive; sequence_split(config, operands, split): the
    context-parallel (or zigzag) computation; operand_names(config): the operands, in order."""

    def run(config, operands, split):
        if split is None:
            return tuple(inner_p.bind(*operands, config=config))
        return tuple(sequence_split(config, operands, split))

    def shard(config, *operands):
        unsplit = context_parallel.SequenceSplit(**_UNSPLIT) if config.zigzag_shards is not None else None
        return run(config, operands, unsplit)

    def infer(config, mesh, arg_infos, result_infos):
        plan = _Plan(config, mesh, arg_infos[0], arg_infos[1])
        return plan.spec("out"), plan.spec("lse")

    def partition(config, mesh, arg_infos, result_infos):
        plan = _Plan(config, mesh, arg_infos[0], arg_infos[1])
        split = plan.split() if plan.splits_sequence(config) else None

        def lower(*operands):
            return run(config, operands, split)

        arg_shardings = tuple(plan.spec(n) for n in operand_names(config))
        return mesh, lower, (plan.spec("out"), plan.spec("lse")), arg_shardings

    def rule(config, mesh, operand_types, result_types):
        inputs = ", ".join(_FACTORS[n] for n in operand_names(config))
        return f"{inputs} -> {_FACTORS['out']}, {_FACTORS['lse']}"

    sharded = custom_partitioning(shard, static_argnums=(0,))
    sharded.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=rule)
    return sharded


def _tangent_split(config, operands, split):
    return context_parallel.tangent(config, operands, split, split_tangent_operands)


forward_sharded = _row_sharded(attention_fwd_inner_p, context_parallel.forward, forward_operand_names)
tangent_sharded = _row_sharded(attention_tangent_inner_p, _tangent_split, tangent_operand_names)


# --------------------------------------------------------------------------------------------- backward

def _backward_shard(config, has_d_lse, *operands):
    if config.zigzag_shards is not None:
        return tuple(context_parallel.backward(config, has_d_lse, operands,
                                               context_parallel.SequenceSplit(**_UNSPLIT), split_backward_operands))
    return tuple(attention_bwd_inner_p.bind(*operands, config=config, has_d_lse=has_d_lse))


def _backward_infer(config, has_d_lse, mesh, arg_infos, result_infos):
    plan = _Plan(config, mesh, arg_infos[0], arg_infos[1])
    return tuple(plan.spec(n) for n in gradient_names(config))


def _backward_partition(config, has_d_lse, mesh, arg_infos, result_infos):
    plan = _Plan(config, mesh, arg_infos[0], arg_infos[1])

    def lower(*operands):
        if plan.splits_sequence(config):
            grads = list(context_parallel.backward(config, has_d_lse, operands, plan.split(),
                                                   split_backward_operands))
        else:
            grads = list(attention_bwd_inner_p.bind(*operands, config=config, has_d_lse=has_d_lse))
        # dK / dV are partial sums when other shards used the same keys: row shards holding every key
        # (the context-parallel code has already summed split keys over them), and head shards
        # sharing a single replicated KV head (MQA).
        shared_kv = (() if plan.kv_seq else plan.seq) + tuple(a for a in plan.heads if a not in plan.kv_heads)
        if shared_kv:
            grads[1] = lax.psum(grads[1], shared_kv)
            grads[2] = lax.psum(grads[2], shared_kv)
        if config.has_sinks and (plan.batch or plan.seq):  # a sink's gradient sums over batch and rows
            grads[3] = lax.psum(grads[3], plan.batch + plan.seq)
        return tuple(grads)

    arg_shardings = tuple(plan.spec(n) for n in backward_operand_names(config, has_d_lse))
    result_shardings = tuple(plan.spec(n) for n in gradient_names(config))
    return mesh, lower, result_shardings, arg_shardings


def _backward_rule(config, has_d_lse, mesh, operand_types, result_types):
    inputs = ", ".join(_FACTORS[n] for n in backward_operand_names(config, has_d_lse))
    outputs = ", ".join(_FACTORS[n] for n in gradient_names(config))
    return f"{inputs} -> {outputs}"


backward_sharded = custom_partitioning(_backward_shard, static_argnums=(0, 1))
backward_sharded.def_partition(partition=_backward_partition, infer_sharding_from_operands=_backward_infer,
                               sharding_rule=_backward_rule)


# ------------------------------------------------------------------------------------------- lowering

# Inside shard_map (or pmap) with context_parallel_axis the operands are already a shard's slices: the
# sequence split runs here, each piece an outer primitive again that lowers through the rules above.

def _lower_forward(*operands, config):
    if config.context_parallel_axis:
        return split_forward(operands, config=config)
    return forward_sharded(config, *operands)


def _lower_backward(*operands, config, has_d_lse):
    if config.context_parallel_axis:
        return split_backward(operands, config=config, has_d_lse=has_d_lse)
    return backward_sharded(config, has_d_lse, *operands)


def _lower_tangent(*operands, config):
    if config.context_parallel_axis:
        return split_tangent(operands, config=config)
    return tangent_sharded(config, *operands)


mlir.register_lowering(attention_fwd_p, mlir.lower_fun(_lower_forward, multiple_results=True))
mlir.register_lowering(attention_bwd_p, mlir.lower_fun(_lower_backward, multiple_results=True))
mlir.register_lowering(attention_tangent_p, mlir.lower_fun(_lower_tangent, multiple_results=True))


def _mark_needs_devices():
    # custom_partitioning needs the device assignment while lowering; JAX knows this for its own
    # primitive but not for ours that lower into it. There is no public hook, so register if present.
    try:
        from jax._src import dispatch
    except ImportError:  # pragma: no cover - a future JAX without the module
        return
    registry = getattr(dispatch, "prim_requires_devices_during_lowering", None)
    if registry is not None:
        registry.update((attention_fwd_p, attention_bwd_p, attention_tangent_p))


_mark_needs_devices()
