"""The Blackwell forward kernel against the float64 NumPy oracle, on a compute-capability 10.x GPU.

No such GPU has been available: these tests have never run. They are the sm90 forward grid
(tests/test_sm90_forward.py: same cases, same NaN-poisoned outputs, same tolerances), restricted to
the head dims the sm100 kernel takes (today all of them) and pointed at it through
`fa4_jax.attention(implementation="cute")`, which the CUDA routing table sends to
fa4_jax.kernels.sm100.forward on 10.x; plus the lazy rescale / polynomial exp2 settings. They are
skipped on every other machine, including the H200.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import numpy_reference
from kernel_cases import poison_device_memory
pytest.importorskip("cutlass")  # the kernel modules need nvidia-cutlass-dsl (Linux only)
import test_sm90_forward as sm90_grid  # noqa: E402
from fa4_jax.kernels import host  # noqa: E402
from fa4_jax.kernels.sm100 import forward as sm100_forward  # noqa: E402


def _is_blackwell() -> bool:
    try:
        return any(device.compute_capability.startswith("10.")
                   for device in jax.local_devices(backend="gpu"))
    except RuntimeError:
        return False


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _is_blackwell(), reason="needs a compute capability 10.x GPU")]

CASES = [case for case in sm90_grid.CASES if case.head_dim in sm100_forward.SUPPORTED_HEAD_DIMS]


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_forward_matches_oracle(case, inputs):
    sm90_grid.test_forward_matches_oracle(case, inputs)


@pytest.mark.parametrize("threshold,poly_every", [(0.0, 0), (8.0, 0), (8.0, 4), (8.0, 1)])
def test_rescale_threshold_and_polynomial_exp2(threshold, poly_every, inputs):
    """As the sm90 test: logits whose running maximum keeps growing along the keys, causal."""
    from fa4_jax.config import AttentionConfig

    batch, length, heads, dim = 1, 700, 2, 128
    query = inputs.normal((batch, length, heads, dim), jnp.bfloat16)
    ramp = jnp.linspace(0.0, 4.0, length, dtype=jnp.float32)[None, :, None, None]
    key = (inputs.normal((batch, length, heads, dim)) * (1.0 + ramp)).astype(jnp.bfloat16)
    value = inputs.normal((batch, length, heads, dim), jnp.bfloat16)
    config = AttentionConfig(scale=dim ** -0.5, causal=True)
    expected_out, expected_lse = sm90_grid._oracle(query, key, value, dict(scale=config.scale, causal=True))
    poison_device_memory(4 * expected_out.size)
    options = sm100_forward.options(config, host.Problem.of(query, key, value), rescale_threshold=threshold,
                                    poly_exp2_every=poly_every)
    out, lse = jax.jit(lambda q, k, v: sm100_forward.run(options, q, k, v, {}))(query, key, value)
    assert not np.any(np.isnan(np.asarray(out.astype(jnp.float32))))
    numpy_reference.assert_close(out.astype(jnp.float32), expected_out, 2 * 2.0 ** -8, "out")
    numpy_reference.assert_close(lse, expected_lse, 2e-5, "lse")
