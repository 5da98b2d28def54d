"""`fa4_jax.dot_product_attention`: `jax.nn.dot_product_attention`'s signature and semantics, computed
by `fa4_jax.attention` (our kernels where they apply) whenever no dense `bias` / `mask` is given.

jax.nn aligns the causal mask and the local window top-left: query row i sits at key position i, and
sees key j iff i - left <= j <= i + right (causal: right <= 0), j < key_value_seq_lengths[b]. Our
attention aligns bottom-right (row i at key position i + Sk - Sq, and the lengths move it). The two
agree when Sq == Sk without lengths; `attention_top_left` rewrites every other case exactly:
- Rows that see no key whatever the padding (i - left > Sk - 1) are left out of the call, and so are
  keys no row sees (j > Sq' - 1 + right); the kept Sq' rows and Sk' keys are aligned top-left by the
  window offset off = Sk' - Sq' (left + off and right - off are then both >= 0).
- Sequence lengths would move our alignment, so with a causal mask or a window they become segment
  ids (a query sees only keys with its id) instead; without either they stay lengths.
- jax.nn gives a query row that sees no key (inside query_seq_lengths) the mean of all values (its
  softmax over equally large negative logits is uniform); we give 0, so those rows are filled with the
  mean here. Rows past query_seq_lengths are 0 in both.
"""

from __future__ import annotations

import warnings
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from fa4_jax.api import attention, static_number
from fa4_jax.config import IMPLEMENTATIONS

Array = jax.Array
_warned: set[str] = set()

# Segment ids for validity: valid queries and keys share one id, padding queries and keys get ids that
# match nothing.
_VALID_ID, _PADDING_QUERY_ID, _PADDING_KEY_ID = 0, -1, 1


def top_left_band(is_causal: bool, local_window_size) -> tuple[Optional[int], Optional[int]]:
    """jax.nn's (is_causal, local_window_size) as (left, right): row i sees keys i - left ... i + right,
    None for an unbounded side. An int window w is (w, w), as in jax.nn; sides may be negative."""
    if local_window_size is None:
        left = right = None
    else:
        sides = (local_window_size, local_window_size) if not isinstance(local_window_size, (tuple, list)) \
            else tuple(local_window_size)
        if len(sides) != 2:
            raise ValueError(f"local_window_size must be an int or a pair (left, right); got {local_window_size!r}.")
        left, right = (static_number("local_window_size", side, integer=True) for side in sides)
    if is_causal:
        right = 0 if right is None else min(right, 0)
    return left, right


def _integer_vector(name: str, value, batch: int) -> Array:
    value = jnp.asarray(value)
    if not jnp.issubdtype(value.dtype, jnp.integer):
        raise TypeError(f"{name} must be an int32 array [batch]; got {value.dtype}. Cast it with .astype(jnp.int32).")
    if value.shape != (batch,):
        raise ValueError(f"{name} must have shape ({batch},), one length per batch element; got {value.shape}.")
    return value


def attention_top_left(query, key, value, *, band, scale=None, q_valid=None, kv_valid=None, q_lengths=None,
                       kv_lengths=None, implementation=None) -> Array:
    """Attention with jax.nn / Flax masking semantics on `fa4_jax.attention`.

    query [B, Sq, Hq, D], key / value [B, Sk, Hkv, D | Dv]; band: `top_left_band`'s (left, right).
    q_valid [B, Sq] / kv_valid [B, Sk] bool: which queries / keys take part (Flax padding masks).
    q_lengths / kv_lengths int [B] (jax.nn): keys past kv_lengths are invisible, rows past q_lengths
    are 0. Every other row that sees no key gets the mean of all values, as in jax.nn and Flax.
    """
    batch, q_len, q_heads, _ = query.shape
    kv_len, kv_heads = key.shape[1], key.shape[2]
    left, right = band
    rows = np.arange(q_len)
    banded = left is not None or right is not None
    zero_rows = None if q_lengths is None else rows[None, :] >= q_lengths[:, None]

    options = {}
    if banded or q_valid is not None or kv_valid is not None:
        if q_lengths is not None:
            q_valid = ~zero_rows if q_valid is None else q_valid & ~zero_rows
        if kv_lengths is not None:
            key_valid = np.arange(kv_len)[None, :] < kv_lengths[:, None]
            kv_valid = key_valid if kv_valid is None else kv_valid & key_valid
    else:
        options = {name: lengths for name, lengths in (("q_seq_lengths", q_lengths), ("kv_seq_lengths", kv_lengths))
                   if lengths is not None}

    # Rows past Sk - 1 + left and keys past Sq' - 1 + right are outside every row's band.
    kept_rows = q_len if left is None else min(q_len, kv_len + left)
    kept_keys = kv_len if right is None else min(kv_len, kept_rows + right)
    band_empty = left is not None and right is not None and left + right < 0
    if band_empty or kept_rows < 1 or kept_keys < 1:
        out = jnp.zeros(query.shape[:3] + value.shape[3:], query.dtype)
    else:
        offset = kept_keys - kept_rows
        our_left = None if left is None else left + offset
        our_right = None if right is None else right - offset
        causal = our_right == 0
        window = None if our_left is None and (our_right is None or causal) else (
            our_left, None if causal else our_right)
        if q_valid is not None or kv_valid is not None:
            q_ids = (jnp.zeros((batch, kept_rows), jnp.int32) if q_valid is None
                     else jnp.where(q_valid[:, :kept_rows], _VALID_ID, _PADDING_QUERY_ID).astype(jnp.int32))
            kv_ids = (jnp.zeros((batch, kept_keys), jnp.int32) if kv_valid is None
                      else jnp.where(kv_valid[:, :kept_keys], _VALID_ID, _PADDING_KEY_ID).astype(jnp.int32))
            options["segment_ids"] = (q_ids, kv_ids)
        out = attention(query[:, :kept_rows], key[:, :kept_keys], value[:, :kept_keys], scale=scale,
                        causal=causal, window=window, implementation=implementation, **options)
        out = jnp.pad(out, ((0, 0), (0, q_len - kept_rows), (0, 0), (0, 0)))

    # Which rows see at least one key; the rest get the mean of the values (jax.nn's uniform softmax).
    first = np.zeros(q_len, np.int64) if left is None else np.clip(rows - left, 0, kv_len)
    last = np.full(q_len, kv_len - 1) if right is None else np.clip(rows + right, -1, kv_len - 1)
    sees_key = np.broadcast_to(first <= last, (batch, q_len))
    if kv_valid is not None:
        valid_before = jnp.pad(jnp.cumsum(kv_valid.astype(jnp.int32), axis=1), ((0, 0), (1, 0)))
        count = valid_before[:, np.maximum(last + 1, first)] - valid_before[:, first]
        sees_key = sees_key & (count > 0)
    elif kv_lengths is not None:
        sees_key = sees_key & (kv_lengths[:, None] > 0)
    if q_valid is not None:
        sees_key = sees_key & q_valid
    fill = ~sees_key if zero_rows is None else ~sees_key & ~zero_rows
    if isinstance(fill, np.ndarray) and not fill.any():
        return out
    mean_value = jnp.repeat(value.astype(jnp.float32).mean(axis=1), q_heads // kv_heads, axis=1)
    return jnp.where(fill[:, :, None, None], mean_value[:, None].astype(out.dtype), out)


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"fa4_jax.dot_product_attention runs jax.nn.dot_product_attention's XLA path "
                      f"(it builds the [batch, heads, q_len, kv_len] logits) because {reason}.", stacklevel=3)


def dot_product_attention(
    query: Array,
    key: Array,
    value: Array,
    bias: Optional[Array] = None,
    mask: Optional[Array] = None,
    *,
    scale: Optional[float] = None,
    is_causal: bool = False,
    query_seq_lengths: Optional[Array] = None,
    key_value_seq_lengths: Optional[Array] = None,
    local_window_size=None,
    implementation: Optional[str] = None,
) -> Array:
    """`jax.nn.dot_product_attention` with the same arguments and semantics, on `fa4_jax.attention`.

    query [B, T, N, H] or [T, N, H]; key / value [B, S, K, H] or [S, K, H], N a multiple of K (GQA).
    is_causal: query i sees keys j <= i (top-left, as jax.nn, also when T != S).
    local_window_size: (left, right) or an int w = (w, w): query i sees keys i - left <= j <= i + right.
    query_seq_lengths / key_value_seq_lengths: int [B]; keys past the length are invisible, query rows
    past it are 0. A row inside its length that sees no key gets the mean of all values, as in jax.nn.
    scale: a static Python number (default 1/sqrt(H)).
    implementation: None (our kernels where they apply, else the reference), "cute" (our kernels or
    NotImplementedError) or "reference" (pure JAX).

    A dense `bias` or `mask` cannot run on our kernels: such a call runs jax.nn's XLA path, after a
    one-time warning (NotImplementedError under implementation="cute"). Express causal masks, windows
    and padding with is_causal, local_window_size and the lengths instead.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} (None: our kernels where they apply; "
                         f"'reference': pure JAX); got {implementation!r}. jax.nn's 'xla' is 'reference' here, "
                         "and 'cudnn' is not a fa4_jax path: use None or 'cute' for our GPU kernels.")
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    ranks = {query.ndim, key.ndim, value.ndim}
    if ranks not in ({3}, {4}):
        raise ValueError(f"query, key and value must all be rank 4 [batch, seq, heads, head_dim] or all rank 3 "
                         f"[seq, heads, head_dim]; got shapes {query.shape}, {key.shape}, {value.shape}.")
    band = top_left_band(bool(is_causal), local_window_size)
    if scale is not None:
        scale = static_number("scale", scale)

    if bias is not None or mask is not None:
        what = " and ".join(name for name, x in (("a dense bias", bias), ("a dense mask", mask)) if x is not None)
        reason = (f"{what} cannot be expressed by fa4_jax.attention's options; pass is_causal, local_window_size "
                  "and query_seq_lengths / key_value_seq_lengths instead where the mask is one of those")
        if implementation == "cute":
            raise NotImplementedError(f"fa4_jax.dot_product_attention(implementation='cute'): {reason}.")
        if implementation is None:
            _warn_once(reason)
        lengths = {name: None if x is None else jnp.asarray(x).astype(jnp.int32) for name, x in
                   (("query_seq_lengths", query_seq_lengths), ("key_value_seq_lengths", key_value_seq_lengths))}
        return jax.nn.dot_product_attention(query, key, value, bias, mask, scale=scale, is_causal=bool(is_causal),
                                            local_window_size=local_window_size, implementation="xla", **lengths)

    unbatched = query.ndim == 3
    if unbatched:
        query, key, value = query[None], key[None], value[None]
    batch = query.shape[0]
    q_lengths = None if query_seq_lengths is None else _integer_vector("query_seq_lengths", query_seq_lengths, batch)
    kv_lengths = None if key_value_seq_lengths is None else _integer_vector(
        "key_value_seq_lengths", key_value_seq_lengths, batch)
    out = attention_top_left(query, key, value, band=band, scale=scale, q_lengths=q_lengths, kv_lengths=kv_lengths,
                             implementation=implementation)
    return out[0] if unbatched else out

