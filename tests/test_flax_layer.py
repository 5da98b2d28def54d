"""fa4_jax.flax_layer against Flax's own attention: same parameters give the same outputs and gradients."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen, nnx

from fa4_jax import flax_layer

FEATURES = 32
TOLERANCE = dict(rtol=2e-5, atol=2e-5)


def make_pair(num_heads=4, num_kv_heads=None, seed=0, **kwargs):
    """(flax layer, our layer) holding the same parameters."""
    settings = dict(num_heads=num_heads, in_features=FEATURES, qkv_features=FEATURES, decode=False,
                    **kwargs)
    if num_kv_heads is not None:
        settings["num_kv_heads"] = num_kv_heads
    theirs = nnx.MultiHeadAttention(**settings, rngs=nnx.Rngs(seed))
    ours = flax_layer.MultiHeadAttention(**settings, rngs=nnx.Rngs(seed + 1))
    nnx.update(ours, nnx.state(theirs, nnx.Param))
    return theirs, ours


def loss_and_grads(layer, inputs_q, inputs_k, cotangent, row_weight=None, **call_kwargs):
    """Output (times `row_weight`), and gradients of <that, cotangent> w.r.t. the parameters and both
    inputs."""

    def loss(layer, inputs_q, inputs_k):
        out = layer(inputs_q, inputs_k, **call_kwargs)
        if row_weight is not None:
            out = out * row_weight
        return jnp.sum(out * cotangent), out

    (_, out), grads = nnx.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(layer, inputs_q, inputs_k)
    param_grads, dq, dk = grads
    return out, jax.tree.leaves(nnx.state(param_grads, nnx.Param)), dq, dk


def assert_same(ours, theirs, **tolerance):
    for mine, reference in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_allclose(np.asarray(mine), np.asarray(reference), **(tolerance or TOLERANCE))


def test_parameters_have_flax_names_and_shapes():
    theirs, ours = make_pair(num_heads=4, num_kv_heads=2, normalize_qk=True)
    shapes = lambda layer: jax.tree.map(jnp.shape, nnx.to_pure_dict(nnx.state(layer, nnx.Param)))
    assert shapes(ours) == shapes(theirs)
    assert set(shapes(ours)) == {"query", "key", "value", "out", "query_ln", "key_ln"}
    # Loading in the other direction works as well.
    nnx.update(theirs, nnx.state(ours, nnx.Param))


@pytest.mark.parametrize("num_kv_heads", [None, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_self_attention_matches_flax(inputs, num_kv_heads, is_causal):
    theirs, ours = make_pair(num_kv_heads=num_kv_heads, normalize_qk=num_kv_heads == 2)
    x = inputs.normal((2, 11, FEATURES))
    cotangent = inputs.normal((2, 11, FEATURES))
    assert_same(loss_and_grads(ours, x, x, cotangent, is_causal=is_causal),
                loss_and_grads(theirs, x, x, cotangent, is_causal=is_causal))


@pytest.mark.parametrize("q_len,kv_len", [(5, 9), (9, 5)])
def test_cross_attention_causal_keeps_flax_top_left_alignment(inputs, q_len, kv_len):
    theirs, ours = make_pair(num_kv_heads=2)
    x_q, x_kv = inputs.normal((2, q_len, FEATURES)), inputs.normal((2, kv_len, FEATURES))
    cotangent = inputs.normal((2, q_len, FEATURES))
    assert_same(loss_and_grads(ours, x_q, x_kv, cotangent, is_causal=True),
                loss_and_grads(theirs, x_q, x_kv, cotangent, is_causal=True))


def test_several_batch_dimensions(inputs):
    theirs, ours = make_pair()
    x = inputs.normal((2, 3, 7, FEATURES))
    assert_same(ours(x, is_causal=True), theirs(x, is_causal=True))


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_key_padding_mask_maps_exactly(inputs, rng, is_causal):
    theirs, ours = make_pair(num_kv_heads=2)
    batch, length = 3, 10
    kv_valid = rng.random((batch, length)) < 0.7
    kv_valid[:, 0] = True  # every query (causal included) sees at least key 0
    mask = jnp.asarray(kv_valid)[:, None, None, :]
    x = inputs.normal((batch, length, FEATURES))
    cotangent = inputs.normal((batch, length, FEATURES))
    assert_same(loss_and_grads(ours, x, x, cotangent, mask=mask, is_causal=is_causal),
                loss_and_grads(theirs, x, x, cotangent, mask=mask, is_causal=is_causal))


def test_query_and_key_padding_masks_match_flax(inputs):
    """Rows that see no key included: Flax gives them the mean of the values, and so do we."""
    theirs, ours = make_pair()
    batch, length = 2, 9
    q_valid = np.arange(length)[None, :] < np.array([[9], [6]])
    kv_valid = np.arange(length)[None, :] < np.array([[7], [9]])
    x = inputs.normal((batch, length, FEATURES))
    cotangent = inputs.normal((batch, length, FEATURES))
    for mask in (jnp.asarray(q_valid)[:, None, :, None], jnp.asarray(kv_valid)[:, None, None, :]):
        for is_causal in (False, True):
            assert_same(loss_and_grads(ours, x, x, cotangent, mask=mask, is_causal=is_causal),
                        loss_and_grads(theirs, x, x, cotangent, mask=mask, is_causal=is_causal))


def test_float_padding_mask_from_make_attention_mask(inputs):
    """nnx.make_attention_mask of all-ones queries against a key padding vector has shape
    [B, 1, Sq, Sk]; its key row broadcast form [B, 1, 1, Sk] is what maps."""
    theirs, ours = make_pair()
    kv_valid = jnp.asarray([[1, 1, 1, 0, 0, 1], [1, 1, 1, 1, 1, 1]], jnp.float32)
    mask = nnx.make_attention_mask(jnp.ones((2, 1)), kv_valid)
    assert mask.shape == (2, 1, 1, 6)
    x = inputs.normal((2, 6, FEATURES))
    assert_same(ours(x, mask=mask), theirs(x, mask=mask))


def _flax_idiom_masks(batch, q_len, kv_len, rng):
    q_valid = jnp.asarray(np.arange(q_len)[None, :] < rng.integers(1, q_len + 1, (batch, 1)))
    kv_valid = jnp.asarray(np.arange(kv_len)[None, :] < rng.integers(1, kv_len + 1, (batch, 1)))
    padding = nnx.make_attention_mask(q_valid, kv_valid)  # [B, 1, Sq, Sk], dense in shape
    masks = {"padding": padding, "padding-bool": padding.astype(bool),
             "padding-on-every-head": jnp.broadcast_to(padding, (batch, 4, q_len, kv_len))}
    if q_len == kv_len:
        causal = nnx.make_causal_mask(jnp.ones((batch, q_len)))
        masks.update({"causal": causal, "causal-and-padding": nnx.combine_masks(causal, padding)})
    return masks


@pytest.mark.parametrize("q_len, kv_len", [(7, 7), (5, 9)])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_flax_idiom_masks_match_flax(inputs, rng, q_len, kv_len, is_causal):
    """The masks nnx.make_attention_mask / make_causal_mask / combine_masks build: read as padding
    (and causal, decided at run time), with gradients."""
    theirs, ours = make_pair(num_kv_heads=2)
    batch = 3
    x_q, x_kv = inputs.normal((batch, q_len, FEATURES)), inputs.normal((batch, kv_len, FEATURES))
    cotangent = inputs.normal((batch, q_len, FEATURES))
    for name, mask in _flax_idiom_masks(batch, q_len, kv_len, rng).items():
        assert_same(loss_and_grads(ours, x_q, x_kv, cotangent, mask=mask, is_causal=is_causal),
                    loss_and_grads(theirs, x_q, x_kv, cotangent, mask=mask, is_causal=is_causal))


def test_masks_that_are_not_padding_come_out_nan(inputs):
    """Only the batch elements whose mask is not padding / causal padding: never silently wrong."""
    _, ours = make_pair()
    x = inputs.normal((2, 6, FEATURES))
    band = np.abs(np.arange(6)[:, None] - np.arange(6)[None, :]) <= 1
    mask = jnp.asarray(np.stack([band, np.ones((6, 6), bool)]))[:, None]
    out = np.asarray(jax.jit(lambda x, m: ours(x, mask=m))(x, mask))
    assert np.isnan(out[0]).all() and np.isfinite(out[1]).all()
    per_head = jnp.ones((2, 4, 1, 6), bool).at[:, 1, :, 0].set(False)  # heads differ
    assert np.isnan(np.asarray(ours(x, mask=per_head))).all()
    with pytest.raises(ValueError, match="rank 6.*drop the extra axes"):
        ours(x, mask=jnp.ones((1, 1, 2, 1, 6, 6), bool))


def test_dropout_and_sown_weights_raise_but_deterministic_dropout_runs(inputs):
    theirs, ours = make_pair(dropout_rate=0.1)
    x = inputs.normal((2, 6, FEATURES))
    with pytest.raises(NotImplementedError, match="dropout"):
        ours(x, deterministic=False)
    with pytest.raises(NotImplementedError, match="sow"):
        ours(x, deterministic=True, sow_weights=True)
    assert_same(ours(x, deterministic=True), theirs(x, deterministic=True))


def test_attention_fn_adapter_for_nnx(inputs):
    theirs = nnx.MultiHeadAttention(num_heads=4, in_features=FEATURES, num_kv_heads=2, decode=False,
                                    rngs=nnx.Rngs(3))
    adapted = nnx.MultiHeadAttention(num_heads=4, in_features=FEATURES, num_kv_heads=2, decode=False,
                                     attention_fn=flax_layer.dot_product_attention, rngs=nnx.Rngs(3))
    x = inputs.normal((2, 8, FEATURES))
    cotangent = inputs.normal((2, 8, FEATURES))
    assert_same(loss_and_grads(adapted, x, x, cotangent, is_causal=True),
                loss_and_grads(theirs, x, x, cotangent, is_causal=True))


@pytest.mark.parametrize("with_padding", [False, True], ids=["causal", "causal+padding"])
def test_attention_fn_adapter_for_linen(inputs, rng, with_padding):
    """Linen has no is_causal: bind it in the adapter; Flax's reference gets the dense causal mask."""
    batch, length = 2, 8
    x = inputs.normal((batch, length, FEATURES))
    cotangent = inputs.normal((batch, length, FEATURES))
    kv_valid = np.ones((batch, length), bool)
    if with_padding:
        kv_valid[1, 5:] = False
    key_mask = jnp.asarray(kv_valid)[:, None, None, :]
    reference_mask = nnx.combine_masks(nnx.make_causal_mask(jnp.ones((batch, length))), key_mask)
    theirs = linen.MultiHeadDotProductAttention(num_heads=4, qkv_features=FEATURES)
    ours = linen.MultiHeadDotProductAttention(
        num_heads=4, qkv_features=FEATURES,
        attention_fn=functools.partial(flax_layer.dot_product_attention, is_causal=True))
    params = theirs.init(jax.random.key(0), x)

    def run(layer, mask):
        def loss(params, x):
            out = layer.apply(params, x, mask=mask)
            return jnp.sum(out * cotangent), out
        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
        return out, grads

    assert_same(run(ours, key_mask if with_padding else None), run(theirs, reference_mask))


@pytest.mark.parametrize("num_kv_heads", [None, 2], ids=["mha", "gqa"])
def test_decode_cache_matches_full_sequence_and_flax_decode(inputs, num_kv_heads):
    theirs, ours = make_pair(num_kv_heads=num_kv_heads)
    batch, length = 2, 7
    x = inputs.normal((batch, length, FEATURES))
    full = ours(x, is_causal=True)
    for layer in (ours, theirs):
        layer.init_cache((batch, length, FEATURES))
    for position in range(length):
        token = x[:, position:position + 1]
        ours_step = ours(token, decode=True)
        assert_same(ours_step, full[:, position:position + 1])
        assert_same(ours_step, theirs(token, decode=True))


def test_decode_under_jit_and_in_chunks(inputs):
    """A prompt chunk decoded at once (causal among itself), then single tokens, inside nnx.jit."""
    _, ours = make_pair(num_kv_heads=2)
    batch, prompt, length = 2, 4, 9
    x = inputs.normal((batch, length, FEATURES))
    full = ours(x, is_causal=True)
    ours.init_cache((batch, length, FEATURES))
    step = nnx.jit(lambda layer, chunk: layer(chunk, decode=True, is_causal=True))
    assert_same(step(ours, x[:, :prompt]), full[:, :prompt])
    for position in range(prompt, length):
        assert_same(step(ours, x[:, position:position + 1]), full[:, position:position + 1])
    assert int(ours.cache_index[...]) == length


def test_decode_past_the_end_of_the_cache_overwrites_its_last_slots(inputs):
    """Overflow cannot be detected while tracing (the cache index is a traced value), so it is defined:
    the write is clamped to the cache's end and the lengths are clipped to the cache size, so the new
    tokens replace the last slots and attend to the whole cache, as Flax's layer does for one token."""
    theirs, ours = make_pair(num_kv_heads=2)
    batch, length = 2, 4
    x = inputs.normal((batch, length + 3, FEATURES))
    for layer in (ours, theirs):
        layer.init_cache((batch, length, FEATURES))
        for position in range(length):
            layer(x[:, position:position + 1], decode=True)
    token = x[:, length:length + 1]
    assert_same(ours(token, decode=True), theirs(token, decode=True))
    # The cache now holds x0, x1, x2, x4; two more tokens, causal among themselves, replace x2 and x4.
    chunk = x[:, length + 1:]
    expected = ours(jnp.concatenate([x[:, :length - 2], chunk], axis=1), is_causal=True)[:, -2:]
    assert_same(ours(chunk, decode=True, is_causal=True), expected)
    assert int(ours.cache_index[...]) == length + 3


def test_linen_decode_with_adapter(inputs):
    batch, length = 2, 6
    x = inputs.normal((batch, length, FEATURES))
    adapter = functools.partial(flax_layer.dot_product_attention, is_causal=True)
    full_layer = linen.MultiHeadDotProductAttention(num_heads=4, qkv_features=FEATURES, attention_fn=adapter)
    params = full_layer.init(jax.random.key(1), x)
    full = full_layer.apply(params, x)
    # Linen's decode builds a [B, 1, 1, max_length] key mask for the cache: a padding mask that maps.
    decoder = linen.MultiHeadDotProductAttention(num_heads=4, qkv_features=FEATURES, decode=True,
                                                 attention_fn=flax_layer.dot_product_attention)
    cache = decoder.init(jax.random.key(1), x)["cache"]
    for position in range(length):
        out, updated = decoder.apply({**params, "cache": cache}, x[:, position:position + 1],
                                     mutable=["cache"])
        cache = updated["cache"]
        assert_same(out, full[:, position:position + 1])


def test_flax_swap_example(capsys):
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "flax_swap.py"
    spec = importlib.util.spec_from_file_location("flax_swap", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.main()
    assert "swapped 2 attention layers in place" in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_bfloat16_layer_on_gpu_matches_flax(inputs, head_dim):
    """On the GPU the layer runs fa4_jax's kernels (where they take the call): training and decoding."""
    heads, length = 4, 256
    features = heads * head_dim
    # No biases: the key bias's gradient is zero up to rounding, so it has no scale to compare against.
    settings = dict(num_heads=heads, in_features=features, num_kv_heads=2, decode=False, use_bias=False,
                    dtype=jnp.bfloat16)
    theirs = nnx.MultiHeadAttention(**settings, rngs=nnx.Rngs(0))
    ours = flax_layer.MultiHeadAttention(**settings, rngs=nnx.Rngs(1))
    nnx.update(ours, nnx.state(theirs, nnx.Param))
    x = inputs.normal((2, length, features), jnp.bfloat16)
    cotangent = inputs.normal((2, length, features), jnp.bfloat16)

    def relative_errors(mine, reference):
        return [float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))
                      / (float(jnp.max(jnp.abs(b.astype(jnp.float32)))) + 1e-6))
                for a, b in zip(jax.tree.leaves(mine), jax.tree.leaves(reference), strict=True)]

    train_step = nnx.jit(lambda layer, x, c: loss_and_grads(layer, x, x, c, is_causal=True))
    mine, reference = train_step(ours, x, cotangent), train_step(theirs, x, cotangent)
    assert max(relative_errors(mine, reference)) < 3e-2

    full = mine[0]
    ours.init_cache((2, length, features), jnp.bfloat16)
    step = nnx.jit(lambda layer, chunk: layer(chunk, decode=True, is_causal=True))
    prompt = length - 4
    decoded = [step(ours, x[:, :prompt])] + [step(ours, x[:, i:i + 1]) for i in range(prompt, length)]
    assert max(relative_errors(jnp.concatenate(decoded, axis=1), full)) < 3e-2


@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_paged_cache_decodes_like_the_contiguous_one(inputs, page_size):
    """init_paged_cache: a chunk then single tokens (inside nnx.jit) give what the full causal pass gives,
    with pages in permuted cache blocks (the block table is the layer's state)."""
    _, ours = make_pair(num_kv_heads=2)
    batch, prompt, length = 3, 4, 9
    x = inputs.normal((batch, length, FEATURES))
    full = ours(x, is_causal=True)
    ours.init_paged_cache(batch, length, page_size)
    tables = ours.block_tables[...]
    ours.block_tables[...] = jnp.flip(tables.reshape(-1)).reshape(tables.shape)   # any block order works
    step = nnx.jit(lambda layer, chunk: layer(chunk, decode=True, is_causal=True))
    assert_same(step(ours, x[:, :prompt]), full[:, :prompt])
    for position in range(prompt, length):
        assert_same(step(ours, x[:, position:position + 1]), full[:, position:position + 1])
    assert int(ours.cache_index[...]) == length


def test_paged_cache_refuses_what_it_cannot_take(inputs):
    _, ours = make_pair(num_kv_heads=2)
    ours.init_paged_cache(2, 8, 4)
    x = inputs.normal((2, 3, FEATURES))
    with pytest.raises(ValueError, match="is_causal=True"):
        ours(x, decode=True)
    with pytest.raises(ValueError, match="no mask"):
        ours(x, decode=True, is_causal=True, mask=jnp.ones((2, 1, 3, 8), bool))
