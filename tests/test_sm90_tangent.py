"""The Hopper tangent kernel (forward-mode AD) against the float64 NumPy oracle, on an H200 (skipped
without a GPU).

The kernel gets the oracle's own out and LSE (out rounded to the kernel's type), so these tests do not
depend on the forward kernel; the last ones go through `jax.jvp` / `jax.linearize` of the public API.
Device memory is poisoned with NaN before each run, so an element the kernel forgets to write shows up.

Tolerance: the kernel rounds P and P o t_S to bf16/fp16 before the tensor-core GEMMs (as the backward
rounds P and dS), so its error is a few roundings of the inputs' type relative to the tangent's
magnitude: 4 roundings of max |expected| for t_out; t_lse is summed in float32 from float32 P and t_S.
"""

from __future__ import annotations

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
import numpy_reference
from kernel_cases import ROUNDING, Case, poison_device_memory
from fa4_jax.config import AttentionConfig
pytest.importorskip("cutlass")  # the kernel modules need nvidia-cutlass-dsl (Linux only)
from fa4_jax.kernels import host  # noqa: E402
from fa4_jax.kernels.sm90 import tangent as sm90_tangent  # noqa: E402

pytestmark = pytest.mark.gpu

CASES = [
    Case("plain-aligned", q_len=256, kv_len=256),
    *[Case(f"plain-d{d}", head_dim=d) for d in (64, 128)],
    Case("fp16", dtype=jnp.float16),
    Case("fp16-d64", dtype=jnp.float16, head_dim=64),
    *[Case(f"causal-d{d}", head_dim=d, causal=True, q_len=300, kv_len=300) for d in (64, 128)],
    Case("causal-cross", causal=True, q_len=100, kv_len=357),
    # Sq > Sk: the first query rows see no key (lse = -inf): both tangents must be 0 there.
    Case("causal-more-queries", causal=True, q_len=300, kv_len=150, head_dim=64),
    Case("window", window=(32, 16), q_len=300, kv_len=300),
    Case("window-causal-left", window=(70, None), causal=True, q_len=400, kv_len=400, head_dim=64),
    Case("gqa", q_heads=8, kv_heads=2, causal=True),
    Case("mqa-d64", q_heads=6, kv_heads=1, head_dim=64),
    Case("softcap", softcap=5.0, scale=1.0),
    Case("softcap-causal-d64", softcap=3.0, causal=True, head_dim=64, q_len=211, kv_len=211),
    Case("sinks", sinks=True),
    Case("sinks-causal-empty-rows", sinks=True, causal=True, q_len=300, kv_len=150, head_dim=64),
    Case("segments", segments=True, q_len=300, kv_len=300),
    Case("lengths-causal", q_lengths=True, kv_lengths=True, causal=True),
    Case("kv-lengths-causal-d64", kv_lengths=True, causal=True, q_len=256, kv_len=512, head_dim=64),
    Case("single-row", q_len=1, kv_len=77),
    Case("persistent-many-tiles", batch=2, q_len=1024, kv_len=1024, q_heads=16, kv_heads=4, causal=True),
]


# Head dims the tangent kernel reaches zero-padded (fa4_jax/lowering/head_padding.py): only through the API.
PADDED_CASES = [
    Case("padded-d80-causal-gqa", head_dim=80, causal=True, q_heads=8, kv_heads=2),
    Case("padded-d96-softcap-sinks", head_dim=96, softcap=5.0, scale=1.0, sinks=True),
    Case("padded-d40-lengths-causal", head_dim=40, q_lengths=True, kv_lengths=True, causal=True),
]


def _make_problem(case: Case, inputs):
    shape_q = (case.batch, case.q_len, case.q_heads, case.head_dim)
    shape_k = (case.batch, case.kv_len, case.kv_heads, case.head_dim)
    primals = [inputs.normal(shape_q, case.dtype), inputs.normal(shape_k, case.dtype), inputs.normal(shape_k, case.dtype)]
    tangents = [inputs.normal(x.shape, case.dtype) for x in primals]
    options, optional = dict(scale=case.scale, causal=case.causal, window=case.window, softcap=case.softcap), {}
    t_sinks = None
    if case.sinks:
        optional["sinks"] = options["sinks"] = inputs.normal((case.q_heads,), jnp.float32, scale=2.0)
        t_sinks = inputs.normal((case.q_heads,), jnp.float32)
    if case.segments:
        ids = inputs.segment_ids(case.batch, case.q_len, segments=4)
        options["segment_ids"] = ids
        optional["q_segment_ids"] = optional["kv_segment_ids"] = ids
    if case.q_lengths:
        optional["q_seq_lengths"] = options["q_seq_lengths"] = inputs.lengths(case.batch, case.q_len)
    if case.kv_lengths:
        optional["kv_seq_lengths"] = options["kv_seq_lengths"] = inputs.lengths(case.batch, case.kv_len)
    config = AttentionConfig(
        scale=case.scale if case.scale is not None else case.head_dim ** -0.5, causal=case.causal,
        window_left=case.window[0] if case.window else None,
        window_right=case.window[1] if case.window else None, softcap=case.softcap,
        has_sinks=case.sinks, has_segment_ids=case.segments, has_q_seq_lengths=case.q_lengths,
        has_kv_seq_lengths=case.kv_lengths)
    return primals, tangents, t_sinks, options, optional, config


def _numpy(options):
    return {name: (np.asarray(value) if hasattr(value, "shape") else value) for name, value in options.items()}


def _oracle(primals, tangents, t_sinks, options):
    as64 = numpy_reference.to_float64
    out, lse = numpy_reference.attention_forward(*(as64(x) for x in primals), **_numpy(options))
    t_out, t_lse = numpy_reference.attention_tangent(
        *(as64(x) for x in primals), *(as64(t) for t in tangents), None if t_sinks is None else as64(t_sinks),
        **_numpy(options))
    return out, lse, t_out, t_lse


def _check(case, t_out, t_lse, expected_t_out, expected_t_lse, lse):
    t_out, t_lse = np.asarray(t_out.astype(jnp.float32)), np.asarray(t_lse)
    assert not np.any(np.isnan(t_out)) and not np.any(np.isnan(t_lse)), "NaN in the kernel's outputs"
    numpy_reference.assert_close(t_out, expected_t_out, 4 * ROUNDING[case.dtype], f"{case.name} t_out")
    numpy_reference.assert_close(t_lse, expected_t_lse, 4 * ROUNDING[case.dtype], f"{case.name} t_lse")
    empty = ~np.isfinite(lse)   # rows that see no key and have no sink
    assert np.all(t_lse[empty] == 0) and np.all(np.moveaxis(t_out, 2, 1)[empty] == 0), "empty rows not zero"


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_tangent_matches_oracle(case: Case, inputs):
    primals, tangents, t_sinks, options, optional, config = _make_problem(case, inputs)
    out, lse, expected_t_out, expected_t_lse = _oracle(primals, tangents, t_sinks, options)
    problem = host.Problem.of(*primals)
    assert sm90_tangent.unsupported_reason(config, problem) is None
    kernel_options = sm90_tangent.options(config, problem)
    out = jnp.asarray(out, jnp.float32).astype(case.dtype)
    lse = jnp.asarray(lse, jnp.float32)
    poison_device_memory(4 * expected_t_out.size + 4 * expected_t_lse.size)
    t_out, t_lse = jax.jit(functools.partial(sm90_tangent.run, kernel_options))(
        *primals, out, lse, *tangents, t_sinks, optional)
    _check(case, t_out, t_lse, expected_t_out, expected_t_lse, np.asarray(lse))


@pytest.mark.parametrize("case", [case for case in CASES if case.name in
                                  ("causal-cross", "gqa", "sinks-causal-empty-rows", "softcap", "lengths-causal",
                                   "segments", "window-causal-left")] + PADDED_CASES, ids=lambda case: case.name)
def test_jvp_through_the_api_matches_oracle(case: Case, inputs):
    """jax.jvp of fa4_jax.attention (out and lse) runs the forward kernel and then the tangent kernel
    (implementation="cute" would raise were either missing; head dims 40 / 80 / 96 zero-padded to the
    tangent kernel's 64 / 128) and equals the float64 oracle."""
    primals, tangents, t_sinks, options, _, _ = _make_problem(case, inputs)
    _, lse, expected_t_out, expected_t_lse = _oracle(primals, tangents, t_sinks, options)
    sinks = options.pop("sinks", None)

    def function(q, k, v, s):
        return fa4_jax.attention(q, k, v, sinks=s, return_lse=True, implementation="cute", **options)

    poison_device_memory(4 * expected_t_out.size + 4 * expected_t_lse.size)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no fallback warning: the kernels run
        _, (t_out, t_lse) = jax.jit(lambda p, t: jax.jvp(function, p, t))((*primals, sinks), (*tangents, t_sinks))
    _check(case, t_out, t_lse, expected_t_out, expected_t_lse, lse)


def test_linearize_and_jacfwd_run_the_kernel(inputs):
    """jax.linearize's linear function and jax.jacfwd (a vmapped tangent) agree with the oracle's JVP."""
    case = Case("linearize", q_len=70, kv_len=90, q_heads=4, kv_heads=2, causal=True, batch=1)
    primals, tangents, _, options, _, _ = _make_problem(case, inputs)
    _, lse, expected_t_out, expected_t_lse = _oracle(primals, tangents, None, options)
    function = lambda q, k, v: fa4_jax.attention(q, k, v, return_lse=True, implementation="cute", **options)
    _, linear = jax.jit(lambda *p: jax.linearize(function, *p))(*primals)
    t_out, t_lse = jax.jit(linear)(*tangents)
    _check(case, t_out, t_lse, expected_t_out, expected_t_lse, lse)
    # jacfwd with respect to the value of one key: Dv tangent directions at once, through vmap.
    small = lambda v_row: function(primals[0], primals[1], primals[2].at[0, 3, 1].set(v_row))[0].astype(jnp.float32)
    jacobian = jax.jit(jax.jacfwd(small))(primals[2][0, 3, 1].astype(jnp.float32).astype(case.dtype))
    assert jacobian.shape == primals[0].shape + (case.head_dim,) and bool(jnp.isfinite(jacobian).all())


def test_unsupported_head_dim_falls_back_with_the_reason(inputs):
    """D = 192 has no tangent kernel to pad to: None warns naming why and runs the reference; "cute"
    refuses."""
    from fa4_jax.lowering import cuda

    primals = [inputs.normal((1, 40, 2, 192), jnp.bfloat16) for _ in range(3)]
    tangents = [inputs.normal(x.shape, jnp.bfloat16) for x in primals]
    reason = ("the tangent kernels for compute capability 9.x take head dims up to 128 (smaller ones zero-padded "
              "to one of (64, 128)), not 192")
    cuda._warned.discard(reason)
    with pytest.warns(UserWarning, match="tangent runs on the XLA reference path because " + re.escape(reason)):
        jax.jit(lambda p, t: jax.jvp(lambda *a: fa4_jax.attention(*a, causal=True), p, t))(primals, tangents)
    with pytest.raises(NotImplementedError, match="implementation='cute' cannot run this attention tangent pass"):
        jax.jit(lambda p, t: jax.jvp(lambda *a: fa4_jax.attention(*a, implementation="cute"), p, t))(primals, tangents)
