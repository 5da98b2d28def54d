"""The Blackwell 2-CTA backward kernel against the float64 NumPy oracle, on a compute-capability 10.x GPU.

No such GPU has been available: these tests have never run. They are the sm90 backward grid
(tests/test_sm90_backward.py: same cases, the oracle's own out and LSE as inputs, NaN-poisoned device
memory, the same tolerance of 4 roundings of the input type), restricted to the head dims the sm100
kernel takes, plus cases aimed at what only this kernel does: a CTA pair whose 256 keys straddle the
sequence end or the causal diagonal (one CTA of the pair fully masked), a pair no query sees (dK = dV =
0 without any MMA), long GQA walks (dK / dV accumulated in TMEM over every head of the group), and the
public `jax.grad`, which the CUDA routing table sends to fa4_jax.kernels.sm100.backward on 10.x.
Skipped on every other machine, including the H200.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
import numpy_reference
from kernel_cases import ROUNDING, Case, poison_device_memory
from fa4_jax.config import AttentionConfig
pytest.importorskip("cutlass")  # the kernel modules need nvidia-cutlass-dsl (Linux only)
import test_sm90_backward as sm90_grid  # noqa: E402
from fa4_jax.kernels import host  # noqa: E402
from fa4_jax.kernels.sm100 import backward as sm100_backward  # noqa: E402


def _is_blackwell() -> bool:
    try:
        return any(device.compute_capability.startswith("10.")
                   for device in jax.local_devices(backend="gpu"))
    except RuntimeError:
        return False


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _is_blackwell(), reason="needs a compute capability 10.x GPU")]

CASES = [case for case in sm90_grid.CASES if case.head_dim in sm100_backward.SUPPORTED_HEAD_DIMS] + [
    Case("pair-straddles-end", q_len=200, kv_len=300),        # pair 1: CTA 0 has 44 real keys, CTA 1 none
    Case("pair-second-cta-two-keys", q_len=130, kv_len=130, causal=True, head_dim=64),
    # Keys 0-589 lie left of every row's window: pairs 0 and 1 walk no query block (dK = dV = 0).
    Case("pairs-unseen", causal=True, window=(10, None), q_len=100, kv_len=700),
    Case("gqa8-long-causal", q_heads=16, kv_heads=2, causal=True, q_len=640, kv_len=640),
    Case("mqa-lengths-window", q_heads=8, kv_heads=1, q_lengths=True, kv_lengths=True, window=(100, 30),
         q_len=500, kv_len=600),
    Case("segments-softcap-fp16", segments=True, softcap=5.0, scale=1.0, dtype=jnp.float16, q_len=300, kv_len=300),
]


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_backward_matches_oracle(case: Case, inputs):
    _check_against_oracle(case, inputs)


# The sm90 grid's deterministic cases (every case whose key blocks start at different query blocks).
DETERMINISTIC_CASES = [case for case in CASES if case.name in sm90_grid.DETERMINISTIC_CASES
                       or case.name in ("gqa8-long-causal", "pairs-unseen")]


@pytest.mark.parametrize("case", DETERMINISTIC_CASES, ids=lambda case: case.name)
def test_deterministic_matches_oracle(case: Case, inputs):
    _check_against_oracle(case, inputs, deterministic=True)


@pytest.mark.parametrize("causal", [False, True])
def test_deterministic_is_bitwise_reproducible(causal, inputs):
    """Two runs of deterministic=True give the same bits (the pairs add dQ in turn order)."""
    batch, length, heads, dim = 2, 1000, 4, 128
    query, key, value, d_out = (inputs.normal((batch, length, heads, dim), jnp.bfloat16) for _ in range(4))
    config = AttentionConfig(scale=dim ** -0.5, causal=causal, deterministic=True)
    out64, lse64, _ = sm90_grid._oracle(query, key, value, d_out, None, dict(scale=config.scale, causal=causal))
    out = jnp.asarray(out64, jnp.float32).astype(jnp.bfloat16)
    lse = jnp.asarray(lse64, jnp.float32)
    options = sm100_backward.options(config, host.Problem.of(query, key, value))
    backward = jax.jit(lambda *a: sm100_backward.run(options, *a, None, {})[:3])
    first = backward(query, key, value, out, lse, d_out)
    second = backward(query, key, value, out, lse, d_out)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))


def _check_against_oracle(case: Case, inputs, deterministic=False):
    query, key, value, d_out, d_lse, options, optional, config = sm90_grid._make_problem(case, inputs)
    config = config.replace(deterministic=deterministic)
    problem = host.Problem.of(query, key, value)
    assert sm100_backward.unsupported_reason(config, problem) is None
    kernel_options = sm100_backward.options(config, problem)
    out64, lse64, expected = sm90_grid._oracle(query, key, value, d_out, d_lse, options)
    out = jnp.asarray(out64, jnp.float32).astype(case.dtype)
    lse = jnp.asarray(lse64, jnp.float32)
    poison_device_memory(sum(4 * g.size for g in expected.values() if g is not None))
    grads = jax.jit(lambda *a: sm100_backward.run(kernel_options, *a, optional))(
        query, key, value, out, lse, d_out, d_lse)
    tolerance = 4 * ROUNDING[case.dtype]
    for name, actual in zip(("dq", "dk", "dv", "dsinks"), grads):
        if expected[name] is None:
            assert actual is None
            continue
        actual = np.asarray(jnp.asarray(actual, jnp.float32))
        assert not np.any(np.isnan(actual)), f"{case.name} {name}: NaN"
        numpy_reference.assert_close(actual, expected[name], tolerance, f"{case.name} {name}")


def test_grad_through_public_api(inputs):
    """jax.grad of fa4_jax.attention(implementation='cute') on 10.x reaches this kernel (the routing table)."""
    batch, length, heads, dim = 2, 256, 4, 128
    query, key, value = (inputs.normal((batch, length, heads, dim), jnp.bfloat16) for _ in range(3))

    def loss(q, k, v, implementation):
        out = fa4_jax.attention(q, k, v, causal=True, implementation=implementation)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    grads = jax.jit(jax.grad(lambda *a: loss(*a, "cute"), argnums=(0, 1, 2)))(query, key, value)
    expected = jax.jit(jax.grad(lambda *a: loss(*a, "reference"), argnums=(0, 1, 2)))(query, key, value)
    for name, actual, wanted in zip("qkv", grads, expected):
        wanted = np.asarray(wanted.astype(jnp.float32), np.float64)
        numpy_reference.assert_close(np.asarray(actual.astype(jnp.float32)), wanted, 4 * 2.0 ** -8,
                                     f"d{name}")
