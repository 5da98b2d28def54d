"""Flax front ends for `fa4_jax.attention`.

- `MultiHeadAttention`: a drop-in for `flax.nnx.MultiHeadAttention` (same constructor, call signature,
  submodules and parameter shapes, so the state of one loads into the other) whose attention is ours.
- `dot_product_attention`: an `attention_fn` for `flax.nnx.MultiHeadAttention` and
  `flax.linen.MultiHeadDotProductAttention`. Linen keeps only the keyword arguments that appear in the
  function's signature, so every keyword either layer passes is named here explicitly. Linen has no
  `is_causal`; bind it: `functools.partial(dot_product_attention, is_causal=True)`.

How Flax's masking maps onto our options (`fa4_jax.nn.attention_top_left` does the rewriting):
- `is_causal` (outside decoding) is Flax's top-left causal mask (query i sees keys j <= i), rewritten
  exactly for our bottom-right alignment also when q_len != kv_len.
- A `mask` (bool or float, nonzero = visible) broadcastable to [batch..., heads, q_len, kv_len] is read
  at run time as query / key padding: q_valid (the rows it shows anything to) and kv_valid (the keys
  it shows to any row), which become segment ids, never a dense mask on the kernels. It maps exactly
  when it is a padding mask (`nnx.make_attention_mask(query_valid, key_valid)`, or one that varies
  along keys or queries only), a causal mask (`nnx.make_causal_mask`), or the two combined
  (`nnx.combine_masks`); a head axis is fine when every head has the same mask. Whether a dense mask is
  causal is decided at run time too (a `lax.cond` between the causal and the full kernel). Any other
  mask (a band, a block pattern, heads that differ) cannot raise, as its values are unknown while
  tracing: the batch elements it covers come out NaN, never silently wrong. Pass `is_causal=True`
  for causality and a padding mask for padding instead, or use Flax's own attention for other patterns.
- Outside decoding, a query row that sees no key gets the mean of the values, as in Flax (its softmax
  over equal large negative logits is uniform).
- Decoding with the cache (`decode=True`): the new queries sit at the end of the cached prefix, which is
  our bottom-right alignment, so the cache becomes `kv_seq_lengths = index + new_tokens` and no mask is
  built. Several tokens may be decoded at once (Flax takes one); with `is_causal=True` they are causal
  among themselves. Decoding past the end of the cache is not detected (the cache index is a traced
  value): the write is clamped to the cache's end and the lengths are clipped to the cache size, so the
  new tokens replace the cache's last slots and attend to the whole cache (Flax's layer does the same
  for one token), and `cache_index` keeps counting.

- A paged cache (`init_paged_cache(batch, max_length, page_size)` instead of `init_cache`): the keys
  and values live in `cached_key` / `cached_value` [blocks, page_size, kv_heads, head_dim] with a
  `block_tables` [batch, pages] cache (sequence b owns blocks b * pages ..; swap rows of it to share or
  move pages), and decoding attends through `fa4_jax.paged_attention`, which on a GPU is the split-KV
  decode kernel. The new tokens are causal among themselves (paged attention always is); one batch
  dimension, no mask; writing past `max_length` is not detected (the positions are traced values) and
  such tokens are dropped from the cache, while `cache_index` keeps counting.

Not supported, with an error that says so: attention dropout while not deterministic, `bias`, sowing
the attention weights (`sow_weights=True` / `module`; the weights never exist in memory), custom
einsum classes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import fa4_jax
from fa4_jax.nn import attention_top_left, top_left_band

# Segment ids that turn a padding mask into "visible iff equal ids" (on the decoding path).
_VALID_ID, _PADDING_QUERY_ID, _PADDING_KEY_ID = 0, -1, 1


def _flatten_batch(x: jax.Array) -> jax.Array:
    """[batch..., S, H, D] -> [B, S, H, D] with B the product of the batch dims (1 when there are none)."""
    return x.reshape((math.prod(x.shape[:-3]),) + x.shape[-3:])


@dataclasses.dataclass(frozen=True)
class MaskReading:
    """A Flax mask read as query / key padding, with or without a top-left causal part.

    q_valid [B, Sq] and kv_valid [B, Sk] (bool) are the rows and keys that appear in the mask at all.
    padding_exact [B]: the mask is q_valid x kv_valid (on every head). causal_exact [B] (None when the
    mask broadcasts along queries or keys, so cannot be causal): it is q_valid x kv_valid AND j <= i.
    """

    q_valid: jax.Array
    kv_valid: jax.Array
    padding_exact: jax.Array
    causal_exact: Optional[jax.Array]


def read_mask(mask, batch_shape: tuple, q_len: int, kv_len: int) -> Optional[MaskReading]:
    """Reads `mask` (broadcastable to [*batch_shape, heads, q_len, kv_len], nonzero = visible), or
    None for no mask. Its values are known at run time only, so whether the reading is exact is an
    array too; a mask of the wrong rank raises ValueError here."""
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    rank = len(batch_shape) + 3
    if mask.ndim > rank:
        raise ValueError(f"mask has rank {mask.ndim}, more than the {rank} of [batch..., heads, q_len, kv_len] = "
                         f"{(*batch_shape, 'heads', q_len, kv_len)}; drop the extra axes")
    mask = mask.reshape((1,) * (rank - mask.ndim) + mask.shape)
    heads, mask_q, mask_kv = mask.shape[-3:]
    batch = math.prod(batch_shape)
    visible = jnp.broadcast_to(mask.astype(bool), (*batch_shape, heads, mask_q, mask_kv))
    visible = visible.reshape(batch, heads, mask_q, mask_kv)
    rows, keys = visible.any(axis=(1, 3)), visible.any(axis=(1, 2))  # [B, mask_q], [B, mask_kv]
    padding = rows[:, None, :, None] & keys[:, None, None, :]
    padding_exact = jnp.all(visible == padding, axis=(1, 2, 3))
    causal_exact = None
    if mask_q == q_len > 1 and mask_kv == kv_len > 1:
        below_diagonal = np.arange(kv_len)[None, :] <= np.arange(q_len)[:, None]
        causal_exact = jnp.all(visible == (padding & below_diagonal), axis=(1, 2, 3))
    return MaskReading(jnp.broadcast_to(rows, (batch, q_len)), jnp.broadcast_to(keys, (batch, kv_len)),
                       padding_exact, causal_exact)


def _attend(query, key, value, *, mask, is_causal: bool, decode_kv_lengths=None, dtype=None,
            implementation: Optional[str] = None) -> jax.Array:
    """fa4_jax.attention on Flax-layout arrays [batch..., S, H, D] with Flax masking conventions.

    `decode_kv_lengths` (int32 [B]) switches to cache semantics: queries sit at the end of the valid
    key prefix (bottom-right), and `is_causal` is causal in that alignment.
    """
    if query.ndim < 3 or key.ndim != query.ndim or value.ndim != query.ndim:
        raise ValueError(f"query, key, value must be [batch..., length, heads, depth] of one rank, got "
                         f"{query.shape}, {key.shape}, {value.shape}")
    compute_dtype = dtype if dtype is not None else jnp.result_type(query, key, value)
    batch_shape = query.shape[:-3]
    q_len, kv_len = query.shape[-3], key.shape[-3]
    query, key, value = (_flatten_batch(x.astype(compute_dtype)) for x in (query, key, value))
    reading = read_mask(mask, batch_shape, q_len, kv_len)

    if decode_kv_lengths is not None:
        options = {}
        if reading is not None:
            options["segment_ids"] = (jnp.where(reading.q_valid, _VALID_ID, _PADDING_QUERY_ID).astype(jnp.int32),
                                      jnp.where(reading.kv_valid, _VALID_ID, _PADDING_KEY_ID).astype(jnp.int32))
        out = fa4_jax.attention(query, key, value, kv_seq_lengths=decode_kv_lengths, causal=is_causal,
                                implementation=implementation, **options)
        exact = None if reading is None else reading.padding_exact
    else:
        valid = {} if reading is None else dict(q_valid=reading.q_valid, kv_valid=reading.kv_valid)

        def attend(causal: bool):
            return attention_top_left(query, key, value, band=top_left_band(causal, None),
                                      implementation=implementation, **valid)

        if reading is None:
            out, exact = attend(is_causal), None
        elif is_causal or reading.causal_exact is None:
            # Flax ANDs is_causal with the mask, so a padding mask and a causal padding mask both map.
            out = attend(is_causal)
            exact = reading.padding_exact if reading.causal_exact is None else (
                reading.padding_exact | reading.causal_exact)
        else:
            # A dense mask such as nnx.make_causal_mask's: whether it is causal is known at run time only.
            use_causal = jnp.all(reading.causal_exact) & ~jnp.all(reading.padding_exact)
            out = jax.lax.cond(use_causal, lambda: attend(True), lambda: attend(False))
            exact = jnp.where(use_causal, reading.causal_exact, reading.padding_exact)
    if exact is not None:
        # A mask that is neither cannot raise here (its values are unknown while tracing): its batch
        # elements come out NaN rather than silently wrong.
        out = jnp.where(exact[:, None, None, None], out, jnp.nan)
    return out.reshape(batch_shape + out.shape[1:])


def _reject_dropout(dropout_rate: float, deterministic: bool):
    if dropout_rate > 0.0 and not deterministic:
        raise NotImplementedError(
            f"fa4_jax attention has no attention dropout (dropout_rate={dropout_rate} with "
            "deterministic=False); set dropout_rate=0 or run deterministic=True")


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: Optional[jax.Array] = None,
    mask: Optional[jax.Array] = None,
    broadcast_dropout: bool = True,
    dropout_rng: Optional[jax.Array] = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype=None,
    precision=None,
    module=None,
    promote_dtype=None,
    is_causal: bool = False,
    force_fp32_for_softmax: bool = False,
    qk_attn_weights_einsum=None,
    attn_weights_value_einsum=None,
    implementation: Optional[str] = None,
) -> jax.Array:
    """`attention_fn` for flax.nnx.MultiHeadAttention and flax.linen.MultiHeadDotProductAttention.

    Arrays are [batch..., length, heads, depth]; key/value heads may divide the query heads (GQA).
    Softmax always accumulates in float32 (so `force_fp32_for_softmax` is moot); `precision`,
    `broadcast_dropout` and `dropout_rng` only matter to dropout or matmul precision, which our kernels
    fix. Masks: see the module docstring.
    """
    del broadcast_dropout, dropout_rng, precision, force_fp32_for_softmax
    if bias is not None:
        raise NotImplementedError("fa4_jax attention takes no additive bias; express it as a mask, "
                                  "softcap or sinks, or use Flax's dot_product_attention")
    if module is not None:
        raise NotImplementedError("fa4_jax never materializes the attention weights, so they cannot be "
                                  "sown; call with sow_weights=False")
    if qk_attn_weights_einsum is not None or attn_weights_value_einsum is not None:
        raise NotImplementedError("fa4_jax attention cannot use custom einsum classes "
                                  "(qk_attn_weights_einsum_cls / attn_weights_value_einsum_cls)")
    _reject_dropout(dropout_rate, deterministic)
    if promote_dtype is not None:
        query, key, value = promote_dtype((query, key, value), dtype=dtype)
    return _attend(query, key, value, mask=mask, is_causal=is_causal, dtype=dtype,
                   implementation=implementation)


def _first_set(*values, name: str):
    for value in values:
        if value is not None:
            return value
    raise ValueError(f"No `{name}` argument was given to MultiHeadAttention, neither to __call__ nor "
                     "to the constructor")


class MultiHeadAttention(nnx.MultiHeadAttention):
    """flax.nnx.MultiHeadAttention whose attention is `fa4_jax.attention`.

    Same constructor and `__call__` as the Flax layer (plus `implementation`, passed on to
    `fa4_jax.attention`), same submodules `query`, `key`, `value`, `out` (and `query_ln`, `key_ln`) and
    parameter shapes: `nnx.update(ours, nnx.state(theirs, nnx.Param))` loads Flax's weights. Masks,
    decoding and what is not supported: see the module docstring.
    """

    def __init__(self, *args, implementation: Optional[str] = None, **kwargs):
        if "attention_fn" in kwargs:
            raise TypeError("fa4_jax.flax_layer.MultiHeadAttention always attends with fa4_jax; for "
                            "another attention_fn use flax.nnx.MultiHeadAttention")
        super().__init__(*args, attention_fn=functools.partial(dot_product_attention,
                                                                implementation=implementation), **kwargs)
        self.implementation = implementation
        self.block_tables: Optional[nnx.Cache] = nnx.data(None)   # set by init_paged_cache

    def init_paged_cache(self, batch_size: int, max_length: int, page_size: int, dtype=jnp.float32):
        """A paged KV cache for decoding (see the module docstring): ceil(max_length / page_size) pages
        per sequence, sequence b in cache blocks b * pages .. (b + 1) * pages - 1."""
        pages = -(-max_length // page_size)
        shape = (batch_size * pages, page_size, self.num_kv_heads, self.head_dim)
        self.cached_key = nnx.Cache(jnp.zeros(shape, dtype))
        self.cached_value = nnx.Cache(jnp.zeros(shape, dtype))
        self.cache_index = nnx.Cache(jnp.array(0, dtype=jnp.int32))
        self.block_tables = nnx.Cache(jnp.arange(batch_size * pages, dtype=jnp.int32).reshape(batch_size, pages))

    def __call__(
        self,
        inputs_q: jax.Array,
        inputs_k: Optional[jax.Array] = None,
        inputs_v: Optional[jax.Array] = None,
        *,
        mask: Optional[jax.Array] = None,
        deterministic: Optional[bool] = None,
        rngs=None,
        sow_weights: bool = False,
        decode: Optional[bool] = None,
        is_causal: bool = False,
        out_sharding=None,
        qkv_sharding=None,
    ) -> jax.Array:
        del rngs  # only dropout would draw from it, and dropout is rejected below
        if sow_weights:
            raise NotImplementedError("fa4_jax never materializes the attention weights, so they "
                                      "cannot be sown; call with sow_weights=False")
        if inputs_k is None:
            if inputs_v is not None:
                raise ValueError("`inputs_k` cannot be None if `inputs_v` is not None; to use one array "
                                 "for both, pass it as `inputs_k` and leave `inputs_v` None")
            inputs_k = inputs_q
        if inputs_v is None:
            inputs_v = inputs_k
        if inputs_q.shape[-1] != self.in_features:
            raise ValueError(f"Incompatible input dimension, got {inputs_q.shape[-1]} but module "
                             f"expects {self.in_features}.")

        # Flax versions before `qkv_sharding` / `out_sharding` take one argument: pass it only if set.
        def project(linear, inputs, sharding):
            return linear(inputs) if sharding is None else linear(inputs, out_sharding=sharding)

        query = project(self.query, inputs_q, qkv_sharding)
        key = project(self.key, inputs_k, qkv_sharding)
        value = project(self.value, inputs_v, qkv_sharding)
        if self.normalize_qk:
            query = self.query_ln(query)
            key = self.key_ln(key)

        if self.dropout_rate > 0.0:
            _reject_dropout(self.dropout_rate,
                            _first_set(deterministic, self.deterministic, name="deterministic"))

        if _first_set(decode, self.decode, name="decode") and self.block_tables is not None:
            x = self._attend_paged(query, key, value, mask=mask, is_causal=is_causal)
        elif _first_set(decode, self.decode, name="decode"):
            key, value, kv_lengths = self._append_to_cache(key, value)
            x = _attend(query, key, value, mask=mask, is_causal=is_causal, decode_kv_lengths=kv_lengths,
                        dtype=self.dtype, implementation=self.implementation)
        else:
            x = _attend(query, key, value, mask=mask, is_causal=is_causal, dtype=self.dtype,
                        implementation=self.implementation)
        return project(self.out, x, out_sharding)

    def _append_to_cache(self, key, value):
        """Writes the new keys/values at the cache index; returns the whole cache and its valid length."""
        if self.cached_key is None or self.cached_value is None or self.cache_index is None:
            raise ValueError("Autoregressive cache not initialized, call ``init_cache`` first.")
        cached_key = self.cached_key[...]
        *batch_dims, max_length, num_kv_heads, depth = cached_key.shape
        new_tokens = key.shape[-3]
        if key.shape != (*batch_dims, new_tokens, num_kv_heads, depth) or new_tokens > max_length:
            raise ValueError(f"Autoregressive cache shape error: cache {cached_key.shape} cannot take "
                             f"keys of shape {key.shape}")
        index = self.cache_index[...]
        zero = jnp.zeros((), index.dtype)
        start = (zero,) * len(batch_dims) + (index, zero, zero)
        key = jax.lax.dynamic_update_slice(cached_key, key.astype(cached_key.dtype), start)
        value = jax.lax.dynamic_update_slice(self.cached_value[...],
                                             value.astype(self.cached_value[...].dtype), start)
        self.cached_key[...] = key
        self.cached_value[...] = value
        self.cache_index[...] = index + new_tokens
        kv_lengths = jnp.full((math.prod(batch_dims),), index + new_tokens, jnp.int32)
        return key, value, kv_lengths

    def _attend_paged(self, query, key, value, *, mask, is_causal: bool):
        """Writes the new keys/values into their pages, then paged attention over the cache."""
        if mask is not None:
            raise ValueError("the paged cache takes no mask: its sequences are their valid prefixes")
        if query.ndim != 4:
            raise ValueError(f"the paged cache takes one batch dimension, [batch, length, heads, depth]; got "
                             f"query {query.shape}")
        new_tokens = query.shape[1]
        if new_tokens > 1 and not is_causal:
            raise ValueError("paged decoding is causal among the new tokens: pass is_causal=True to decode "
                             f"{new_tokens} tokens at once")
        cached_key, cached_value, tables = self.cached_key[...], self.cached_value[...], self.block_tables[...]
        page_size = cached_key.shape[1]
        index = self.cache_index[...]
        positions = index + jnp.arange(new_tokens, dtype=jnp.int32)
        batch = jnp.arange(query.shape[0])[:, None]
        # Positions past the table go to an out-of-bounds block and are dropped by the scatter.
        pages = jnp.where(positions < tables.shape[1] * page_size,
                          tables[batch, jnp.minimum(positions // page_size, tables.shape[1] - 1)],
                          cached_key.shape[0])
        slots = (positions % page_size)[None, :]
        cached_key = cached_key.at[pages, slots].set(key.astype(cached_key.dtype), mode="drop")
        cached_value = cached_value.at[pages, slots].set(value.astype(cached_value.dtype), mode="drop")
        self.cached_key[...] = cached_key
        self.cached_value[...] = cached_value
        self.cache_index[...] = index + new_tokens
        compute_dtype = self.dtype if self.dtype is not None else jnp.result_type(query, key, value)
        lengths = jnp.full((query.shape[0],), index + new_tokens, jnp.int32)
        return fa4_jax.paged_attention(query.astype(compute_dtype), cached_key.astype(compute_dtype),
                                       cached_value.astype(compute_dtype), tables, lengths,
                                       implementation=self.implementation)
