"""fa4_jax.dot_product_attention against jax.nn.dot_product_attention(implementation="xla").

First JAX's own argument grid (tests/nn_test.py: testDotProductAttention and
testDotProductAttentionMask, same shapes, dtypes and tolerances), then a wider grid of what that grid
leaves out: T != S, every window convention, lengths with causal / windows, and rows that see no key.
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from fa4_jax import nn as fa4_nn

jax_sdpa = functools.partial(jax.nn.dot_product_attention, implementation="xla")


def _normal(rng, shape, dtype):
    return jnp.asarray(rng.standard_normal(shape), dtype)


def _assert_close(ours, theirs, tolerance):
    for mine, reference in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_allclose(np.asarray(mine, np.float32), np.asarray(reference, np.float32), **tolerance)


# ------------------------------------------------------------------------------------- JAX's own grid

@pytest.mark.parametrize("use_vmap", [False, True], ids=["batched", "vmap"])
@pytest.mark.parametrize("group_num", [1, 2, 4])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_jax_grid_gqa(rng, dtype, group_num, use_vmap):
    B, S, T, N, H, G = 2, 128, 128, 4, 32, group_num
    Q, K, V = (_normal(rng, (B, T, N, H), dtype), _normal(rng, (B, S, N // G, H), dtype),
               _normal(rng, (B, S, N // G, H), dtype))
    grad = _normal(rng, (B, T, N, H), dtype)
    ours = fa4_jax.dot_product_attention
    if use_vmap:
        ours = jax.vmap(ours, in_axes=(0, 0, 0, None, None), out_axes=0)
    out, vjp = jax.vjp(lambda q, k, v: ours(q, k, v, None, None), Q, K, V)
    out_ref, vjp_ref = jax.vjp(lambda q, k, v: jax_sdpa(q, k, v), Q, K, V)
    _assert_close(out, out_ref, dict(atol=.01, rtol=.01))
    _assert_close(vjp(grad), vjp_ref(grad), dict(atol=.01, rtol=.01))


MASK_MODES = ["bias", "causal", "padding", "custom", ("causal", "padding"), ("custom", "padding"),
              ("bias", "causal"), ("causal", "sliding_window"), "sliding_window"]


@pytest.mark.parametrize("mask_mode", MASK_MODES, ids=lambda m: m if isinstance(m, str) else "+".join(m))
def test_jax_grid_masks(rng, mask_mode):
    mask_mode = (mask_mode,) if isinstance(mask_mode, str) else mask_mode
    dtype = jnp.bfloat16
    B, S, T, N, H = 2, 128, 128, 4, 32
    Q, K, V, grad = (_normal(rng, (B, T, N, H), dtype) for _ in range(4))
    bias = mask = q_seqlen = kv_seqlen = window_size = None
    is_causal = "causal" in mask_mode
    if "padding" in mask_mode:
        q_seqlen = jnp.array([T // 2, T // 4], dtype=jnp.int32)
        kv_seqlen = jnp.array([S // 4, S // 2], dtype=jnp.int32)
    if "custom" in mask_mode:
        mask = jnp.tril(jnp.ones((T, S), dtype=jnp.bool_))[None, None, :, :]
    if "bias" in mask_mode:
        bias = _normal(rng, (1, N, T, S), dtype)
    if "sliding_window" in mask_mode:
        window_size = (3, 2) if is_causal else (3, 0)

    def call(function, q, k, v, b):
        return function(q, k, v, b, mask, is_causal=is_causal, query_seq_lengths=q_seqlen,
                        key_value_seq_lengths=kv_seqlen, local_window_size=window_size)

    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        out, vjp = jax.vjp(functools.partial(call, fa4_jax.dot_product_attention), Q, K, V, bias)
    out_ref, vjp_ref = jax.vjp(functools.partial(call, jax_sdpa), Q, K, V, bias)
    _assert_close(out, out_ref, dict(atol=.01, rtol=.01))
    (dq, dk, dv, db), (dq_ref, dk_ref, dv_ref, db_ref) = vjp(grad), vjp_ref(grad)
    _assert_close((dq, dk, db), (dq_ref, dk_ref, db_ref), dict(atol=.02, rtol=.02))
    _assert_close(dv, dv_ref, dict(atol=.01, rtol=.01))


# --------------------------------------------------------------------------------------- wider grid

# Sides of every sign, one past both lengths, and bands no row of some shape sees into.
WINDOWS = [None, (3, 2), (3, 0), 2, (5, -1), (-3, 1), (40, 40)]
PADDINGS = [None, "both", "empty"]


def _lengths(padding, batch, q_len, kv_len):
    if padding == "both":
        return (jnp.array([q_len // 2, q_len] + [q_len] * (batch - 2), jnp.int32),
                jnp.array([max(kv_len // 3, 1), kv_len] + [kv_len] * (batch - 2), jnp.int32))
    if padding == "empty":  # no key for batch element 0, no query for batch element 1
        return (jnp.array([q_len, 0] + [q_len] * (batch - 2), jnp.int32),
                jnp.array([0, kv_len] + [kv_len] * (batch - 2), jnp.int32))
    return None, None


@pytest.mark.parametrize("padding", PADDINGS, ids=str)
@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("q_len, kv_len", [(8, 8), (5, 11), (11, 5), (1, 7)])
def test_matches_jax_nn_with_gradients(rng, q_len, kv_len, is_causal, window, padding):
    """float32, so that any difference is a semantic one (top-left alignment, windows, lengths, the
    mean of the values on rows that see no key), not rounding."""
    batch, heads, kv_heads, head_dim = 2, 4, 2, 16
    q = _normal(rng, (batch, q_len, heads, head_dim), jnp.float32)
    k, v = (_normal(rng, (batch, kv_len, kv_heads, head_dim), jnp.float32) for _ in range(2))
    q_lengths, kv_lengths = _lengths(padding, batch, q_len, kv_len)
    options = dict(is_causal=is_causal, local_window_size=window, query_seq_lengths=q_lengths,
                   key_value_seq_lengths=kv_lengths)
    ours = lambda q, k, v: fa4_jax.dot_product_attention(q, k, v, **options)
    theirs = lambda q, k, v: jax_sdpa(q, k, v, **options)
    out, vjp = jax.vjp(ours, q, k, v)
    out_ref, vjp_ref = jax.vjp(theirs, q, k, v)
    cotangent = _normal(rng, out.shape, jnp.float32)
    _assert_close(out, out_ref, dict(atol=1e-5, rtol=1e-5))
    _assert_close(vjp(cotangent), vjp_ref(cotangent), dict(atol=1e-5, rtol=1e-5))


def test_rank3_inputs_and_jit(rng):
    q = _normal(rng, (6, 4, 16), jnp.float32)
    k, v = (_normal(rng, (9, 1, 16), jnp.float32) for _ in range(2))
    function = jax.jit(functools.partial(fa4_jax.dot_product_attention, is_causal=True, local_window_size=(2, 1)))
    out = function(q, k, v)
    assert out.shape == (6, 4, 16)
    _assert_close(out, jax_sdpa(q, k, v, is_causal=True, local_window_size=(2, 1)), dict(atol=1e-5, rtol=1e-5))


def test_band_maps_to_attention_options(monkeypatch):
    """The top-left band becomes bottom-right options on the rows and keys that matter: causal with
    T < S cuts the keys no row sees; T > S with a left window cuts the rows that see no key."""
    calls = []
    original = fa4_nn.attention

    def spy(query, key, value, **options):
        calls.append((query.shape[1], key.shape[1], options["causal"], options["window"]))
        return original(query, key, value, **options)

    monkeypatch.setattr(fa4_nn, "attention", spy)
    x = lambda length: jnp.ones((1, length, 2, 8), jnp.float32)
    fa4_jax.dot_product_attention(x(4), x(10), x(10), is_causal=True)
    fa4_jax.dot_product_attention(x(10), x(4), x(4), is_causal=True)
    fa4_jax.dot_product_attention(x(10), x(4), x(4), local_window_size=(2, 0))
    fa4_jax.dot_product_attention(x(8), x(8), x(8), local_window_size=(3, 2))
    assert calls == [(4, 4, True, None), (10, 4, False, (None, 6)), (6, 4, False, (0, 2)),
                     (8, 8, False, (3, 2))]


def test_dense_mask_warns_once_and_cute_refuses(rng):
    q = _normal(rng, (1, 8, 2, 16), jnp.float32)
    mask = jnp.tril(jnp.ones((8, 8), bool))[None, None]
    fa4_nn._warned.clear()
    with pytest.warns(UserWarning, match="dense mask cannot be expressed.*is_causal"):
        out = fa4_jax.dot_product_attention(q, q, q, mask=mask)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fa4_jax.dot_product_attention(q, q, q, mask=mask)  # once only
        fa4_jax.dot_product_attention(q, q, q, mask=mask, implementation="reference")
    _assert_close(out, jax_sdpa(q, q, q, mask=mask), dict(atol=1e-6, rtol=1e-6))
    with pytest.raises(NotImplementedError, match="dense bias"):
        fa4_jax.dot_product_attention(q, q, q, bias=jnp.zeros((1, 2, 8, 8)), implementation="cute")


@pytest.mark.parametrize("arguments, error, message", [
    (dict(implementation="cudnn"), ValueError, "'cudnn' is not a fa4_jax path"),
    (dict(local_window_size=(1, 2, 3)), ValueError, "int or a pair"),
    (dict(local_window_size=1.5), TypeError, "static Python int"),
    (dict(query_seq_lengths=jnp.ones((2,), jnp.float32)), TypeError, "int32 array"),
    (dict(key_value_seq_lengths=jnp.ones((3,), jnp.int32)), ValueError, r"shape \(1,\)"),
])
def test_bad_arguments(arguments, error, message):
    q = jnp.ones((1, 8, 2, 16), jnp.float32)
    with pytest.raises(error, match=message):
        fa4_jax.dot_product_attention(q, q, q, **arguments)


def test_traced_scale_and_window_say_they_must_be_static():
    q = jnp.ones((1, 8, 2, 16), jnp.float32)
    with pytest.raises(TypeError, match="scale must be a static Python number"):
        jax.jit(lambda q, s: fa4_jax.dot_product_attention(q, q, q, scale=s))(q, 0.5)
    with pytest.raises(TypeError, match="local_window_size must be a static Python int"):
        jax.jit(lambda q, w: fa4_jax.dot_product_attention(q, q, q, local_window_size=w))(q, 2)


# ------------------------------------------------------------------------------------------ the GPU

@pytest.mark.gpu
@pytest.mark.parametrize("q_len, kv_len", [(256, 256), (128, 384), (384, 128)])
@pytest.mark.parametrize("options", [dict(is_causal=True), dict(local_window_size=(64, 0)),
                                     dict(is_causal=True, local_window_size=(96, 16)),
                                     dict(key_value_seq_lengths=jnp.array([100, 256], jnp.int32))],
                         ids=["causal", "left-window", "causal-window", "kv-lengths"])
def test_kernels_match_jax_nn_on_gpu(rng, q_len, kv_len, options):
    """implementation="cute": the band rewriting lands on our kernels (they raise if it did not)."""
    q = _normal(rng, (2, q_len, 8, 128), jnp.bfloat16)
    k, v = (_normal(rng, (2, kv_len, 2, 128), jnp.bfloat16) for _ in range(2))
    ours = lambda q, k, v: fa4_jax.dot_product_attention(q, k, v, implementation="cute", **options)
    theirs = lambda q, k, v: jax_sdpa(q, k, v, **options)
    out, vjp = jax.vjp(jax.jit(ours), q, k, v)
    out_ref, vjp_ref = jax.vjp(theirs, q, k, v)
    cotangent = _normal(rng, out.shape, jnp.bfloat16)
    _assert_close(out, out_ref, dict(atol=.02, rtol=.02))
    _assert_close(vjp(cotangent), vjp_ref(cotangent), dict(atol=.05, rtol=.05))
