"""Context parallelism: attention with the sequence axis split over devices, and the zigzag order.

A shard's rows (and keys) are *pieces*: runs of positions that are contiguous in the original order
(one per shard without zigzag; with `zigzag_shards=n` the sequence is 2n chunks and shard i of n holds
chunks i and 2n-1-i). Every per-shard call runs on one piece of rows against one run of keys, so the
kernels only ever see a contiguous block at a global offset (`q_start`, and for a ring step with
sequence lengths `kv_start`).

Two strategies, the same per-shard code under `jit` (the partition rules in fa4_jax/sharding.py call
`forward` / `backward` / `tangent` with the inner primitives) and over named axes given
`context_parallel_axis` (shard_map's, in the outer primitives' lowering, or a vmap's, in their batching
rule: fa4_jax/primitive.py calls them with the outer ones, `manual_split`):
- all_gather: gather K/V once, attend every row piece to all keys, reduce-scatter dK/dV.
- ring: K/V (and the kv segment ids) travel around the sequence axis with collective-permutes; each
  step attends the local rows to the visiting chunk (skipped when no key is visible, unmasked when all
  are) and merges the partial outputs by their LSE; the sinks enter once, in the final merge. The
  backward sends dK/dV along with their K/V, so after the last step they are back at their owner.
The forward-mode tangent takes the same route as the forward (its key tangents travel or are gathered
with the keys): given the saved global out and LSE it is a plain sum over key chunks (see `tangent`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fa4_jax.config import AttentionConfig

# The cost model of context_parallel=None: a ring step hides its K/V transfer behind its attention when
# the step's work per transferred byte is large enough. Per step a shard computes ~4·Sq_local·Sk_local·Hq·D
# flops and moves Sk_local·Hkv·(D+Dv) elements, a ratio that grows with Sq_local·Hq/Hkv; on an H100/H200
# (~0.5-1 PFLOP/s bf16 against ~0.4 TB/s per NVLink direction) it covers the transfer from about 2048.
# Below that the ring's n-1 small, serialised transfers cost more than one all-gather.
RING_MIN_ROWS_TIMES_GROUP = 2048


def choose_strategy(config: AttentionConfig, local_q_len: int, q_heads: int, kv_heads: int) -> str:
    if config.context_parallel is not None:
        return config.context_parallel
    return "ring" if local_q_len * (q_heads // kv_heads) >= RING_MIN_ROWS_TIMES_GROUP else "all_gather"


# --------------------------------------------------------------------------------------------- zigzag

def _zigzag_chunks(num_shards: int) -> np.ndarray:
    """Original chunk held at each stored chunk position: [0, 2n-1, 1, 2n-2, ...]."""
    return np.array([c for i in range(num_shards) for c in (i, 2 * num_shards - 1 - i)])


def check_zigzag(length: int, num_shards: int, what: str) -> None:
    if isinstance(num_shards, bool) or not isinstance(num_shards, (int, np.integer)) or num_shards < 1:
        raise ValueError(f"zigzag_shards (num_shards) must be a positive int; got {num_shards!r}.")
    if length % (2 * num_shards):
        raise ValueError(f"the zigzag order splits the {what} into 2 * {num_shards} = {2 * num_shards} equal "
                         f"chunks, but its length {length} is not a multiple of {2 * num_shards}; pad it to a "
                         "multiple (and pass q_seq_lengths / kv_seq_lengths for the padding).")


def _permute_chunks(x, num_shards: int, axis: int, order):
    # Static slices, not a gather with an index array: the partitioned lowering's per-shard function
    # may hold no array constants.
    axis = axis % x.ndim
    check_zigzag(x.shape[axis], num_shards, f"axis {axis}")
    chunk = x.shape[axis] // (2 * num_shards)
    return jnp.concatenate([_slice(x, axis, int(c) * chunk, chunk) for c in order], axis=axis)


def zigzag(x, num_shards: int, axis: int = 1):
    """The dual-chunk order of `x` along `axis` for `num_shards` shards: the axis is cut into 2n equal
    chunks and shard i (of n equal slices) gets chunks i and 2n-1-i, so causal work is equal per shard."""
    return _permute_chunks(jnp.asarray(x), num_shards, axis, _zigzag_chunks(num_shards))


def unzigzag(x, num_shards: int, axis: int = 1):
    """Inverse of `zigzag`: back to the original order."""
    return _permute_chunks(jnp.asarray(x), num_shards, axis, np.argsort(_zigzag_chunks(num_shards)))


# --------------------------------------------------------------------------------------------- pieces

@dataclasses.dataclass(frozen=True)
class Pieces:
    """One shard's slice of a sequence axis as `count` runs of `length` positions, each contiguous in
    the original order; `starts(shard)` gives their first global positions (int32 scalars)."""

    total: int
    num_shards: int
    zigzag_shards: Optional[int]
    length: int
    count: int

    def starts(self, shard) -> list:
        local = self.total // self.num_shards
        if self.zigzag_shards is None:
            return [(shard * local).astype(jnp.int32)]
        n = self.zigzag_shards
        # The original chunk at stored chunk position a (see _zigzag_chunks), as arithmetic on the
        # traced shard index.
        original = lambda a: jnp.where(a % 2 == 0, a // 2, 2 * n - 1 - a // 2).astype(jnp.int32)
        chunk_len = self.total // (2 * n)
        if self.count > 1 or self.length == chunk_len:  # whole chunks per shard
            return [original(shard * self.count + t) * chunk_len for t in range(self.count)]
        parts = chunk_len // self.length               # a chunk spread over several shards
        return [original(shard // parts) * chunk_len + (shard % parts) * self.length]


def pieces(total: int, num_shards: int, zigzag_shards: Optional[int], what: str) -> Pieces:
    if total % num_shards:
        raise ValueError(f"the {what} length {total} is not a multiple of the {num_shards} shards of the "
                         "sequence axis; pad it to a multiple (and pass q_seq_lengths / kv_seq_lengths for "
                         "the padding), or shard the sequence over fewer devices.")
    local = total // num_shards
    if zigzag_shards is None:
        return Pieces(total, num_shards, None, local, 1)
    check_zigzag(total, zigzag_shards, what)
    chunks = 2 * zigzag_shards
    chunk_len = total // chunks
    if chunks % num_shards == 0:
        return Pieces(total, num_shards, zigzag_shards, chunk_len, chunks // num_shards)
    if num_shards % chunks == 0 and chunk_len % (num_shards // chunks) == 0:
        return Pieces(total, num_shards, zigzag_shards, local, 1)
    raise ValueError(f"zigzag_shards={zigzag_shards} cuts the {what} into {chunks} chunks of {chunk_len}, which "
                     f"{num_shards} sequence shards of {local} do not split into whole chunks or equal parts of "
                     f"one; use zigzag_shards equal to the number of sequence shards ({num_shards}).")


def check_placement(config: AttentionConfig, query) -> None:
    """Raise the partition rule's ValueError up front for a concrete query already split on sequence.

    Under jit the split is known only when XLA partitions, where the same ValueError comes back
    wrapped in a JaxRuntimeError; an array in hand lets it be a plain ValueError here.
    """
    if config.context_parallel is None and config.zigzag_shards is None:
        return
    sharding = getattr(query, "sharding", None)
    if isinstance(query, jax.core.Tracer) or not isinstance(sharding, jax.sharding.NamedSharding):
        return
    spec = tuple(sharding.spec) + (None, None)
    axes = spec[1] if isinstance(spec[1], (tuple, list)) else (() if spec[1] is None else (spec[1],))
    num_shards = math.prod(sharding.mesh.shape[a] for a in axes)
    if num_shards > 1:
        pieces(query.shape[1], num_shards, config.zigzag_shards, "query")


# ---------------------------------------------------------------------------------------- the layout

@dataclasses.dataclass(frozen=True)
class SequenceSplit:
    """How this device holds the sequence: `axes` (mesh axes, may be empty) split it `num_shards` ways.

    kv_whole: K/V arrive whole (every key, in stored order) rather than as this shard's slice.
    forward_p / backward_p / tangent_p: what each per-shard call binds (inner primitives under the
    partition rule, outer ones inside shard_map, the pure-JAX reference for second derivatives).
    """

    axes: tuple
    num_shards: int
    strategy: str
    kv_whole: bool
    forward_p: object
    backward_p: object
    tangent_p: object = None

    def index(self):
        index = jnp.int32(0)
        for axis in self.axes:
            index = index * lax.axis_size(axis) + lax.axis_index(axis)
        return index

    def axis_name(self):
        return self.axes[0] if len(self.axes) == 1 else self.axes

    def rotate(self, tree):
        """Send to the next shard along the sequence axis (shard d receives from d-1)."""
        perm = [(j, (j + 1) % self.num_shards) for j in range(self.num_shards)]
        return lax.ppermute(tree, self.axis_name(), perm)


def manual_split(config: AttentionConfig, query, key, forward_p, backward_p, tangent_p) -> SequenceSplit:
    """The sequence split over `context_parallel_axis`, named axes (shard_map's, pmap's or a vmap's)
    of which the local q/k/v are slices: the collectives name the axes directly."""
    axes = config.context_parallel_axis
    strategy = choose_strategy(config, query.shape[1], query.shape[2], key.shape[2])
    return SequenceSplit(axes=axes, num_shards=math.prod(lax.axis_size(a) for a in axes), strategy=strategy,
                         kv_whole=False, forward_p=forward_p, backward_p=backward_p, tangent_p=tangent_p)


def _varying_like(like, value):
    """`value` typed to vary over the same manual mesh axes as `like` (so both branches of a lax.switch
    inside shard_map have one type); the identity elsewhere."""
    want = jax.typeof(like).manual_axis_type.varying
    missing = want - jax.typeof(value).manual_axis_type.varying
    return lax.pcast(value, tuple(sorted(missing, key=str)), to="varying") if missing else value


def _full(like, shape, dtype, fill):
    return _varying_like(like, jnp.full(shape, fill, dtype))


def _slice(x, axis, start, length):
    return lax.slice_in_dim(x, start, start + length, axis=axis)


class _Problem:
    """The global shapes and the operands of one call, split into the query side and the key side."""

    def __init__(self, config: AttentionConfig, query, key, value, optional, split: SequenceSplit):
        self.config = config
        self.query, self.key, self.value = query, key, value
        self.optional = optional
        m = split.num_shards
        self.q_total = query.shape[1] * m
        self.kv_total = key.shape[1] * (1 if split.kv_whole else m)
        self.batch, self.q_heads = query.shape[0], query.shape[2]
        self.v_head_dim = value.shape[-1]
        self.q_pieces = pieces(self.q_total, m, config.zigzag_shards, "query")
        self.kv_pieces = pieces(self.kv_total, 1 if split.kv_whole else m, config.zigzag_shards, "key/value")

    def diagonal_offsets(self):
        """off = kv_valid - q_valid per batch element ([B] int32), or the scalar kv_total - q_total."""
        if not (self.config.has_q_seq_lengths or self.config.has_kv_seq_lengths):
            return jnp.int32(self.kv_total - self.q_total)
        q_valid = self.optional.get("q_seq_lengths", jnp.full((self.batch,), self.q_total, jnp.int32))
        kv_valid = self.optional.get("kv_seq_lengths", jnp.full((self.batch,), self.kv_total, jnp.int32))
        return kv_valid - q_valid


def _piece_config(problem: _Problem, config: AttentionConfig, row_start, key_start, key_len, with_sinks):
    """(config, position operands) for rows at global row_start against keys at key_start (None: all
    keys, in order). Only positions the mask reads are passed."""
    config = config.replace(context_parallel=None, zigzag_shards=None, context_parallel_axis=None,
                            has_sinks=with_sinks, has_q_start=False, q_total=None, has_kv_start=False,
                            kv_total=None)
    if not config.needs_positions:
        return config, {}
    operand = lambda position: jnp.asarray(position, jnp.int32).reshape(1)
    if key_start is None:
        return (config.replace(has_q_start=True, q_total=problem.q_total), {"q_start": operand(row_start)})
    if not (config.has_q_seq_lengths or config.has_kv_seq_lengths):
        # Without lengths only the diagonal matters, row + off - key: the key offset folds into q_start
        # (local row i sits at key i + q_start + key_len - q_total), which the kernels take.
        shift = row_start - key_start + problem.kv_total - key_len
        return config.replace(has_q_start=True, q_total=problem.q_total), {"q_start": operand(shift)}
    return (config.replace(has_q_start=True, q_total=problem.q_total, has_kv_start=True,
                           kv_total=problem.kv_total),
            {"q_start": operand(row_start), "kv_start": operand(key_start)})


def _visibility(problem: _Problem, row_start, row_len, key_start, key_len):
    """0: no key of the block is visible to any row, 1: every key to every row as far as causal and
    window go (lengths and segments still apply), 2: partly (the full mask)."""
    config = problem.config
    off = problem.diagonal_offsets()
    first_diag, last_diag = row_start + off, row_start + row_len - 1 + off
    first_key, last_key = key_start, key_start + key_len - 1
    right = 0 if config.causal else None
    if config.window_right is not None:
        right = config.window_right if right is None else min(right, config.window_right)
    left = config.window_left
    invisible = jnp.zeros_like(off, dtype=bool)
    full = jnp.ones_like(off, dtype=bool)
    if right is not None:
        invisible |= first_key > last_diag + right
        full &= last_key <= first_diag + right
    if left is not None:
        invisible |= last_key < first_diag - left
        full &= first_key >= last_diag - left
    return jnp.where(jnp.all(invisible), 0, jnp.where(jnp.all(full), 1, 2))


def _without_positional_mask(config: AttentionConfig) -> AttentionConfig:
    return config.replace(causal=False, window_left=None, window_right=None)


# -------------------------------------------------------------------------------------------- forward

def _call_forward(split, problem, config, q, k, v, q_side, kv_side, row_start, key_start, with_sinks):
    piece_config, positions = _piece_config(problem, config, row_start, key_start, k.shape[1], with_sinks)
    optional = dict(q_side, **kv_side, **positions)
    if with_sinks:
        optional["sinks"] = problem.optional["sinks"]
    operands = piece_config.join_operands(q, k, v, optional)
    return tuple(split.forward_p.bind(*operands, config=piece_config))


def _query_side(problem, start, length):
    """The query-side optional operands of rows [start, start + length) of this shard."""
    side = {}
    if problem.config.has_segment_ids:
        side["q_segment_ids"] = _slice(problem.optional["q_segment_ids"], 1, start, length)
    for name in ("q_seq_lengths", "kv_seq_lengths"):
        if name in problem.optional:
            side[name] = problem.optional[name]
    return side


def _merge(partials, sinks_grouped=None):
    """(out, lse) of the union of key sets from the partial (out, lse) over each; sinks [1, Hq, 1]
    enter once. Rows that saw no key anywhere keep out 0 and lse -inf (or the sink)."""
    lses = [lse for _, lse in partials]
    if sinks_grouped is not None:
        lses.append(jnp.broadcast_to(sinks_grouped, lses[0].shape))
    top = lses[0]
    for lse in lses[1:]:
        top = jnp.maximum(top, lse)
    shift = jnp.where(jnp.isfinite(top), top, 0.0)
    weights = [jnp.exp(lse - shift) for lse in lses]
    total = sum(weights)
    lse = jnp.where(total > 0, shift + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
    scale = lambda w: jnp.where(total > 0, w / jnp.where(total > 0, total, 1.0), 0.0)
    out = sum(out.astype(jnp.float32) * jnp.swapaxes(scale(w), 1, 2)[..., None]
              for (out, _), w in zip(partials, weights))
    return out, lse


def _unzigzag_operands(query, key, value, optional, n):
    query, key, value = (unzigzag(x, n) for x in (query, key, value))
    optional = dict(optional)
    for name in ("q_segment_ids", "kv_segment_ids"):
        if name in optional:
            optional[name] = unzigzag(optional[name], n)
    return query, key, value, optional


def forward(config: AttentionConfig, operands, split: SequenceSplit):
    """This shard's (out, lse) of a sequence-split attention (or a zigzag-ordered one on one shard)."""
    query, key, value, optional = config.split_operands(operands)
    n = config.zigzag_shards
    if split.num_shards == 1:
        local = config.replace(context_parallel=None, zigzag_shards=None, context_parallel_axis=None)
        if n is not None:
            query, key, value, optional = _unzigzag_operands(query, key, value, optional, n)
        out, lse = split.forward_p.bind(*local.join_operands(query, key, value, optional), config=local)
        return (out, lse) if n is None else (zigzag(out, n), zigzag(lse, n, axis=2))
    problem = _Problem(config, query, key, value, optional, split)
    if split.strategy == "all_gather":
        return _forward_all_gather(split, problem)
    return _forward_ring(split, problem)


def _all_keys(split, problem, x):
    """A key-side array of this shard (sequence on axis 1) with every key, in the original order."""
    if not split.kv_whole:
        x = lax.all_gather(x, split.axis_name(), axis=1, tiled=True)
    n = problem.config.zigzag_shards
    return x if n is None else unzigzag(x, n)


def _gathered_keys(split, problem):
    """(key, value, kv-side optional operands): every key in the original order."""
    kv_side = {"kv_segment_ids": problem.optional["kv_segment_ids"]} if problem.config.has_segment_ids else {}
    return (_all_keys(split, problem, problem.key), _all_keys(split, problem, problem.value),
            {k: _all_keys(split, problem, x) for k, x in kv_side.items()})


def _forward_all_gather(split, problem):
    key, value, kv_side = _gathered_keys(split, problem)
    qp = problem.q_pieces
    outs, lses = [], []
    for t, row_start in enumerate(qp.starts(split.index())):
        q = _slice(problem.query, 1, t * qp.length, qp.length)
        out, lse = _call_forward(split, problem, problem.config, q, key, value,
                                 _query_side(problem, t * qp.length, qp.length), kv_side, row_start, None,
                                 problem.config.has_sinks)
        outs.append(out)
        lses.append(lse)
    return jnp.concatenate(outs, axis=1), jnp.concatenate(lses, axis=2)


def _kv_travellers(problem):
    travellers = {"key": problem.key, "value": problem.value}
    if problem.config.has_segment_ids:
        travellers["kv_segment_ids"] = problem.optional["kv_segment_ids"]
    return travellers


def _ring_pairs(split, problem, step, shard):
    """(row piece t, its local start, row_start, key piece u, its local start, key_start) visited at step."""
    qp, kp = problem.q_pieces, problem.kv_pieces
    source = (shard - step) % split.num_shards
    key_starts = kp.starts(source)
    for t, row_start in enumerate(qp.starts(shard)):
        for u, key_start in enumerate(key_starts):
            yield t, t * qp.length, row_start, u * kp.length, key_start


def _step_branches(problem, call, skip, row_start, row_len, key_start, key_len):
    """Run `call(config)` for one (rows, keys) block: skipped, unmasked or masked by visibility."""
    config = problem.config
    if not (config.causal or config.has_window):
        return call(config)
    case = _visibility(problem, row_start, row_len, key_start, key_len)
    return lax.switch(case, [lambda: skip(), lambda: call(_without_positional_mask(config)), lambda: call(config)])


def _forward_ring(split, problem):
    qp, kp = problem.q_pieces, problem.kv_pieces
    shard = split.index()
    partials = [[] for _ in range(qp.count)]
    travellers = _kv_travellers(problem)
    for step in range(split.num_shards):
        # Issue the next transfer before this step's attention, which does not depend on it, so that
        # the scheduler can overlap the two.
        arriving = split.rotate(travellers) if step + 1 < split.num_shards else None
        for t, q_offset, row_start, k_offset, key_start in _ring_pairs(split, problem, step, shard):
            q = _slice(problem.query, 1, q_offset, qp.length)
            k = _slice(travellers["key"], 1, k_offset, kp.length)
            v = _slice(travellers["value"], 1, k_offset, kp.length)
            kv_side = ({"kv_segment_ids": _slice(travellers["kv_segment_ids"], 1, k_offset, kp.length)}
                       if problem.config.has_segment_ids else {})
            q_side = _query_side(problem, q_offset, qp.length)

            def call(config, q=q, k=k, v=v, q_side=q_side, kv_side=kv_side, row_start=row_start,
                     key_start=key_start):
                return _call_forward(split, problem, config, q, k, v, q_side, kv_side, row_start, key_start,
                                     False)

            def skip(q=q):
                return (_full(q, (problem.batch, qp.length, problem.q_heads, problem.v_head_dim), q.dtype, 0),
                        _full(q, (problem.batch, problem.q_heads, qp.length), jnp.float32, -jnp.inf))

            partials[t].append(_step_branches(problem, call, skip, row_start, qp.length, key_start, kp.length))
        travellers = arriving
    sinks = problem.optional["sinks"].reshape(1, -1, 1) if problem.config.has_sinks else None
    merged = [_merge(p, sinks) for p in partials]
    out = jnp.concatenate([o for o, _ in merged], axis=1).astype(problem.query.dtype)
    return out, jnp.concatenate([lse for _, lse in merged], axis=2)


# ------------------------------------------------------------------------------------------- backward

def backward(config: AttentionConfig, has_d_lse: bool, operands, split: SequenceSplit, split_backward):
    """This shard's gradients (dq, dk, dv[, dsinks]). dK/dV are this shard's own (summed over every
    shard that used them) unless split.kv_whole, when they are this shard's partial sums over every key;
    dsinks is this shard's partial sum (the caller sums it over the shards)."""
    (query, key, value, out, lse, d_out), d_lse, optional = split_backward(config, has_d_lse, operands)
    n = config.zigzag_shards
    if split.num_shards == 1:
        local = config.replace(context_parallel=None, zigzag_shards=None, context_parallel_axis=None)
        if n is not None:
            query, key, value, optional = _unzigzag_operands(query, key, value, optional, n)
            out, d_out = unzigzag(out, n), unzigzag(d_out, n)
            lse = unzigzag(lse, n, axis=2)
            d_lse = None if d_lse is None else unzigzag(d_lse, n, axis=2)
        grads = _bind_backward(split, local, query, key, value, out, lse, d_out, d_lse, optional)
        if n is not None:
            grads = [zigzag(g, n) for g in grads[:3]] + list(grads[3:])
        return tuple(grads)
    problem = _Problem(config, query, key, value, optional, split)
    cotangents = (out, lse, d_out, d_lse)
    if split.strategy == "all_gather":
        return _backward_all_gather(split, problem, cotangents)
    return _backward_ring(split, problem, cotangents)


def _bind_backward(split, config, query, key, value, out, lse, d_out, d_lse, optional):
    operands = (query, key, value, out, lse, d_out) + ((d_lse,) if d_lse is not None else ())
    operands += tuple(optional[name] for name in config.present_operands())
    return list(split.backward_p.bind(*operands, config=config, has_d_lse=d_lse is not None))


def _row_slices(cotangents, start, length):
    out, lse, d_out, d_lse = cotangents
    return (_slice(out, 1, start, length), _slice(lse, 2, start, length), _slice(d_out, 1, start, length),
            None if d_lse is None else _slice(d_lse, 2, start, length))


def _call_backward(split, problem, config, q, k, v, rows, q_side, kv_side, row_start, key_start, with_sinks):
    piece_config, positions = _piece_config(problem, config, row_start, key_start, k.shape[1], with_sinks)
    optional = dict(q_side, **kv_side, **positions)
    if with_sinks:
        optional["sinks"] = problem.optional["sinks"]
    out, lse, d_out, d_lse = rows
    return _bind_backward(split, piece_config, q, k, v, out, lse, d_out, d_lse, optional)


def _backward_all_gather(split, problem, cotangents):
    key, value, kv_side = _gathered_keys(split, problem)
    qp = problem.q_pieces
    has_sinks = problem.config.has_sinks
    d_queries, d_key, d_value, d_sinks = [], 0, 0, 0
    for t, row_start in enumerate(qp.starts(split.index())):
        start = t * qp.length
        q = _slice(problem.query, 1, start, qp.length)
        grads = _call_backward(split, problem, problem.config, q, key, value,
                               _row_slices(cotangents, start, qp.length), _query_side(problem, start, qp.length),
                               kv_side, row_start, None, has_sinks)
        d_queries.append(grads[0])
        d_key, d_value = d_key + grads[1].astype(jnp.float32), d_value + grads[2].astype(jnp.float32)
        if has_sinks:
            d_sinks = d_sinks + grads[3]
    n = problem.config.zigzag_shards
    if n is not None:
        d_key, d_value = zigzag(d_key, n), zigzag(d_value, n)
    if not split.kv_whole:
        scatter = lambda x: lax.psum_scatter(x, split.axis_name(), scatter_dimension=1, tiled=True)
        d_key, d_value = scatter(d_key), scatter(d_value)
    grads = [jnp.concatenate(d_queries, axis=1), d_key.astype(problem.key.dtype),
             d_value.astype(problem.value.dtype)]
    return tuple(grads + ([d_sinks] if has_sinks else []))


def _sink_gradient(problem, out, lse, d_out, d_lse):
    """d sink_h = -Σ_rows exp(sink_h - lse) δ, δ = rowsum(dO ∘ O) - dLSE (lse includes the sink)."""
    delta = jnp.einsum("bqhe,bqhe->bhq", out.astype(jnp.float32), d_out.astype(jnp.float32))
    if d_lse is not None:
        delta = delta - d_lse.astype(jnp.float32)
    sinks = problem.optional["sinks"].reshape(1, -1, 1)
    p_sink = jnp.exp(sinks - jnp.where(jnp.isfinite(lse), lse, jnp.inf))
    return -(p_sink * delta).sum(axis=(0, 2)).astype(problem.optional["sinks"].dtype)


def _backward_ring(split, problem, cotangents):
    qp, kp = problem.q_pieces, problem.kv_pieces
    shard = split.index()
    d_queries = [0.0] * qp.count
    travellers = _kv_travellers(problem)
    # dK/dV travel in float32 with their K/V: every shard adds its part on the way round.
    d_travellers = {"key": _full(problem.key, problem.key.shape, jnp.float32, 0),
                    "value": _full(problem.value, problem.value.shape, jnp.float32, 0)}
    for step in range(split.num_shards):
        arriving = split.rotate(travellers) if step + 1 < split.num_shards else None
        d_key_parts = [0.0] * kp.count
        d_value_parts = [0.0] * kp.count
        for t, q_offset, row_start, k_offset, key_start in _ring_pairs(split, problem, step, shard):
            q = _slice(problem.query, 1, q_offset, qp.length)
            k = _slice(travellers["key"], 1, k_offset, kp.length)
            v = _slice(travellers["value"], 1, k_offset, kp.length)
            kv_side = ({"kv_segment_ids": _slice(travellers["kv_segment_ids"], 1, k_offset, kp.length)}
                       if problem.config.has_segment_ids else {})
            rows = _row_slices(cotangents, q_offset, qp.length)
            q_side = _query_side(problem, q_offset, qp.length)

            def call(config, q=q, k=k, v=v, rows=rows, q_side=q_side, kv_side=kv_side, row_start=row_start,
                     key_start=key_start):
                return tuple(_call_backward(split, problem, config, q, k, v, rows, q_side, kv_side, row_start,
                                            key_start, False))

            def skip(q=q, k=k, v=v):
                return tuple(_full(x, x.shape, x.dtype, 0) for x in (q, k, v))

            d_q, d_k, d_v = _step_branches(problem, call, skip, row_start, qp.length, key_start, kp.length)
            u = k_offset // kp.length
            d_queries[t] = d_queries[t] + d_q.astype(jnp.float32)
            d_key_parts[u] = d_key_parts[u] + d_k.astype(jnp.float32)
            d_value_parts[u] = d_value_parts[u] + d_v.astype(jnp.float32)
        d_travellers = {"key": d_travellers["key"] + jnp.concatenate(d_key_parts, axis=1),
                        "value": d_travellers["value"] + jnp.concatenate(d_value_parts, axis=1)}
        # After num_shards sends the gradients are back with the shard that owns their K/V.
        d_travellers = split.rotate(d_travellers)
        travellers = arriving
    grads = [jnp.concatenate(d_queries, axis=1).astype(problem.query.dtype),
             d_travellers["key"].astype(problem.key.dtype), d_travellers["value"].astype(problem.value.dtype)]
    if problem.config.has_sinks:
        out, lse, d_out, d_lse = cotangents
        grads.append(_sink_gradient(problem, out, lse, d_out, d_lse))
    return tuple(grads)


# -------------------------------------------------------------------------------------------- tangent
# The forward-mode tangent from the saved out O and LSE (global: those of every key) is a sum over key
# chunks. With P = exp(S - lse) and t_S the logits' tangent, one chunk's call gives
# t_out_c = P_c·t_v + (P_c∘t_S_c)·V_c - t_row_c∘O and t_lse_c = t_row_c = rowsum(P_c∘t_S_c); the sum over
# chunks is the whole tangent, t_out = Σ t_out_c, t_lse = Σ t_lse_c, because the one term not local to a
# chunk, -t_lse∘O, is linear in t_lse. No merge by LSE is needed (unlike the forward), and the sinks'
# term (P_sink·t_sink in t_lse, so -P_sink·t_sink∘O in t_out) enters once, after the ring.

def tangent(config: AttentionConfig, operands, split: SequenceSplit, split_tangent):
    """This shard's (t_out, t_lse): the tangent of `forward`'s (out, lse), linear in the tangents."""
    (query, key, value, out, lse), (t_query, t_key, t_value, t_sinks), optional = split_tangent(config, operands)
    n = config.zigzag_shards
    if split.num_shards == 1:
        local = config.replace(context_parallel=None, zigzag_shards=None, context_parallel_axis=None)
        if n is not None:
            query, key, value, optional = _unzigzag_operands(query, key, value, optional, n)
            out, t_query, t_key, t_value = (unzigzag(x, n) for x in (out, t_query, t_key, t_value))
            lse = unzigzag(lse, n, axis=2)
        t_out, t_lse = _bind_tangent(split, local, query, key, value, (out, lse, t_query), t_key, t_value,
                                     t_sinks, optional)
        return (t_out, t_lse) if n is None else (zigzag(t_out, n), zigzag(t_lse, n, axis=2))
    problem = _Problem(config, query, key, value, optional, split)
    rows = (out, lse, t_query)
    if split.strategy == "all_gather":
        return _tangent_all_gather(split, problem, rows, t_key, t_value, t_sinks)
    return _tangent_ring(split, problem, rows, t_key, t_value, t_sinks)


def _bind_tangent(split, config, query, key, value, rows, t_key, t_value, t_sinks, optional):
    out, lse, t_query = rows
    operands = (query, key, value, out, lse, t_query, t_key, t_value) + ((t_sinks,) if config.has_sinks else ())
    operands += tuple(optional[name] for name in config.present_operands())
    return tuple(split.tangent_p.bind(*operands, config=config))


def _tangent_rows(rows, start, length):
    out, lse, t_query = rows
    return _slice(out, 1, start, length), _slice(lse, 2, start, length), _slice(t_query, 1, start, length)


def _call_tangent(split, problem, config, q, k, v, rows, t_k, t_v, t_sinks, q_side, kv_side, row_start,
                  key_start, with_sinks):
    piece_config, positions = _piece_config(problem, config, row_start, key_start, k.shape[1], with_sinks)
    optional = dict(q_side, **kv_side, **positions)
    if with_sinks:
        optional["sinks"] = problem.optional["sinks"]
    return _bind_tangent(split, piece_config, q, k, v, rows, t_k, t_v, t_sinks if with_sinks else None, optional)


def _tangent_all_gather(split, problem, rows, t_key, t_value, t_sinks):
    key, value, kv_side = _gathered_keys(split, problem)
    t_key, t_value = _all_keys(split, problem, t_key), _all_keys(split, problem, t_value)
    qp = problem.q_pieces
    t_outs, t_lses = [], []
    for t, row_start in enumerate(qp.starts(split.index())):
        start = t * qp.length
        q = _slice(problem.query, 1, start, qp.length)
        t_out, t_lse = _call_tangent(split, problem, problem.config, q, key, value,
                                     _tangent_rows(rows, start, qp.length), t_key, t_value, t_sinks,
                                     _query_side(problem, start, qp.length), kv_side, row_start, None,
                                     problem.config.has_sinks)
        t_outs.append(t_out)
        t_lses.append(t_lse)
    return jnp.concatenate(t_outs, axis=1), jnp.concatenate(t_lses, axis=2)


def _tangent_ring(split, problem, rows, t_key, t_value, t_sinks):
    qp, kp = problem.q_pieces, problem.kv_pieces
    shard = split.index()
    t_outs, t_lses = [0.0] * qp.count, [0.0] * qp.count
    # The key tangents travel with their keys.
    travellers = dict(_kv_travellers(problem), t_key=t_key, t_value=t_value)
    for step in range(split.num_shards):
        arriving = split.rotate(travellers) if step + 1 < split.num_shards else None
        for t, q_offset, row_start, k_offset, key_start in _ring_pairs(split, problem, step, shard):
            q = _slice(problem.query, 1, q_offset, qp.length)
            k, v, t_k, t_v = (_slice(travellers[name], 1, k_offset, kp.length)
                              for name in ("key", "value", "t_key", "t_value"))
            kv_side = ({"kv_segment_ids": _slice(travellers["kv_segment_ids"], 1, k_offset, kp.length)}
                       if problem.config.has_segment_ids else {})
            piece_rows = _tangent_rows(rows, q_offset, qp.length)
            q_side = _query_side(problem, q_offset, qp.length)

            def call(config, q=q, k=k, v=v, piece_rows=piece_rows, t_k=t_k, t_v=t_v, q_side=q_side, kv_side=kv_side,
                     row_start=row_start, key_start=key_start):
                return _call_tangent(split, problem, config, q, k, v, piece_rows, t_k, t_v, None, q_side, kv_side,
                                     row_start, key_start, False)

            def skip(q=q):
                return (_full(q, (problem.batch, qp.length, problem.q_heads, problem.v_head_dim), q.dtype, 0),
                        _full(q, (problem.batch, problem.q_heads, qp.length), jnp.float32, 0))

            t_out, t_lse = _step_branches(problem, call, skip, row_start, qp.length, key_start, kp.length)
            t_outs[t] = t_outs[t] + t_out.astype(jnp.float32)
            t_lses[t] = t_lses[t] + t_lse
        travellers = arriving
    t_out, t_lse = jnp.concatenate(t_outs, axis=1), jnp.concatenate(t_lses, axis=2)
    if problem.config.has_sinks:
        out, lse, _ = rows
        sinks = problem.optional["sinks"].astype(jnp.float32).reshape(1, -1, 1)
        # exp(sink - lse), 0 on rows whose lse is -inf (they saw neither key nor sink).
        sink_term = jnp.exp(sinks - jnp.where(jnp.isfinite(lse), lse, jnp.inf)) * t_sinks.astype(
            jnp.float32).reshape(1, -1, 1)
        t_lse = t_lse + sink_term
        t_out = t_out - jnp.swapaxes(sink_term, 1, 2)[..., None] * out.astype(jnp.float32)
    return t_out.astype(problem.query.dtype), t_lse
