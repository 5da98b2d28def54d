"""`fa4_jax.attention_varlen` (packed variable-length batches) against the float64 oracle applied to
each sequence on its own, on the reference path (CPU); the sm90 kernel's GPU tests subclass
`VarlenTestBase` in tests/test_sm90_varlen.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import fa4_jax
import numpy_reference as oracle
from fa4_jax.config import AttentionConfig
from fa4_jax.kernels import host
from varlen_cases import VarlenCase, build, draw_lengths, offsets, oracle_backward, oracle_forward

CASES = [
    VarlenCase(),
    VarlenCase(causal=True),
    VarlenCase(window=(7, 3)),
    VarlenCase(causal=True, window=(11, None)),
    VarlenCase(window=(None, 0), kv_heads=1),
    VarlenCase(softcap=2.0, sinks=True),
    VarlenCase(causal=True, sinks=True, q_heads=6, kv_heads=3, head_dim=32, value_dim=48),
    VarlenCase(lengths=((1, 1),) * 9 + ((3, 0), (0, 3)), causal=True),
    VarlenCase(sequences=3, max_len=300, causal=True, head_dim=48),  # sequences spanning several key blocks
    VarlenCase(dtype="bfloat16", causal=True, sinks=True),
]
TOLERANCE = {"float32": 2e-5, "bfloat16": 2e-2, "float16": 4e-3}


def by_name(cases):
    return pytest.mark.parametrize("case", cases, ids=[c.name for c in cases])


class VarlenTestBase:
    implementation = None
    tolerance = TOLERANCE

    @property
    def gradient_implementation(self):
        """The implementation the gradient checks ask for (a kernel subclass whose backward is the
        reference asks for None: its forward kernel, then the reference backward)."""
        return self.implementation

    def before_call(self, nbytes: int):
        """Runs just before the call under test, given its outputs' size in bytes (GPU subclasses
        poison freed device memory with NaN, so rows a kernel leaves unwritten show up)."""

    def check_forward(self, case, inputs, rng):
        packed = build(case, inputs, draw_lengths(rng, case))
        function = jax.jit(lambda q, k, v, cu_q, cu_k, sinks: fa4_jax.attention_varlen(
            q, k, v, cu_q, cu_k, sinks=sinks, return_lse=True, implementation=self.implementation, **case.options()))
        expected_out, expected_lse = oracle_forward(case, packed)
        self.before_call(4 * expected_out.size + 4 * expected_lse.size)
        out, lse = function(packed.query, packed.key, packed.value, packed.cu_q, packed.cu_k, packed.sinks)
        assert out.shape == expected_out.shape and out.dtype == packed.query.dtype
        assert lse.shape == expected_lse.shape and lse.dtype == jnp.float32
        oracle.assert_close(out, expected_out, self.tolerance[case.dtype], "out")
        oracle.assert_close(lse, expected_lse, self.tolerance[case.dtype], "lse", floor=1.0)

    def check_gradients(self, case, inputs, rng):
        packed = build(case, inputs, draw_lengths(rng, case))
        d_out = inputs.normal((packed.query.shape[0], case.q_heads, case.v_dim), packed.query.dtype)
        d_lse = inputs.normal((case.q_heads, packed.query.shape[0]), jnp.float32)

        @jax.jit
        def pullback(q, k, v, sinks):
            def function(q, k, v, sinks):
                return fa4_jax.attention_varlen(q, k, v, packed.cu_q, packed.cu_k, sinks=sinks, return_lse=True,
                                                implementation=self.gradient_implementation, **case.options())
            return jax.vjp(function, q, k, v, sinks)[1]((d_out, d_lse))

        self.before_call(4 * (packed.query.size + packed.key.size + packed.value.size))
        grads = pullback(packed.query, packed.key, packed.value, packed.sinks)
        expected = oracle_backward(case, packed, d_out, d_lse)
        tolerance = self.tolerance[case.dtype] * 2
        for name, grad in zip(("dq", "dk", "dv"), grads):
            oracle.assert_close(grad, expected[name], tolerance, name)
        if packed.sinks is not None:
            oracle.assert_close(grads[3], expected["dsinks"], tolerance, "dsinks", floor=expected["dsinks_scale"])


class TestReferenceVarlen(VarlenTestBase):
    implementation = "reference"

    @by_name(CASES)
    def test_forward(self, case, inputs, rng):
        self.check_forward(case, inputs, rng)

    @by_name(CASES)
    def test_gradients(self, case, inputs, rng):
        self.check_gradients(case, inputs, rng)


def test_default_implementation_matches_the_oracle_without_lse(inputs, rng):
    case = VarlenCase(causal=True)
    packed = build(case, inputs, draw_lengths(rng, case))
    out = fa4_jax.attention_varlen(packed.query, packed.key, packed.value, packed.cu_q, packed.cu_k, causal=True)
    oracle.assert_close(out, oracle_forward(case, packed)[0], TOLERANCE["float32"], "out")


def test_one_compile_serves_every_packing(inputs, rng):
    """The offsets are runtime data: three packings of the same token counts trace and compile once,
    and each result is its own packing's."""
    case = VarlenCase(causal=True, sinks=True)
    traces = []

    @jax.jit
    def forward_and_grad(q, k, v, cu_q, cu_k, sinks):
        traces.append(1)
        def loss(q):
            return fa4_jax.attention_varlen(q, k, v, cu_q, cu_k, causal=True, sinks=sinks).astype(jnp.float32).sum()
        return fa4_jax.attention_varlen(q, k, v, cu_q, cu_k, causal=True, sinks=sinks), jax.grad(loss)(q)

    base = build(case, inputs, np.array([[30, 20], [0, 9], [25, 0], [10, 31]]))
    packings = [np.array([[30, 20], [0, 9], [25, 0], [10, 31]]), np.array([[1, 40], [64, 1], [0, 0], [0, 19]]),
                np.array([[65, 60], [0, 0], [0, 0], [0, 0]])]
    outputs = []
    for lengths in packings:
        assert lengths[:, 0].sum() == base.query.shape[0] and lengths[:, 1].sum() == base.key.shape[0]
        cu_q, cu_k = offsets(lengths[:, 0]), offsets(lengths[:, 1])
        out, _ = forward_and_grad(base.query, base.key, base.value, cu_q, cu_k, base.sinks)
        packed = build(case, inputs, lengths)
        packed.query, packed.key, packed.value, packed.sinks = base.query, base.key, base.value, base.sinks
        oracle.assert_close(out, oracle_forward(case, packed)[0], TOLERANCE["float32"], f"out of {lengths.tolist()}")
        outputs.append(np.asarray(out))
    assert len(traces) == 1 and forward_and_grad._cache_size() == 1
    assert not np.allclose(outputs[0], outputs[1])


def test_forward_mode_matches_per_sequence_attention(inputs, rng):
    """jax.jvp of a packing equals, sequence by sequence, the jvp of `fa4_jax.attention`."""
    lengths = np.array([[9, 13], [0, 4], [17, 6]])
    case = VarlenCase(lengths=tuple(map(tuple, lengths)), causal=True, window=(5, None))
    packed = build(case, inputs, lengths)
    tangents = [inputs.normal(x.shape) for x in (packed.query, packed.key, packed.value)]
    function = lambda q, k, v: fa4_jax.attention_varlen(q, k, v, packed.cu_q, packed.cu_k, causal=True,
                                                        window=(5, None))
    _, t_out = jax.jvp(function, (packed.query, packed.key, packed.value), tuple(tangents))
    for b in (0, 2):
        rows = slice(packed.cu_q[b], packed.cu_q[b + 1])
        keys = slice(packed.cu_k[b], packed.cu_k[b + 1])
        one = lambda q, k, v: fa4_jax.attention(q[None], k[None], v[None], causal=True, window=(5, None))[0]
        _, expected = jax.jvp(one, (packed.query[rows], packed.key[keys], packed.value[keys]),
                              (tangents[0][rows], tangents[1][keys], tangents[2][keys]))
        oracle.assert_close(t_out[rows], expected, 1e-5, f"tangent of sequence {b}")


def test_heads_sharded_over_devices(inputs, rng):
    """Under jit with the heads split over a mesh, every shard runs its heads: same as unsharded."""
    case = VarlenCase(q_heads=4, kv_heads=2, causal=True, sinks=True)
    packed = build(case, inputs, draw_lengths(rng, case))
    mesh = Mesh(np.array(jax.devices()[:2]), ("heads",))
    heads = NamedSharding(mesh, PartitionSpec(None, "heads", None))
    q, k, v = (jax.device_put(x, heads) for x in (packed.query, packed.key, packed.value))
    sinks = jax.device_put(packed.sinks, NamedSharding(mesh, PartitionSpec("heads")))
    function = jax.jit(lambda q, k, v, s: jax.value_and_grad(lambda q: fa4_jax.attention_varlen(
        q, k, v, packed.cu_q, packed.cu_k, causal=True, sinks=s).sum())(q))
    (total, dq) = function(q, k, v, sinks)
    (expected_total, expected_dq) = function(packed.query, packed.key, packed.value, packed.sinks)
    np.testing.assert_allclose(total, expected_total, rtol=1e-5)
    np.testing.assert_allclose(dq, expected_dq, rtol=1e-5, atol=1e-6)


def test_vmap_is_rejected(inputs):
    q = inputs.normal((3, 10, 2, 16))
    k = v = inputs.normal((12, 2, 16))
    cu = np.array([0, 4, 10], np.int32), np.array([0, 5, 12], np.int32)
    with pytest.raises(ValueError, match="cannot be vmapped"):
        jax.vmap(lambda q: fa4_jax.attention_varlen(q, k, v, *cu))(q)
    with pytest.raises(ValueError, match="cannot be vmapped"):
        jax.vmap(lambda cu_q: fa4_jax.attention_varlen(q[0], k, v, cu_q, cu[1]))(np.stack([cu[0]] * 2))
    with pytest.raises(ValueError, match="cannot be vmapped"):
        jax.jacrev(lambda q: fa4_jax.attention_varlen(q, k, v, *cu))(q[0])


def _arrays(inputs, tq=10, tk=12, hq=2, hkv=2):
    return inputs.normal((tq, hq, 16)), inputs.normal((tk, hkv, 16)), inputs.normal((tk, hkv, 16))


@pytest.mark.parametrize("change, error, match", [
    (dict(query=lambda q: q[None]), ValueError, "rank-3"),
    (dict(cu_q=lambda c: c.astype(np.float32)), TypeError, "cu_seqlens_q must be an integer"),
    (dict(cu_k=lambda c: c[None]), ValueError, "cu_seqlens_k must be rank 1"),
    (dict(cu_q=lambda c: c[:1]), ValueError, "num_sequences \\+ 1 >= 2"),
    (dict(cu_q=lambda c: np.array([0, 4, 6, 10], np.int32)), ValueError, "same number of sequences"),
    (dict(cu_q=lambda c: np.array([0, 7, 4, 10], np.int32)), ValueError, "never decrease"),
    (dict(cu_k=lambda c: np.array([1, 5, 12], np.int32)), ValueError, "start at 0"),
    (dict(cu_k=lambda c: np.array([0, 5, 11], np.int32)), ValueError, "end at the packed token count 12"),
    (dict(key=lambda k: k.astype(jnp.bfloat16)), TypeError, "share one dtype"),
    (dict(query=lambda q: jnp.concatenate([q, q[:, :1]], axis=1)), ValueError, "multiple of kv_heads"),
    (dict(sinks=lambda s: np.zeros((2,), np.int32)), TypeError, "sinks must be a float array"),
])
def test_bad_input_fails_before_lowering(inputs, change, error, match):
    query, key, value = _arrays(inputs)
    arguments = dict(query=query, key=key, value=value, cu_q=np.array([0, 4, 10], np.int32),
                     cu_k=np.array([0, 5, 12], np.int32), sinks=None)
    for name, transform in change.items():
        arguments[name] = transform(arguments[name])
    with pytest.raises(error, match=match):
        jax.eval_shape(lambda: fa4_jax.attention_varlen(
            arguments["query"], arguments["key"], arguments["value"], arguments["cu_q"], arguments["cu_k"],
            sinks=arguments["sinks"]))


def test_traced_offsets_are_not_checked_and_tokens_past_the_end_see_nothing(inputs):
    """Under jit the offsets are runtime data: offsets ending before the token count raise nothing, and
    the rows past the end get out 0 and lse -inf (keys past the end are seen by no row)."""
    query, key, value = _arrays(inputs)
    cu_q, cu_k = np.array([0, 4, 8], np.int32), np.array([0, 5, 9], np.int32)
    out, lse = jax.jit(lambda a, b: fa4_jax.attention_varlen(query, key, value, a, b, return_lse=True))(cu_q, cu_k)
    assert np.all(np.asarray(out[8:]) == 0) and np.all(np.isneginf(np.asarray(lse[:, 8:])))
    expected = fa4_jax.attention_varlen(query[:8], key[:9], value[:9], cu_q, cu_k)
    oracle.assert_close(out[:8], expected, 1e-6, "rows before the end")


def test_kernels_without_a_packed_scheduler_refuse_it():
    """Every kernel's shared checks name the packing unless it says it schedules packed sequences;
    otherwise it would read the packing as one long sequence."""
    config = AttentionConfig(scale=0.125, has_cu_seqlens=True)
    problem = host.Problem(query=(1, 128, 4, 64), key=(1, 96, 4, 64), value=(1, 96, 4, 64), dtype="bfloat16")
    assert "packed variable-length" in host.kernel_unsupported_reason("sm90 backward", config, problem, (64,))
    assert host.kernel_unsupported_reason("sm90", config, problem, (64,), takes_packed=True) is None
