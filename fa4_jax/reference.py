"""Pure-JAX attention: the semantic definition, the oracle of every kernel test, and the CPU/TPU path.

Memory-efficient: both passes walk the keys in blocks with an online softmax (forward) or with the
saved log-sum-exp (backward), so memory is O(S·D) plus one [Sq, block] tile, never O(Sq·Sk).
Everything accumulates in float32 at the highest matmul precision (the reference must not use TF32 on
GPUs: it is what the kernels are measured against).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from fa4_jax.config import AttentionConfig

KEY_BLOCK = 256
_HIGHEST = lax.Precision.HIGHEST


def _einsum(spec, *operands):
    return jnp.einsum(spec, *operands, precision=_HIGHEST, preferred_element_type=jnp.float32)


class _Layout:
    """Shapes of one call and the grouped-query view [B, S, Hkv, G, D] of the query heads."""

    def __init__(self, query, key, value, config: AttentionConfig):
        self.batch, self.q_len, self.q_heads, self.head_dim = query.shape
        _, self.kv_len, self.kv_heads, _ = key.shape
        self.v_head_dim = value.shape[-1]
        self.group = self.q_heads // self.kv_heads
        self.q_total = config.q_total if config.q_total is not None else self.q_len
        self.kv_total = config.kv_total if config.kv_total is not None else self.kv_len
        self.block = min(KEY_BLOCK, self.kv_len)
        self.num_blocks = -(-self.kv_len // self.block)
        self.padded_kv_len = self.num_blocks * self.block

    def group_query(self, x):
        """[B, Sq, Hq, ...] -> [B, Sq, Hkv, G, ...]."""
        return x.reshape(x.shape[:2] + (self.kv_heads, self.group) + x.shape[3:])

    def ungroup_query(self, x):
        return x.reshape(x.shape[:2] + (self.q_heads,) + x.shape[4:])


def _logits(scaled_q, k_block, config: AttentionConfig):
    """Scaled (and soft-capped) logits [B, Hkv, G, Sq, blk] and tanh(·/c) for the softcap chain rule.

    The scale is applied to the query beforehand, so that a logit is the product's result itself: a
    product times the scale could be evaluated twice, once rounded (for the row maximum) and once fused
    into `logit - maximum` (an FMA, as XLA does on the CPU), and for logits above ~1e9 the two differ
    by more than exp can take (NaN or 0 outputs).
    """
    s = _einsum("bqhgd,bkhd->bhgqk", scaled_q, k_block)
    if config.softcap is None:
        return s, None
    t = jnp.tanh(s / config.softcap)
    return config.softcap * t, t


def _blocked_keys(layout: _Layout, *arrays):
    """Pad along the key axis to whole blocks and move the block index first: [nb, B, blk, ...]."""
    pad = layout.padded_kv_len - layout.kv_len
    out = []
    for x in arrays:
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape((x.shape[0], layout.num_blocks, layout.block) + x.shape[2:])
        out.append(jnp.moveaxis(x, 1, 0))
    return out


def _key_scan_inputs(layout, optional, key, value):
    k_blocks, v_blocks = _blocked_keys(layout, key, value)
    seg_blocks = None
    if "kv_segment_ids" in optional:
        (seg_blocks,) = _blocked_keys(layout, optional["kv_segment_ids"])
    return jnp.arange(layout.num_blocks, dtype=jnp.int32), k_blocks, v_blocks, seg_blocks


def _scan_blocks(step, init, blocks):
    """lax.scan over key blocks, with the first block peeled off: the carry then takes its type from
    the data, so inside shard_map it varies over the same mesh axes as the inputs do."""
    carry, first = step(init, jax.tree.map(lambda x: x[0], blocks))
    carry, rest = lax.scan(step, carry, jax.tree.map(lambda x: x[1:], blocks))
    return carry, jax.tree.map(lambda a, b: jnp.concatenate([a[None], b]), first, rest)


def _sequence_of(cu_seqlens, positions, outside: int):
    """The packed sequence index of each token position; `outside` for a position before cu_seqlens[0]
    or at / past cu_seqlens[-1] (only malformed offsets leave such tokens: they see nothing and are
    seen by no row, since the query and key sentinels differ). An empty sequence b has
    cu[b] == cu[b + 1] and owns no position, which searchsorted's right side gives for free."""
    index = jnp.searchsorted(cu_seqlens, positions, side="right").astype(jnp.int32) - 1
    inside = (positions >= cu_seqlens[0]) & (positions < cu_seqlens[-1])
    return jnp.where(inside, index, outside)


def _packed_visibility(layout: _Layout, optional, rows, keys):
    """(visible, diagonal) [1, Sq, blk] / [1, Sq, 1] for packed sequences: a row sees only its own
    sequence's keys, and row t of sequence b sits at key position t + (cu_k[b+1] - cu_q[b+1]), which is
    its local row plus that sequence's len_k - len_q (bottom-right alignment per sequence)."""
    cu_q, cu_k = optional["cu_seqlens_q"], optional["cu_seqlens_k"]
    q_sequence = _sequence_of(cu_q, rows, outside=-1)
    k_sequence = _sequence_of(cu_k, keys, outside=-2)
    shift = (cu_k[1:] - cu_q[1:])[jnp.clip(q_sequence, 0, cu_q.shape[0] - 2)]
    visible = (q_sequence == k_sequence) & (keys < layout.kv_len)
    return visible, rows + shift


def _block_mask(layout: _Layout, config: AttentionConfig, optional, block_index, kv_segment_block):
    """Boolean [B, 1, 1, Sq, blk]: may query row i attend to key j of this key block?"""
    local_keys = (block_index * layout.block + jnp.arange(layout.block, dtype=jnp.int32))[None, None, :]
    if "cu_seqlens_q" in optional:
        rows = jnp.arange(layout.q_len, dtype=jnp.int32)[None, :, None]
        visible, diagonal = _packed_visibility(layout, optional, rows, local_keys)
        return _positional_mask(config, visible, local_keys, diagonal)[:, None, None, :, :]
    keys = local_keys
    if "kv_start" in optional:
        keys = keys + optional["kv_start"].reshape(()).astype(jnp.int32)
    rows = jnp.arange(layout.q_len, dtype=jnp.int32)
    if "q_start" in optional:
        rows = rows + optional["q_start"].reshape(()).astype(jnp.int32)
    rows = rows[None, :, None]
    full = lambda n: jnp.full((layout.batch,), n, jnp.int32)
    q_valid = optional.get("q_seq_lengths", full(layout.q_total)).astype(jnp.int32)[:, None, None]
    kv_valid = optional.get("kv_seq_lengths", full(layout.kv_total)).astype(jnp.int32)[:, None, None]
    visible = (keys < kv_valid) & (local_keys < layout.kv_len)
    # Every local row exists; only query lengths hide rows. (Without them q_start may be a pure shift
    # of the diagonal, as the context-parallel code passes it, and then need not lie below q_total.)
    if "q_seq_lengths" in optional:
        visible &= rows < q_valid
    diagonal = rows + (kv_valid - q_valid)  # the key position each query row is aligned with
    visible = _positional_mask(config, visible, keys, diagonal)
    if kv_segment_block is not None:
        visible &= optional["q_segment_ids"][:, :, None] == kv_segment_block[:, None, :]
    return visible[:, None, None, :, :]


def _positional_mask(config: AttentionConfig, visible, keys, diagonal):
    """`visible` narrowed by causal and the window around each row's diagonal key position."""
    if config.causal:
        visible &= keys <= diagonal
    if config.window_left is not None:
        visible &= keys >= diagonal - config.window_left
    if config.window_right is not None:
        visible &= keys <= diagonal + config.window_right
    return visible


def reference_forward(query, key, value, optional, config: AttentionConfig):
    """(out [B, Sq, Hq, Dv] in query dtype, lse [B, Hq, Sq] float32)."""
    layout = _Layout(query, key, value, config)
    scaled_q = layout.group_query(query.astype(jnp.float32)) * config.scale
    blocks = _key_scan_inputs(layout, optional, key.astype(jnp.float32), value.astype(jnp.float32))
    stats_shape = (layout.batch, layout.kv_heads, layout.group, layout.q_len)

    def step(carry, block):
        row_max, row_sum, acc = carry
        index, k_block, v_block, seg_block = block
        s, _ = _logits(scaled_q, k_block, config)
        visible = _block_mask(layout, config, optional, index, seg_block)
        s = jnp.where(visible, s, -jnp.inf)
        new_max = jnp.maximum(row_max, s.max(axis=-1))
        # A row that has seen no visible key yet keeps max -inf; shift by 0 so exp gives 0, not NaN.
        shift = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
        p = jnp.exp(s - shift[..., None])
        correction = jnp.exp(row_max - shift)
        row_sum = row_sum * correction + p.sum(axis=-1)
        acc = acc * correction[..., None] + _einsum("bhgqk,bkhe->bhgqe", p, v_block)
        return (new_max, row_sum, acc), None

    init = (jnp.full(stats_shape, -jnp.inf, jnp.float32), jnp.zeros(stats_shape, jnp.float32),
            jnp.zeros(stats_shape + (layout.v_head_dim,), jnp.float32))
    (row_max, row_sum, acc), _ = _scan_blocks(step, init, blocks)

    if config.has_sinks:
        sink = optional["sinks"].astype(jnp.float32).reshape(layout.kv_heads, layout.group)
        sink = sink[None, :, :, None]
        final_max = jnp.maximum(row_max, sink)
        correction = jnp.exp(row_max - final_max)
        row_sum = row_sum * correction + jnp.exp(sink - final_max)
        acc = acc * correction[..., None]
        row_max = final_max

    has_mass = row_sum > 0
    out = jnp.where(has_mass[..., None], acc / jnp.where(has_mass, row_sum, 1.0)[..., None], 0.0)
    lse = jnp.where(has_mass, row_max + jnp.log(jnp.where(has_mass, row_sum, 1.0)), -jnp.inf)
    out = jnp.einsum("bhgqe->bqhge", out).reshape(
        layout.batch, layout.q_len, layout.q_heads, layout.v_head_dim)
    lse = lse.reshape(layout.batch, layout.q_heads, layout.q_len)
    return out.astype(query.dtype), lse


class _SavedSoftmax:
    """P recomputed from the forward's saved LSE, the one way both the backward and the tangent do it:
    rows with lse = -inf (nothing visible, no sink) get P = 0 rather than exp(-inf - -inf)."""

    def __init__(self, layout: _Layout, config: AttentionConfig, optional, scaled_q, lse):
        self.layout, self.config, self.optional, self.scaled_q = layout, config, optional, scaled_q
        self.lse = lse.reshape(layout.batch, layout.kv_heads, layout.group, layout.q_len)
        self.finite = jnp.isfinite(self.lse)
        self.safe = jnp.where(self.finite, self.lse, 0.0)[..., None]

    def block(self, index, k_block, seg_block):
        """(P, the softcap's tanh or None) of one key block."""
        s, tanh = _logits(self.scaled_q, k_block, self.config)
        visible = _block_mask(self.layout, self.config, self.optional, index, seg_block) & self.finite[..., None]
        return jnp.where(visible, jnp.exp(s - self.safe), 0.0), tanh

    def sink_probability(self):
        """P_sink = exp(sink - lse) ([1, Hkv, G, Sq]; lse already includes the sink)."""
        layout = self.layout
        sink = self.optional["sinks"].astype(jnp.float32).reshape(1, layout.kv_heads, layout.group, 1)
        return jnp.exp(sink - jnp.where(self.finite, self.lse, jnp.inf))


def reference_backward(query, key, value, out, lse, d_out, d_lse, optional, config: AttentionConfig):
    """Gradients (dq, dk, dv, dsinks or None) from the saved out and lse; d_lse may be None."""
    layout = _Layout(query, key, value, config)
    q = layout.group_query(query.astype(jnp.float32))
    scaled_q = q * config.scale
    d_o = layout.group_query(d_out.astype(jnp.float32))
    saved = _SavedSoftmax(layout, config, optional, scaled_q, lse)
    # delta_i = rowsum(dO ∘ O) − dLSE_i: the softmax Jacobian's row term (dLSE enters it directly).
    delta = jnp.einsum("bqhge->bhgq", layout.group_query(out.astype(jnp.float32)) * d_o)
    if d_lse is not None:
        delta = delta - d_lse.astype(jnp.float32).reshape(delta.shape)
    blocks = _key_scan_inputs(layout, optional, key.astype(jnp.float32), value.astype(jnp.float32))

    def step(d_q, block):
        index, k_block, v_block, seg_block = block
        p, tanh = saved.block(index, k_block, seg_block)
        d_v = _einsum("bhgqk,bqhge->bkhe", p, d_o)
        d_p = _einsum("bqhge,bkhe->bhgqk", d_o, v_block)
        d_s = p * (d_p - delta[..., None])
        if tanh is not None:
            d_s = d_s * (1.0 - tanh * tanh)
        d_s = d_s * config.scale
        d_q = d_q + _einsum("bhgqk,bkhd->bqhgd", d_s, k_block)
        d_k = _einsum("bhgqk,bqhgd->bkhd", d_s, q)
        return d_q, (d_k, d_v)

    d_q, (d_k, d_v) = _scan_blocks(step, jnp.zeros_like(q), blocks)
    unblock = lambda x: jnp.moveaxis(x, 0, 1).reshape(
        (layout.batch, layout.padded_kv_len) + x.shape[3:])[:, :layout.kv_len]

    d_sinks = None
    if config.has_sinks:
        # d sink = −Σ_i P_sink,i δ_i.
        d_sinks = -(saved.sink_probability() * delta).sum(axis=(0, 3)).reshape(layout.q_heads)
        d_sinks = d_sinks.astype(optional["sinks"].dtype)
    return (layout.ungroup_query(d_q).astype(query.dtype), unblock(d_k).astype(key.dtype),
            unblock(d_v).astype(value.dtype), d_sinks)


def reference_tangent(query, key, value, out, lse, t_query, t_key, t_value, t_sinks, optional,
                      config: AttentionConfig):
    """Forward-mode tangents (t_out [B, Sq, Hq, Dv] in query dtype, t_lse [B, Hq, Sq] float32) from the
    saved out and lse, in one pass over the key blocks; t_sinks is None without sinks.

    With P = exp(S − lse) and t_S = scale·(t_q·kᵀ + q·t_kᵀ) (times the softcap's slope 1 − tanh²):
    t_lse = rowsum(P ∘ t_S) + P_sink·t_sink and t_out = P·t_v + (P ∘ t_S)·V − t_lse ∘ O. Linear in the
    tangents; its transpose is `reference_backward`'s gradient.
    """
    layout = _Layout(query, key, value, config)
    q = layout.group_query(query.astype(jnp.float32))
    scaled_q = q * config.scale
    t_q = layout.group_query(t_query.astype(jnp.float32))
    saved = _SavedSoftmax(layout, config, optional, scaled_q, lse)
    index, k_blocks, v_blocks, seg_blocks = _key_scan_inputs(
        layout, optional, key.astype(jnp.float32), value.astype(jnp.float32))
    t_k_blocks, t_v_blocks = _blocked_keys(layout, t_key.astype(jnp.float32), t_value.astype(jnp.float32))

    def step(carry, block):
        t_acc, t_row = carry
        index, k_block, v_block, seg_block, t_k_block, t_v_block = block
        p, tanh = saved.block(index, k_block, seg_block)
        t_s = _einsum("bqhgd,bkhd->bhgqk", t_q, k_block) + _einsum("bqhgd,bkhd->bhgqk", q, t_k_block)
        t_s = t_s * config.scale
        if tanh is not None:
            t_s = t_s * (1.0 - tanh * tanh)
        p_t_s = p * t_s
        t_acc = t_acc + _einsum("bhgqk,bkhe->bhgqe", p, t_v_block) + _einsum("bhgqk,bkhe->bhgqe", p_t_s, v_block)
        return (t_acc, t_row + p_t_s.sum(axis=-1)), None

    stats_shape = (layout.batch, layout.kv_heads, layout.group, layout.q_len)
    init = (jnp.zeros(stats_shape + (layout.v_head_dim,), jnp.float32), jnp.zeros(stats_shape, jnp.float32))
    (t_acc, t_lse), _ = _scan_blocks(step, init, (index, k_blocks, v_blocks, seg_blocks, t_k_blocks, t_v_blocks))
    if config.has_sinks:
        t_lse = t_lse + saved.sink_probability() * t_sinks.astype(jnp.float32).reshape(1, layout.kv_heads, layout.group, 1)
    o = jnp.einsum("bqhge->bhgqe", layout.group_query(out.astype(jnp.float32)))
    t_out = t_acc - t_lse[..., None] * o
    t_out = jnp.einsum("bhgqe->bqhge", t_out).reshape(layout.batch, layout.q_len, layout.q_heads, layout.v_head_dim)
    return t_out.astype(query.dtype), t_lse.reshape(layout.batch, layout.q_heads, layout.q_len)
