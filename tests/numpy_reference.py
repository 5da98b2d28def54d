"""Float64 NumPy oracle for `fa4_jax.attention`: the semantics of the contract, written densely.

Independent of the package on purpose: it shares no code with `fa4_jax`, materialises the full
[B, Hq, Sq, Sk] logits, and derives the gradients analytically (checked against finite differences in
tests/test_numpy_reference.py). Every kernel and the JAX reference are compared against it.

Semantics (see the README's table):
- query [B, Sq, Hq, D], key [B, Sk, Hkv, D], value [B, Sk, Hkv, Dv]; query head h reads key/value head
  h // (Hq // Hkv).
- logits = scale * q.k (scale defaults to 1/sqrt(D)), then softcap c: c * tanh(logits / c).
- Bottom-right alignment: query row i sits at key position i + kv_len[b] - q_len[b], where the lengths
  default to Sk and Sq and given lengths are clipped to [0, Sq] / [0, Sk]. causal: key j visible iff
  j <= i + off. window (left, right), None unbounded:
  visible iff i + off - left <= j <= i + off + right. Keys j >= kv_len and rows i >= q_len see nothing.
  Segment ids: visible iff the query's and the key's ids are equal.
- sinks [Hq]: one extra logit per head that enters the softmax denominator only.
- lse = log(sum_visible exp(logit) + exp(sink)); out = sum_visible exp(logit - lse) * value.
  A row with no visible key: out 0 and lse -inf (or the sink logit when sinks are given; a sink of -inf
  leaves it -inf, and the row contributes to no gradient).

`assert_close` is the comparison every test uses: the largest error relative to the largest expected
magnitude, with infinities (lse of rows that see nothing) required to match exactly.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np


def to_float64(array) -> np.ndarray:
    """Any array (JAX, NumPy, bfloat16 via ml_dtypes) as a float64 NumPy array."""
    return np.asarray(array).astype(np.float64)


@dataclasses.dataclass(frozen=True)
class Masking:
    """The options that decide which keys a query row sees, as NumPy arrays (or None)."""

    causal: bool = False
    window: Optional[tuple] = None
    segment_ids: object = None  # [B, S] or (q_ids [B, Sq], kv_ids [B, Sk])
    q_seq_lengths: Optional[np.ndarray] = None
    kv_seq_lengths: Optional[np.ndarray] = None


def split_segment_ids(segment_ids):
    """(q_ids, kv_ids) from either a single [B, S] array or a pair; None when not given."""
    if segment_ids is None:
        return None, None
    if isinstance(segment_ids, (tuple, list)):
        q_ids, kv_ids = segment_ids
    else:
        q_ids = kv_ids = segment_ids
    return np.asarray(q_ids), np.asarray(kv_ids)


def visible_keys(batch, q_len, kv_len, masking: Masking) -> np.ndarray:
    """Boolean [B, Sq, Sk]: whether query row i may attend to key j."""
    if masking.q_seq_lengths is None:
        q_valid = np.full((batch,), q_len, dtype=np.int64)
    else:
        q_valid = np.clip(np.asarray(masking.q_seq_lengths, dtype=np.int64), 0, q_len)
    if masking.kv_seq_lengths is None:
        kv_valid = np.full((batch,), kv_len, dtype=np.int64)
    else:
        kv_valid = np.clip(np.asarray(masking.kv_seq_lengths, dtype=np.int64), 0, kv_len)

    rows = np.arange(q_len)[None, :, None]
    cols = np.arange(kv_len)[None, None, :]
    # The key position each query row is aligned with (bottom-right alignment).
    position = rows + (kv_valid - q_valid)[:, None, None]
    mask = (rows < q_valid[:, None, None]) & (cols < kv_valid[:, None, None])
    if masking.causal:
        mask = mask & (cols <= position)
    if masking.window is not None:
        left, right = masking.window
        if left is not None:
            mask = mask & (cols >= position - left)
        if right is not None:
            mask = mask & (cols <= position + right)
    q_ids, kv_ids = split_segment_ids(masking.segment_ids)
    if q_ids is not None:
        mask = mask & (q_ids[:, :, None] == kv_ids[:, None, :])
    return np.broadcast_to(mask, (batch, q_len, kv_len))


def _expand_kv_heads(array, q_heads):
    """[B, Sk, Hkv, X] -> [B, Sk, Hq, X]: query head h reads kv head h // group."""
    group = q_heads // array.shape[2]
    return np.repeat(array, group, axis=2)


def _fold_kv_heads(array, kv_heads):
    """Inverse of `_expand_kv_heads` for gradients: sum the query heads of each group."""
    batch, length, q_heads, width = array.shape
    return array.reshape(batch, length, kv_heads, q_heads // kv_heads, width).sum(axis=3)


@dataclasses.dataclass
class _Softmax:
    """Forward intermediates shared by the forward and the backward pass."""

    raw_logits: np.ndarray   # [B, Hq, Sq, Sk] scale * q.k before softcap
    logits: np.ndarray       # after softcap
    mask: np.ndarray         # [B, 1, Sq, Sk]
    lse: np.ndarray          # [B, Hq, Sq]
    probabilities: np.ndarray  # [B, Hq, Sq, Sk], 0 where masked
    sink_probability: Optional[np.ndarray]  # [B, Hq, Sq]
    key: np.ndarray          # expanded to Hq heads
    value: np.ndarray        # expanded to Hq heads
    out: np.ndarray          # [B, Sq, Hq, Dv]


def _softmax(query, key, value, scale, softcap, sinks, masking) -> _Softmax:
    query, key, value = to_float64(query), to_float64(key), to_float64(value)
    batch, q_len, q_heads, head_dim = query.shape
    kv_len = key.shape[1]
    if scale is None:
        scale = 1.0 / np.sqrt(head_dim)
    key = _expand_kv_heads(key, q_heads)
    value = _expand_kv_heads(value, q_heads)

    raw_logits = scale * np.einsum("bqhd,bkhd->bhqk", query, key)
    logits = raw_logits if softcap is None else softcap * np.tanh(raw_logits / softcap)
    mask = visible_keys(batch, q_len, kv_len, masking)[:, None]
    masked = np.where(mask, logits, -np.inf)

    row_max = masked.max(axis=-1)
    if sinks is not None:
        sink_logits = np.broadcast_to(to_float64(sinks)[None, :, None], row_max.shape)
        row_max = np.maximum(row_max, sink_logits)
    # Rows that see nothing (and have no sink) keep a finite shift so no inf - inf appears.
    shift = np.where(np.isfinite(row_max), row_max, 0.0)
    total = np.exp(masked - shift[..., None]).sum(axis=-1)
    if sinks is not None:
        total = total + np.exp(sink_logits - shift)
    with np.errstate(divide="ignore"):
        lse = np.log(total) + shift

    finite_lse = np.where(np.isfinite(lse), lse, 0.0)
    probabilities = np.where(mask & np.isfinite(lse)[..., None],
                             np.exp(np.where(mask, logits, 0.0) - finite_lse[..., None]), 0.0)
    sink_probability = None
    if sinks is not None:
        # A sink of -inf on a row that sees no key: lse is -inf too, and the row has no mass at all.
        sink_probability = np.where(np.isfinite(lse), np.exp(sink_logits - finite_lse), 0.0)
    out = np.einsum("bhqk,bkhd->bqhd", probabilities, value)
    return _Softmax(raw_logits, logits, mask, lse, probabilities, sink_probability, key, value, out)


def attention_forward(query, key, value, *, scale=None, causal=False, window=None, softcap=None,
                      sinks=None, segment_ids=None, q_seq_lengths=None, kv_seq_lengths=None):
    """(out [B, Sq, Hq, Dv], lse [B, Hq, Sq]) in float64."""
    masking = Masking(causal, window, segment_ids, q_seq_lengths, kv_seq_lengths)
    state = _softmax(query, key, value, scale, softcap, sinks, masking)
    return state.out, state.lse


def attention_backward(query, key, value, d_out, d_lse=None, *, scale=None, causal=False,
                       window=None, softcap=None, sinks=None, segment_ids=None,
                       q_seq_lengths=None, kv_seq_lengths=None):
    """Gradients of sum(out * d_out) + sum(lse * d_lse): dict with dq, dk, dv and dsinks (or None),
    and the scale each one's rounding error grows with (the terms can cancel, so the gradient itself may be
    far smaller): dsinks_scale, the largest sum of |terms| behind one dsinks entry; dq_scale, dk_scale and
    dv_scale, the largest root-sum-square of |terms| behind one entry, where dS's terms are
    P_ij (|dO_i . V_j| + |Delta_i| + |dlse_i|). A row with one visible key has dO_i . V_j = Delta_i exactly,
    so its dQ is scale dlse_i K_j while float32 rounding errors still scale with |dO_i . V_j|.

    With P the probabilities, O the output and Delta_i = dO_i . O_i:
      dV_j   = sum_i P_ij dO_i
      dS_ij  = P_ij (dO_i . V_j - Delta_i + dlse_i)            (gradient wrt the capped logits)
      dX_ij  = dS_ij * (1 - tanh^2(X_ij / c))                   (through the softcap, X = scale q.k)
      dQ_i   = scale sum_j dX_ij K_j,  dK_j = scale sum_i dX_ij Q_i (summed over each GQA group)
      dsink  = sum_{b,i} P_sink,i (dlse_i - Delta_i)           (the sink only enters the denominator)
    Rows with lse = -inf (nothing visible, no sink) have P = 0 and contribute nothing.
    """
    masking = Masking(causal, window, segment_ids, q_seq_lengths, kv_seq_lengths)
    state = _softmax(query, key, value, scale, softcap, sinks, masking)
    query_64 = to_float64(query)
    head_dim = query_64.shape[-1]
    if scale is None:
        scale = 1.0 / np.sqrt(head_dim)
    d_out = to_float64(d_out)
    kv_heads = np.asarray(key).shape[2]
    if d_lse is None:
        d_lse = np.zeros_like(state.lse)
    d_lse = to_float64(d_lse)
    # Cotangents of rows whose lse is -inf cannot flow anywhere.
    d_lse = np.where(np.isfinite(state.lse), d_lse, 0.0)

    delta = np.einsum("bqhd,bqhd->bhq", d_out, state.out)
    d_value = np.einsum("bhqk,bqhd->bkhd", state.probabilities, d_out)
    d_probabilities = np.einsum("bqhd,bkhd->bhqk", d_out, state.value)
    d_logits = state.probabilities * (d_probabilities - delta[..., None] + d_lse[..., None])
    if softcap is not None:
        d_logits = d_logits * (1.0 - np.tanh(state.raw_logits / softcap) ** 2)
    d_query = scale * np.einsum("bhqk,bkhd->bqhd", d_logits, state.key)
    d_key = scale * np.einsum("bhqk,bqhd->bkhd", d_logits, query_64)
    d_logit_terms = state.probabilities * (np.abs(d_probabilities) + np.abs(delta)[..., None]
                                           + np.abs(d_lse)[..., None])
    if softcap is not None:
        d_logit_terms = d_logit_terms * (1.0 - np.tanh(state.raw_logits / softcap) ** 2)
    squared = d_logit_terms ** 2
    d_query_scale = scale * np.sqrt(np.einsum("bhqk,bkhd->bqhd", squared, state.key ** 2)).max(initial=0.0)
    d_key_scale = scale * np.sqrt(_fold_kv_heads(np.einsum("bhqk,bqhd->bkhd", squared, query_64 ** 2),
                                                 kv_heads)).max(initial=0.0)
    d_value_scale = np.sqrt(_fold_kv_heads(np.einsum("bhqk,bqhd->bkhd", state.probabilities ** 2, d_out ** 2),
                                           kv_heads)).max(initial=0.0)

    d_sinks = d_sinks_scale = None
    if sinks is not None:
        sink_terms = state.sink_probability * (d_lse - delta)
        d_sinks = sink_terms.sum(axis=(0, 2))
        d_sinks_scale = np.abs(sink_terms).sum(axis=(0, 2)).max()
    return {
        "dq": d_query,
        "dk": _fold_kv_heads(d_key, kv_heads),
        "dv": _fold_kv_heads(d_value, kv_heads),
        "dsinks": d_sinks,
        "dsinks_scale": d_sinks_scale,
        "dq_scale": d_query_scale,
        "dk_scale": d_key_scale,
        "dv_scale": d_value_scale,
    }


def attention_tangent(query, key, value, t_query, t_key, t_value, t_sinks=None, *, scale=None, causal=False,
                      window=None, softcap=None, sinks=None, segment_ids=None, q_seq_lengths=None,
                      kv_seq_lengths=None):
    """Forward-mode tangents (t_out [B, Sq, Hq, Dv], t_lse [B, Hq, Sq]) of `attention_forward` in float64,
    the JVP written out from the dense probabilities:
      t_X_ij   = scale (t_Q_i . K_j + Q_i . t_K_j)                 (the logits' tangent before softcap)
      t_S_ij   = t_X_ij * (1 - tanh^2(X_ij / c))                   (through the softcap)
      t_lse_i  = sum_j P_ij t_S_ij + P_sink,i t_sink
      t_out_i  = sum_j P_ij t_V_j + sum_j P_ij t_S_ij V_j - t_lse_i O_i
    Rows with lse = -inf (nothing visible, no sink) have P = 0: both tangents are 0 there."""
    masking = Masking(causal, window, segment_ids, q_seq_lengths, kv_seq_lengths)
    state = _softmax(query, key, value, scale, softcap, sinks, masking)
    query_64 = to_float64(query)
    q_heads = query_64.shape[2]
    if scale is None:
        scale = 1.0 / np.sqrt(query_64.shape[-1])
    t_query = to_float64(t_query)
    t_key = _expand_kv_heads(to_float64(t_key), q_heads)
    t_value = _expand_kv_heads(to_float64(t_value), q_heads)
    t_logits = scale * (np.einsum("bqhd,bkhd->bhqk", t_query, state.key)
                        + np.einsum("bqhd,bkhd->bhqk", query_64, t_key))
    if softcap is not None:
        t_logits = t_logits * (1.0 - np.tanh(state.raw_logits / softcap) ** 2)
    weighted = state.probabilities * t_logits
    t_lse = weighted.sum(axis=-1)
    if sinks is not None:
        t_lse = t_lse + state.sink_probability * to_float64(t_sinks)[None, :, None]
    t_out = (np.einsum("bhqk,bkhd->bqhd", state.probabilities, t_value)
             + np.einsum("bhqk,bkhd->bqhd", weighted, state.value)
             - np.einsum("bhq,bqhd->bqhd", t_lse, state.out))
    return t_out, t_lse


def assert_close(actual, expected, tolerance, what, floor=0.0):
    """max |actual - expected| <= tolerance * max(max |expected|, floor, 1e-6), with infinities matched
    exactly; floor is the scale of the terms behind `expected` where they can cancel (the *_scale entries
    of `attention_backward`)."""
    actual = to_float64(actual)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != expected {expected.shape}"
    infinite = ~np.isfinite(expected)
    assert not np.any(np.isnan(actual)), f"{what}: NaN at {np.argwhere(np.isnan(actual))[:5].tolist()}"
    mismatched = infinite & (actual != expected)
    assert not np.any(mismatched), (
        f"{what}: expected {expected[mismatched][:3]} at {np.argwhere(mismatched)[:3].tolist()}, "
        f"got {actual[mismatched][:3]}")
    finite = ~infinite
    if not np.any(finite):
        return
    magnitude = max(np.max(np.abs(expected[finite])), floor, 1e-6)
    difference = np.abs(np.where(finite, actual, 0.0) - np.where(finite, expected, 0.0))
    worst = np.unravel_index(np.argmax(difference), difference.shape)
    error = difference[worst] / magnitude
    assert error <= tolerance, (
        f"{what}: max |error| {difference[worst]:.3e} at {list(worst)} is {error:.2e} of max |expected| "
        f"{magnitude:.3e}, above {tolerance:.1e} (got {actual[worst]:.6g}, expected {expected[worst]:.6g})")
