"""Forward-mode autodiff of `fa4_jax.attention`: jax.jvp, jax.linearize, jax.jacfwd, against the
float64 oracle and against reverse mode, with every feature, under vmap, jit sharding, shard_map and
remat. The tangent is the primitive `attention_tangent_p`, whose transpose is the backward pass.

The oracle has no forward mode, so a JVP is checked through duality: for tangents t and cotangents
c, <c, jvp(t)> must equal <vjp(c), t>, with the oracle's float64 VJP on the right.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import fa4_jax
import numpy_reference as oracle

FEATURES = {
    "plain": dict(),
    "causal-window-softcap": dict(causal=True, window=(9, None), softcap=3.0),
    "right-window": dict(window=(None, 2), scale=0.3),
    "segments": "segments",
    "lengths-causal": "lengths",
}


def _problem(inputs, q_len=13, kv_len=17):
    query = inputs.normal((2, q_len, 4, 16), scale=1.5)
    key = inputs.normal((2, kv_len, 2, 16))
    value = inputs.normal((2, kv_len, 2, 8))
    sinks = inputs.normal((4,))
    return query, key, value, sinks


def _options(feature, rng, q_len, kv_len):
    feature = FEATURES[feature]
    if feature == "segments":
        return dict(segment_ids=(jnp.asarray(np.sort(rng.integers(0, 3, (2, q_len)), axis=1), jnp.int32),
                                 jnp.asarray(np.sort(rng.integers(0, 3, (2, kv_len)), axis=1), jnp.int32)))
    if feature == "lengths":
        return dict(causal=True, q_seq_lengths=jnp.array([q_len, 5], jnp.int32),
                    kv_seq_lengths=jnp.array([kv_len - 3, kv_len], jnp.int32))
    return feature


def _inner(tree_a, tree_b):
    return sum(float(np.sum(np.asarray(a, np.float64) * np.asarray(b, np.float64)))
               for a, b in zip(jax.tree.leaves(tree_a), jax.tree.leaves(tree_b), strict=True))


@pytest.mark.parametrize("with_sinks", [False, True], ids=["no-sinks", "sinks"])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_jvp_matches_the_oracle(inputs, rng, feature, with_sinks):
    query, key, value, sinks = _problem(inputs)
    options = _options(feature, rng, query.shape[1], key.shape[1])
    if not with_sinks:
        sinks = None

    def function(q, k, v, s):
        return fa4_jax.attention(q, k, v, sinks=s, return_lse=True, **options)

    primals = (query, key, value, sinks)
    tangents = jax.tree.map(lambda x: inputs.normal(x.shape), primals)
    (out, lse), (t_out, t_lse) = jax.jit(lambda p, t: jax.jvp(function, p, t))(primals, tangents)
    assert t_out.shape == out.shape and t_out.dtype == out.dtype and t_lse.dtype == jnp.float32
    d_out = inputs.normal(out.shape)
    # Rows with lse = -inf (nothing visible, no sink) have a constant lse: no cotangent there.
    d_lse = np.where(np.isfinite(np.asarray(lse)), inputs.normal(lse.shape), 0.0)
    expected = oracle.attention_backward(query, key, value, d_out, d_lse, sinks=sinks, **options)
    gradients = [expected["dq"], expected["dk"], expected["dv"]] + ([expected["dsinks"]] if with_sinks else [])
    left = _inner((d_out, d_lse), (t_out, np.where(np.isfinite(np.asarray(lse)), t_lse, 0.0)))
    right = _inner(gradients, [t for t in tangents if t is not None])
    scale = _inner([np.abs(g) for g in gradients], [np.abs(t) for t in tangents if t is not None])
    assert abs(left - right) <= 1e-5 * scale, (left, right, scale)
    assert np.all(np.asarray(t_lse)[~np.isfinite(np.asarray(lse))] == 0)


def test_jacfwd_equals_jacrev_every_entry(inputs):
    query, key, value, sinks = _problem(inputs, q_len=3, kv_len=5)
    query, key, value = query[:1, :, :2, :4], key[:1, :, :1, :4], value[:1, :, :1, :3]
    sinks = sinks[:2]

    def function(q, k, v, s):
        return fa4_jax.attention(q, k, v, sinks=s, return_lse=True, causal=True, softcap=2.0)

    forward = jax.jit(jax.jacfwd(function, argnums=(0, 1, 2, 3)))(query, key, value, sinks)
    reverse = jax.jit(jax.jacrev(function, argnums=(0, 1, 2, 3)))(query, key, value, sinks)
    for a, b in zip(jax.tree.leaves(forward), jax.tree.leaves(reverse), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_linearize_and_its_transpose_give_the_vjp(inputs):
    query, key, value, sinks = _problem(inputs)
    function = lambda q, k, v: fa4_jax.attention(q, k, v, sinks=sinks, causal=True)
    out, linear = jax.linearize(function, query, key, value)
    tangents = tuple(inputs.normal(x.shape) for x in (query, key, value))
    np.testing.assert_allclose(linear(*tangents), jax.jvp(function, (query, key, value), tangents)[1],
                               rtol=1e-6, atol=1e-6)
    cotangent = inputs.normal(out.shape)
    transposed = jax.linear_transpose(linear, query, key, value)(cotangent)
    _, vjp = jax.vjp(function, query, key, value)
    for a, b in zip(transposed, vjp(cotangent), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # Only some tangents: the others are symbolic zeros.
    only_value = jax.jvp(lambda v: function(query, key, v), (value,), (tangents[2],))[1]
    expected = jax.jvp(function, (query, key, value), (jnp.zeros_like(query), jnp.zeros_like(key), tangents[2]))[1]
    np.testing.assert_allclose(only_value, expected, rtol=1e-6, atol=1e-6)


def test_vmap_of_jvp_and_jvp_of_vmap(inputs):
    query, key, value, sinks = _problem(inputs)
    function = lambda q, k, v, s: fa4_jax.attention(q, k, v, sinks=s, causal=True)
    tangents = tuple(inputs.normal((3,) + x.shape) for x in (query, key, value, sinks))
    batched = jax.vmap(lambda *t: jax.jvp(function, (query, key, value, sinks), t)[1])(*tangents)
    for index in range(3):
        one = jax.jvp(function, (query, key, value, sinks), tuple(t[index] for t in tangents))[1]
        np.testing.assert_allclose(batched[index], one, rtol=1e-5, atol=1e-6)
    per_example = jax.vmap(function, in_axes=(0, 0, 0, None))
    primals = (query[None].repeat(2, 0), key[None].repeat(2, 0), value[None].repeat(2, 0), sinks)
    t = tuple(inputs.normal(x.shape) for x in primals)
    mapped = jax.jvp(per_example, primals, t)[1]
    np.testing.assert_allclose(mapped[1], jax.jvp(function, tuple(x[1] for x in primals[:3]) + (sinks,),
                                                  tuple(x[1] for x in t[:3]) + (t[3],))[1], rtol=1e-5, atol=1e-6)


def test_remat_under_forward_and_reverse_mode(inputs):
    query, key, value, sinks = _problem(inputs)
    policy = jax.checkpoint_policies.save_only_these_names(*fa4_jax.RESIDUAL_NAMES)
    function = jax.checkpoint(lambda q, k, v: fa4_jax.attention(q, k, v, sinks=sinks, causal=True).sum(),
                              policy=policy)
    plain = lambda q, k, v: fa4_jax.attention(q, k, v, sinks=sinks, causal=True).sum()
    for a, b in zip(jax.grad(function, argnums=(0, 1, 2))(query, key, value),
                    jax.grad(plain, argnums=(0, 1, 2))(query, key, value)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    tangents = tuple(inputs.normal(x.shape) for x in (query, key, value))
    np.testing.assert_allclose(jax.jvp(function, (query, key, value), tangents)[1],
                               jax.jvp(plain, (query, key, value), tangents)[1], rtol=1e-5, atol=1e-5)


def test_jvp_under_jit_with_batch_sharding_and_in_shard_map(inputs):
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices (tests/conftest.py fakes 8 CPU devices)")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
    query, key, value, sinks = _problem(inputs)
    query, key, value = (jnp.concatenate([x] * 2) for x in (query, key, value))
    tangents = tuple(inputs.normal(x.shape) for x in (query, key, value))
    function = lambda q, k, v: fa4_jax.attention(q, k, v, sinks=sinks, causal=True)
    expected = jax.jvp(function, (query, key, value), tangents)[1]
    sharding = NamedSharding(mesh, PartitionSpec("data"))
    placed = [jax.device_put(x, sharding) for x in (query, key, value) + tangents]
    sharded = jax.jit(lambda q, k, v, *t: jax.jvp(function, (q, k, v), t)[1])(*placed)
    np.testing.assert_allclose(sharded, expected, rtol=1e-5, atol=1e-6)
    data = PartitionSpec("data")
    per_shard = jax.jit(jax.shard_map(lambda q, k, v, *t: jax.jvp(function, (q, k, v), t)[1], mesh=mesh,
                                      in_specs=(data,) * 6, out_specs=data))
    np.testing.assert_allclose(per_shard(*placed), expected, rtol=1e-5, atol=1e-6)


def test_export_of_a_jvp(inputs):
    query, key, value, _ = _problem(inputs)
    tangents = tuple(inputs.normal(x.shape) for x in (query, key, value))
    function = jax.jit(lambda q, k, v, *t: jax.jvp(lambda *a: fa4_jax.attention(*a, causal=True), (q, k, v), t)[1])
    exported = jax.export.export(function)(query, key, value, *tangents)
    np.testing.assert_allclose(exported.call(query, key, value, *tangents), function(query, key, value, *tangents),
                               rtol=1e-6, atol=1e-6)


def test_cute_refuses_the_tangent_off_gpu(inputs):
    query, key, value, _ = _problem(inputs)
    function = functools.partial(fa4_jax.attention, implementation="cute")
    with pytest.raises(NotImplementedError, match="implementation='cute'"):
        jax.jvp(function, (query, key, value), (query, key, value))


def _dense_loss(query, key, value, sinks, softcap):
    """A dense float32 attention in plain JAX (bottom-right causal, sinks, softcap): its own second
    derivatives are JAX's."""
    group = query.shape[2] // key.shape[2]
    key, value = jnp.repeat(key, group, 2), jnp.repeat(value, group, 2)
    logits = jnp.einsum("bqhd,bkhd->bhqk", query, key) / np.sqrt(query.shape[-1])
    logits = softcap * jnp.tanh(logits / softcap)
    q_len, kv_len = query.shape[1], key.shape[1]
    visible = np.arange(kv_len)[None, :] <= np.arange(q_len)[:, None] + kv_len - q_len
    logits = jnp.where(visible, logits, -jnp.inf)
    with_sink = jnp.concatenate([logits, jnp.broadcast_to(sinks[None, :, None, None], logits.shape[:3] + (1,))], -1)
    lse = jax.nn.logsumexp(with_sink, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", jnp.exp(logits - lse[..., None]), value)
    return jnp.sum(jnp.sin(out)) + jnp.sum(lse ** 2)


@pytest.mark.parametrize("order", ["forward-over-reverse", "reverse-over-forward"])
def test_hessian_vector_products(inputs, order):
    query, key, value, sinks = _problem(inputs, q_len=5, kv_len=7)

    def ours(q, k, v, s):
        out, lse = fa4_jax.attention(q, k, v, sinks=s, causal=True, softcap=3.0, return_lse=True)
        return jnp.sum(jnp.sin(out)) + jnp.sum(lse ** 2)

    theirs = functools.partial(_dense_loss, softcap=3.0)
    primals = (query, key, value, sinks)
    tangents = tuple(inputs.normal(x.shape) for x in primals)
    if order == "forward-over-reverse":
        hvp = lambda f: jax.jvp(jax.grad(f, argnums=(0, 1, 2, 3)), primals, tangents)[1]
    else:
        hvp = lambda f: jax.grad(lambda *p: jax.jvp(f, p, tangents)[1], argnums=(0, 1, 2, 3))(*primals)
    for a, b in zip(jax.jit(lambda: hvp(ours))(), hvp(theirs), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-4)


@pytest.mark.gpu
def test_jvp_and_grad_on_gpu(inputs):
    """On the H200: the tangent runs the sm90 tangent kernel (no fallback warning) after our forward
    kernel, and reverse mode, now the tangent's transpose, still runs the backward kernel
    (implementation="cute" would raise if it did not)."""
    import warnings

    query, key, value = (inputs.normal(shape).astype(jnp.bfloat16)
                         for shape in ((2, 512, 8, 128), (2, 512, 2, 128), (2, 512, 2, 128)))
    tangents = tuple(inputs.normal(x.shape).astype(jnp.bfloat16) for x in (query, key, value))
    function = lambda q, k, v: fa4_jax.attention(q, k, v, causal=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t_out = jax.jit(lambda p, t: jax.jvp(function, p, t)[1])((query, key, value), tangents)
    as_float = lambda xs: tuple(x.astype(jnp.float32) for x in xs)
    expected = jax.jvp(functools.partial(fa4_jax.attention, causal=True, implementation="reference"),
                       as_float((query, key, value)), as_float(tangents))[1]
    np.testing.assert_allclose(np.asarray(t_out, np.float32), np.asarray(expected), rtol=5e-2, atol=5e-2)
    cute = lambda q, k, v: fa4_jax.attention(q, k, v, causal=True, implementation="cute").astype(jnp.float32).sum()
    grads = jax.jit(jax.grad(cute, argnums=(0, 1, 2)))(query, key, value)
    assert all(bool(jnp.isfinite(g).all()) for g in grads)
