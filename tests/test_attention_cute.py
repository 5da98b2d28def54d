"""The CuTe kernels through `fa4_jax.attention(implementation="cute")` on the shared test grid (GPU).

The kernel engineers' own files (test_sm90_forward.py, ...) test each kernel directly; this one runs
every `AttentionTestBase` case that this GPU's kernels take through the public API, reverse mode (the
transpose of the JVP rule's tangent) and the CUDA dispatch. Cases are split by what the kernels take, so each runs once:
`TestCuteAttention` (forward and backward kernels both take it) and `TestCuteForwardOnly` (the
forward kernel does, the backward falls back). Cases no kernel takes are not collected here; the
dispatch tests check that they fall back or raise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from fa4_jax.config import AttentionConfig
from fa4_jax.lowering import cuda
from test_attention import AttentionTestBase, Case


def _kernel_takes(pass_: str, case: Case) -> bool:
    """Whether the CUDA dispatch runs `case`'s `pass_` ("forward" / "backward") on one of this GPU's
    kernels, through the routing table and the chosen module's `unsupported_reason` (True without a
    GPU: tests skip anyway)."""
    if cuda.compute_capability() is None:
        return True
    config = AttentionConfig(
        scale=case.scale or case.head_dim ** -0.5, causal=case.causal,
        window_left=case.window[0] if case.window else None, window_right=case.window[1] if case.window else None,
        softcap=case.softcap, has_sinks=case.sinks, has_segment_ids=case.segments is not None,
        has_q_seq_lengths=case.has_q_lengths, has_kv_seq_lengths=case.has_kv_lengths, implementation="cute")
    dtype = jnp.dtype(case.dtype)
    avals = (jax.ShapeDtypeStruct((case.batch, case.q_len, case.q_heads, case.head_dim), dtype),
             jax.ShapeDtypeStruct((case.batch, case.kv_len, case.kv_heads, case.head_dim), dtype),
             jax.ShapeDtypeStruct((case.batch, case.kv_len, case.kv_heads, case.v_dim), dtype))
    try:
        return cuda.kernel_for(pass_, config, *avals) is not None
    except NotImplementedError:  # implementation="cute" raises where no kernel takes the call
        return False


class TestCuteAttention(AttentionTestBase):
    pytestmark = pytest.mark.gpu
    implementation = "cute"
    default_dtype = "bfloat16"

    def supports(self, case: Case) -> bool:
        return _kernel_takes("forward", case) and _kernel_takes("backward", case)


class TestCuteForwardOnly(AttentionTestBase):
    pytestmark = pytest.mark.gpu
    implementation = "cute"
    default_dtype = "bfloat16"
    has_backward = False

    def supports(self, case: Case) -> bool:
        return _kernel_takes("forward", case) and not _kernel_takes("backward", case)
