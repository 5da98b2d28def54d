"""The Hopper forward kernel against the float64 NumPy oracle, on an H200 (skipped without a GPU).

Each case draws fresh random inputs, poisons the device memory pool with NaN before the kernel runs
(an element the kernel forgets to write then shows up as NaN or garbage), and requires the kernel's
error to be within twice the error of the fa4_jax reference on the same bf16/fp16 inputs (plus a floor
of one bf16/fp16 rounding of the output), with -inf LSE and zero outputs on rows that see no key.

The grid covers every configuration `sm90.forward.options` picks: D = 64 causal both below and
above the three-warpgroup query-length cut, D = 96 / 128 with the Q double buffer and TMA store (split
key loop and zigzag tile order when causal), D = 256 causal with `LARGE_HEAD_CAUSAL` (ping-pong, TMA
store in two chunks, early Q release, zigzag tile order). DeepSeek MLA's D = 192 / Dv = 128, which
the kernel takes unpadded, has its own cases (MLA_CASES, `-k mla`): `fa4_jax.attention` must lower them
to the kernel at those dims (no padded V), match the oracle, and take their gradient through the
padded large-head backward. D = 80, which the kernel also takes unpadded (32-byte swizzled tiles, 5 TMA
boxes a tile), has its own cases too (D80_CASES, `-k d80`), lowered and checked the same way.

The kernel's tuning candidates (sm90.forward.TUNING_CANDIDATES, docs/sm90_forward_tuning.md) run a
smaller grid of the same cases through `sm90.forward.run` with the candidate's option overrides, so
one GPU run checks every candidate the benchmark times: `pytest tests/test_sm90_forward.py -k variant`.
CPU tests check the block arithmetic the split key loop relies on and the zigzag tile order.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
import numpy_reference
from kernel_cases import ROUNDING, Case, poison_device_memory
pytest.importorskip("cutlass")  # the kernel modules need nvidia-cutlass-dsl (Linux only)

gpu = pytest.mark.gpu

CASES = [
    *[Case(f"plain-d{d}", head_dim=d) for d in (64, 96, 128, 192, 256)],
    *[Case(f"fp16-d{d}", head_dim=d, dtype=jnp.float16) for d in (64, 128, 256)],
    *[Case(f"causal-d{d}", head_dim=d, causal=True, q_len=300, kv_len=300) for d in (64, 128, 192, 256)],
    Case("causal-cross", causal=True, q_len=100, kv_len=357),
    Case("causal-more-queries", causal=True, q_len=300, kv_len=150, head_dim=64),
    Case("window", window=(32, 16), q_len=300, kv_len=300),
    Case("window-causal-left", window=(70, None), causal=True, q_len=400, kv_len=400, head_dim=64),
    Case("gqa", q_heads=8, kv_heads=2, causal=True),
    Case("mqa-d256", q_heads=6, kv_heads=1, head_dim=256),
    Case("softcap", softcap=5.0, scale=1.0),
    Case("sinks", sinks=True),
    Case("sinks-causal-empty-rows", sinks=True, causal=True, q_len=300, kv_len=150, head_dim=64),
    Case("segments", segments=True, q_len=300, kv_len=300),
    Case("segments-causal-d64", segments=True, causal=True, q_len=300, kv_len=300, head_dim=64),
    Case("lengths", q_lengths=True, kv_lengths=True),
    Case("kv-lengths-causal", kv_lengths=True, causal=True, q_len=256, kv_len=512),
    Case("lengths-causal-fp16", q_lengths=True, kv_lengths=True, causal=True, dtype=jnp.float16),
    Case("persistent-many-tiles", batch=2, q_len=1024, kv_len=1024, q_heads=16, kv_heads=16, causal=True),
    Case("single-row", q_len=1, kv_len=77),
    # D = 64 causal with Sq above sm90_forward.THREE_WARPGROUPS_MIN_CAUSAL_Q_LEN: the three-warpgroup
    # configuration (the short causal D = 64 cases above take the two-warpgroup one), except the last two.
    Case("causal-d64-long", head_dim=64, causal=True, q_len=3000, kv_len=3000),
    Case("lengths-causal-d64-long-fp16", head_dim=64, causal=True, q_len=3000, kv_len=3100, q_lengths=True,
         kv_lengths=True, dtype=jnp.float16),
    Case("window-causal-left-d64-long", head_dim=64, causal=True, window=(300, None), q_len=3000, kv_len=3000),
    Case("sinks-gqa-causal-d64-long", head_dim=64, causal=True, q_len=3011, kv_len=3011, q_heads=8, kv_heads=2,
         sinks=True),
    # D = 192's tuned sets (ping-pong, three-chunk TMA store, early Q release; zigzag and the split key
    # loop when causal) with what changes their paths: clipped stores (odd lengths, sequence lengths),
    # Sq > Sk, GQA, a left window, softcap, sinks, segments, several tiles per CTA.
    Case("lengths-causal-gqa-fp16-d192", head_dim=192, q_lengths=True, kv_lengths=True, causal=True, q_heads=8,
         kv_heads=2, q_len=333, kv_len=300, dtype=jnp.float16),
    Case("causal-more-queries-d192", head_dim=192, causal=True, q_len=300, kv_len=150),
    Case("window-causal-left-sinks-d192", head_dim=192, window=(70, None), causal=True, sinks=True, q_len=400,
         kv_len=400),
    Case("softcap-segments-d192", head_dim=192, softcap=20.0, segments=True, q_len=300, kv_len=300),
    Case("persistent-many-tiles-d192", batch=2, q_len=1024, kv_len=1024, q_heads=16, kv_heads=16, head_dim=192),
    Case("persistent-many-tiles-causal-d192", batch=2, q_len=1024, kv_len=1024, q_heads=16, kv_heads=16,
         head_dim=192, causal=True),
    # D = 64 with a softcap, window or segments keeps two warpgroups at any length.
    Case("softcap-segments-causal-d64-long", head_dim=64, causal=True, q_len=3011, kv_len=3011, softcap=20.0,
         segments=True),
]


def _error(actual, expected) -> float:
    actual = numpy_reference.to_float64(actual)
    finite = np.isfinite(expected)
    if not np.any(finite):
        return 0.0
    magnitude = max(np.max(np.abs(expected[finite])), 1e-6)
    return float(np.max(np.abs(np.where(finite, actual, 0) - np.where(finite, expected, 0))) / magnitude)


def _make_inputs(case: Case, inputs):
    query = inputs.normal((case.batch, case.q_len, case.q_heads, case.head_dim), case.dtype)
    key = inputs.normal((case.batch, case.kv_len, case.kv_heads, case.head_dim), case.dtype)
    value = inputs.normal((case.batch, case.kv_len, case.kv_heads, case.v_head_dim or case.head_dim), case.dtype)
    options = dict(scale=case.scale, causal=case.causal, window=case.window, softcap=case.softcap)
    if case.sinks:
        options["sinks"] = inputs.normal((case.q_heads,), jnp.float32, scale=2.0)
    if case.segments:
        options["segment_ids"] = (inputs.segment_ids(case.batch, case.q_len, segments=4),
                                  inputs.segment_ids(case.batch, case.kv_len, segments=4))
        if case.q_len == case.kv_len:
            options["segment_ids"] = inputs.segment_ids(case.batch, case.q_len, segments=4)
    if case.q_lengths:
        options["q_seq_lengths"] = inputs.lengths(case.batch, case.q_len)
    if case.kv_lengths:
        options["kv_seq_lengths"] = inputs.lengths(case.batch, case.kv_len)
    return query, key, value, options


def _kernel_config(case: Case, options):
    """(optional operands, AttentionConfig) that fa4_jax.attention would pass the kernel for `options`."""
    from fa4_jax.config import AttentionConfig

    optional = {}
    if "sinks" in options:
        optional["sinks"] = options["sinks"]
    if "segment_ids" in options:
        ids = options["segment_ids"]
        optional["q_segment_ids"], optional["kv_segment_ids"] = ids if isinstance(ids, tuple) else (ids, ids)
    for name in ("q_seq_lengths", "kv_seq_lengths"):
        if name in options:
            optional[name] = options[name]
    window_left, window_right = case.window if case.window is not None else (None, None)
    config = AttentionConfig(
        scale=case.scale if case.scale is not None else case.head_dim ** -0.5, causal=case.causal,
        window_left=window_left, window_right=window_right, softcap=case.softcap, has_sinks=case.sinks,
        has_segment_ids=case.segments, has_q_seq_lengths=case.q_lengths, has_kv_seq_lengths=case.kv_lengths)
    return optional, config


def _numpy_options(options):
    """`fa4_jax.attention`'s keyword options as the oracle takes them (arrays as NumPy arrays)."""
    numpy_options = {name: (tuple(np.asarray(v) for v in value_) if isinstance(value_, tuple) else
                            (np.asarray(value_) if hasattr(value_, "shape") else value_))
                     for name, value_ in options.items()}
    numpy_options["window"] = options.get("window")
    return numpy_options


def _oracle(query, key, value, options):
    numpy_options = _numpy_options(options)
    return numpy_reference.attention_forward(
        numpy_reference.to_float64(query), numpy_reference.to_float64(key),
        numpy_reference.to_float64(value), **numpy_options)


@gpu
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_forward_matches_oracle(case: Case, inputs):
    query, key, value, options = _make_inputs(case, inputs)
    expected_out, expected_lse = _oracle(query, key, value, options)

    reference_out, reference_lse = fa4_jax.attention(
        query, key, value, return_lse=True, implementation="reference", **options)
    poison_device_memory(4 * expected_out.size + 4 * expected_lse.size)
    out, lse = jax.jit(lambda q, k, v: fa4_jax.attention(
        q, k, v, return_lse=True, implementation="cute", **options))(query, key, value)
    out, lse = np.asarray(out.astype(jnp.float32)), np.asarray(lse)

    assert not np.any(np.isnan(out)) and not np.any(np.isnan(lse)), "NaN in the kernel's outputs"
    rounding = ROUNDING[case.dtype]
    out_tolerance = 2 * max(_error(reference_out.astype(jnp.float32), expected_out), rounding)
    lse_tolerance = 2 * max(_error(reference_lse, expected_lse), 1e-5)
    numpy_reference.assert_close(out, expected_out, out_tolerance, f"{case.name} out")
    numpy_reference.assert_close(lse, expected_lse, lse_tolerance, f"{case.name} lse")


# DeepSeek MLA (D = 192, Dv = 128: sm90.forward.EXTRA_HEAD_DIM_PAIRS), which `fa4_jax.attention` runs
# on this kernel unpadded: the D = 192 sets at Dv = 128 with what changes their paths (odd lengths and
# lengths: clipped stores; Sq > Sk and Sq < Sk causal; GQA; a left window; softcap, sinks, segments;
# several tiles per CTA; one row).
MLA_CASES = [
    Case("mla", head_dim=192, v_head_dim=128),
    Case("mla-causal-more-queries-gqa", head_dim=192, v_head_dim=128, causal=True, q_len=333, kv_len=300,
         q_heads=8, kv_heads=2),
    Case("mla-causal-cross", head_dim=192, v_head_dim=128, causal=True, q_len=100, kv_len=357),
    Case("mla-lengths-causal-gqa-fp16", head_dim=192, v_head_dim=128, q_lengths=True, kv_lengths=True,
         causal=True, q_heads=8, kv_heads=2, q_len=333, kv_len=300, dtype=jnp.float16),
    Case("mla-window-causal-left-sinks", head_dim=192, v_head_dim=128, window=(70, None), causal=True,
         sinks=True, q_len=400, kv_len=400),
    Case("mla-softcap-segments", head_dim=192, v_head_dim=128, softcap=20.0, segments=True, q_len=300,
         kv_len=300),
    Case("mla-persistent-many-tiles-causal", head_dim=192, v_head_dim=128, batch=2, q_len=1024, kv_len=1024,
         q_heads=16, kv_heads=16, causal=True),
    Case("mla-single-row", head_dim=192, v_head_dim=128, q_len=1, kv_len=77),
]


def _tensor_type(shape, dtype) -> str:
    """How the lowered program spells an array type: tensor<2x197x4x192xbf16>."""
    element = {jnp.dtype(jnp.bfloat16): "bf16", jnp.dtype(jnp.float16): "f16"}[jnp.dtype(dtype)]
    return f"tensor<{'x'.join(str(size) for size in shape)}x{element}>"


def _kernel_calls(function, *arguments) -> dict:
    """{kernel name: the signatures "(operand types) -> (result types)" of its custom calls} in
    `function`'s lowering for CUDA: which kernels the CUDA rules chose, at which head dims."""
    text = jax.jit(function).trace(*arguments).lower(lowering_platforms=("cuda",)).as_text()
    calls = {}
    for line in text.splitlines():
        if "stablehlo.custom_call" in line:
            name = next((kernel for kernel in ("sm90_forward", "sm90_backward_large_heads", "sm90_backward")
                         if kernel in line), line)
            calls.setdefault(name, []).append(line.split(" : ")[-1])
    return calls


@gpu
@pytest.mark.parametrize("case", MLA_CASES, ids=lambda case: case.name)
def test_mla_runs_unpadded_and_matches_oracle(case: Case, inputs):
    """`fa4_jax.attention` of an MLA call lowers to one sm90 forward kernel call taking Q and K at 192
    and V at 128 and returning O at 128 (no padded copy in between), which matches the oracle."""
    query, key, value, options = _make_inputs(case, inputs)
    calls = _kernel_calls(lambda q, k, v: fa4_jax.attention(q, k, v, return_lse=True, implementation="cute",
                                                            **options), query, key, value)
    operands = ", ".join(_tensor_type(x.shape, case.dtype) for x in (query, key, value))
    out_type = _tensor_type(query.shape[:3] + (case.v_head_dim,), case.dtype)
    assert list(calls) == ["sm90_forward"] and len(calls["sm90_forward"]) == 1, calls
    assert calls["sm90_forward"][0].startswith(f"({operands}"), calls
    assert f"-> ({out_type}, " in calls["sm90_forward"][0], calls
    test_forward_matches_oracle(case, inputs)


# D = 80 at its own head dim (sm90.forward, "Head dims"): the tuned set of D = 96 / 128 (Q double buffer,
# TMA store; split key loop and mirrored tiles when causal) with what changes its paths: odd lengths
# (partial Q tiles, the TMA store's clipping), Sq > Sk and Sq < Sk, GQA, fp16, sequence lengths,
# softcap + window + sinks, segments, many tiles per CTA.
D80_CASES = [
    Case("plain-d80", head_dim=80),
    Case("fp16-gqa-d80", head_dim=80, q_heads=8, kv_heads=2, dtype=jnp.float16),
    Case("causal-odd-d80", head_dim=80, causal=True, q_len=301, kv_len=299),
    Case("causal-more-queries-gqa-d80", head_dim=80, causal=True, q_len=333, kv_len=150, q_heads=8, kv_heads=2),
    Case("causal-cross-d80", head_dim=80, causal=True, q_len=100, kv_len=357),
    Case("lengths-causal-fp16-d80", head_dim=80, q_lengths=True, kv_lengths=True, causal=True, dtype=jnp.float16),
    Case("softcap-window-sinks-d80", head_dim=80, softcap=5.0, scale=1.0, window=(32, 16), sinks=True, q_len=300,
         kv_len=300),
    Case("segments-causal-d80", head_dim=80, segments=True, causal=True, q_len=300, kv_len=300),
    Case("persistent-many-tiles-d80", head_dim=80, batch=2, q_len=1024, kv_len=1024, q_heads=16, kv_heads=16),
    Case("persistent-many-tiles-causal-d80", head_dim=80, batch=2, q_len=2048, kv_len=2048, q_heads=16,
         kv_heads=16, causal=True),
    Case("single-row-d80", head_dim=80, q_len=1, kv_len=77),
]


@gpu
@pytest.mark.parametrize("case", D80_CASES, ids=lambda case: case.name)
def test_d80_runs_unpadded_and_matches_oracle(case: Case, inputs):
    """`fa4_jax.attention` at D = 80 lowers to one sm90 forward kernel call taking Q, K, V and returning
    O at 80 (no padded copy to 96), which matches the oracle."""
    query, key, value, options = _make_inputs(case, inputs)
    calls = _kernel_calls(lambda q, k, v: fa4_jax.attention(q, k, v, return_lse=True, implementation="cute",
                                                            **options), query, key, value)
    operands = ", ".join(_tensor_type(x.shape, case.dtype) for x in (query, key, value))
    assert list(calls) == ["sm90_forward"] and len(calls["sm90_forward"]) == 1, calls
    assert calls["sm90_forward"][0].startswith(f"({operands}"), calls
    assert f"-> ({_tensor_type(query.shape, case.dtype)}, " in calls["sm90_forward"][0], calls
    test_forward_matches_oracle(case, inputs)


@gpu
@pytest.mark.parametrize("case", [case for case in MLA_CASES if case.name in (
    "mla-causal-more-queries-gqa", "mla-causal-cross", "mla-lengths-causal-gqa-fp16")], ids=lambda case: case.name)
def test_mla_gradient_through_public_api(case: Case, inputs):
    """jax.grad of an MLA call through `fa4_jax.attention`: the sm90 forward and the large-head backward
    both unpadded at 192/128 (V, O and dO reach the backward 128 wide), and the gradients against the
    float64 oracle (4 roundings of the input type, as the backward's own tests)."""
    query, key, value, options = _make_inputs(case, inputs)
    d_out = inputs.normal(query.shape[:3] + (case.v_head_dim,), case.dtype)

    def loss(q, k, v):
        out = fa4_jax.attention(q, k, v, implementation="cute", **options)
        return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32))
    gradient = jax.grad(loss, argnums=(0, 1, 2))
    calls = _kernel_calls(gradient, query, key, value)
    operands = ", ".join(_tensor_type(x.shape, case.dtype) for x in (query, key, value))
    d_out_type = _tensor_type(query.shape[:3] + (case.v_head_dim,), case.dtype)
    assert sorted(calls) == ["sm90_backward_large_heads", "sm90_forward"], calls
    assert [call.startswith(f"({operands}") for call in calls["sm90_forward"]] == [True], calls
    # (query, key, value, dO, ...): the call's own dims.
    assert [call.startswith(f"({operands}, {d_out_type}") for call in calls["sm90_backward_large_heads"]] == [True], calls

    grads = jax.jit(gradient)(query, key, value)
    expected = numpy_reference.attention_backward(
        *(numpy_reference.to_float64(x) for x in (query, key, value, d_out)), **_numpy_options(options))
    for name, actual in zip(("dq", "dk", "dv"), grads):
        actual = np.asarray(actual.astype(jnp.float32))
        assert not np.any(np.isnan(actual)), f"{case.name} {name}: NaN"
        numpy_reference.assert_close(actual, expected[name], 4 * ROUNDING[case.dtype], f"{case.name} {name}")


# Cases that reach every path a variant changes: odd lengths (partial Q tiles, TMA-store clipping),
# Sq > Sk (tiles with no visible key), lengths and fp16, a left window (the split key loop's third
# part), several tiles per CTA (Q-buffer and store-buffer reuse). GQA and segments change nothing a
# variant touches (split_masked_loop is off with segments).
VARIANT_CASES = ["plain-d128", "causal-more-queries", "lengths-causal-fp16", "window-causal-left",
                 "persistent-many-tiles"]


def _variant_grid():
    from fa4_jax.kernels.sm90 import forward as sm90_forward

    by_name = {case.name: case for case in CASES}
    for variant, (overrides, head_dims, _) in sm90_forward.TUNING_CANDIDATES.items():
        for case_name in VARIANT_CASES:
            for head_dim, v_head_dim in sm90_forward.candidate_head_dim_pairs(head_dims):
                case = dataclasses.replace(by_name[case_name], head_dim=head_dim,
                                           v_head_dim=None if v_head_dim == head_dim else v_head_dim)
                dims = f"d{head_dim}" + ("" if case.v_head_dim is None else f"-v{v_head_dim}")
                # "+" separates the fields: benchmarks/attention.py --exclude-failed reads the variant back.
                yield pytest.param(overrides, case, id=f"{variant}+{case_name}+{dims}")


@gpu
@pytest.mark.parametrize("overrides,case", list(_variant_grid()))
def test_variant_matches_oracle(overrides, case: Case, inputs):
    _check_overrides_against_oracle(overrides, case, inputs)


# The mirrored causal order (KernelOptions.mirrored_tiles, every causal default) with fewer CTAs than
# units, so each CTA walks several units and, where M is odd, skips the empty second tile of a middle
# unit: many tiles (M 8), Sq > Sk (M 3), three warpgroups (192 rows), lengths, a left window, GQA,
# D = 192's / D = 256's ping-pong sets, and D = 80 (M 16, and Sq > Sk with GQA).
MIRRORED_CASES = [("persistent-many-tiles", 7), ("causal-more-queries", 3), ("causal-d64-long", 5),
                  ("lengths-causal-fp16", 4), ("window-causal-left", 3), ("gqa", 3),
                  ("persistent-many-tiles-causal-d192", 11), ("causal-d256", 2),
                  ("persistent-many-tiles-causal-d80", 7), ("causal-more-queries-gqa-d80", 3)]


@gpu
@pytest.mark.parametrize("case_name,sm_count", MIRRORED_CASES, ids=[f"{n}-{c}" for n, c in MIRRORED_CASES])
def test_mirrored_order_on_few_ctas_matches_oracle(case_name, sm_count, inputs):
    case = {case.name: case for case in CASES + D80_CASES}[case_name]
    _check_overrides_against_oracle({"sm_count": sm_count, "mirrored_tiles": True}, case, inputs)


def _check_overrides_against_oracle(overrides, case: Case, inputs):
    from fa4_jax.kernels import host
    from fa4_jax.kernels.sm90 import forward as sm90_forward

    query, key, value, options = _make_inputs(case, inputs)
    expected_out, expected_lse = _oracle(query, key, value, options)
    reference_out, reference_lse = fa4_jax.attention(
        query, key, value, return_lse=True, implementation="reference", **options)
    optional, config = _kernel_config(case, options)
    poison_device_memory(4 * expected_out.size + 4 * expected_lse.size)
    kernel_options = sm90_forward.options(config, host.Problem.of(query, key, value), **overrides)
    out, lse = jax.jit(lambda q, k, v, optional: sm90_forward.run(kernel_options, q, k, v, optional))(
        query, key, value, optional)
    out, lse = np.asarray(out.astype(jnp.float32)), np.asarray(lse)

    assert not np.any(np.isnan(out)) and not np.any(np.isnan(lse)), "NaN in the kernel's outputs"
    out_tolerance = 2 * max(_error(reference_out.astype(jnp.float32), expected_out), ROUNDING[case.dtype])
    lse_tolerance = 2 * max(_error(reference_lse, expected_lse), 1e-5)
    numpy_reference.assert_close(out, expected_out, out_tolerance, f"{case.name} out")
    numpy_reference.assert_close(lse, expected_lse, lse_tolerance, f"{case.name} lse")


@gpu
@pytest.mark.parametrize("threshold,poly_every", [(0.0, 0), (8.0, 2), (8.0, 1)])
def test_rescale_threshold_and_polynomial_exp2(threshold, poly_every, inputs):
    """Classic (threshold 0) and lazy rescaling agree with the oracle, with and without FMA exp2,
    on logits whose running maximum keeps growing along the keys (the case lazy rescaling changes)."""
    from fa4_jax.config import AttentionConfig
    from fa4_jax.kernels import host
    from fa4_jax.kernels.sm90 import forward as sm90_forward

    batch, length, heads, dim = 1, 700, 2, 128
    query = inputs.normal((batch, length, heads, dim), jnp.bfloat16)
    ramp = jnp.linspace(0.0, 4.0, length, dtype=jnp.float32)[None, :, None, None]
    key = (inputs.normal((batch, length, heads, dim)) * (1.0 + ramp)).astype(jnp.bfloat16)
    value = inputs.normal((batch, length, heads, dim), jnp.bfloat16)
    config = AttentionConfig(scale=dim ** -0.5, causal=True)
    expected_out, expected_lse = _oracle(query, key, value, dict(scale=config.scale, causal=True))
    poison_device_memory(4 * expected_out.size)
    options = sm90_forward.options(config, host.Problem.of(query, key, value), rescale_threshold=threshold,
                                   poly_exp2_every=poly_every)
    out, lse = jax.jit(lambda q, k, v: sm90_forward.run(options, q, k, v, {}))(query, key, value)
    numpy_reference.assert_close(out.astype(jnp.float32), expected_out, 2 * 2.0 ** -8, "out")
    numpy_reference.assert_close(lse, expected_lse, 2e-5, "lse")


def test_unmasked_block_range_is_exactly_the_full_blocks(rng):
    """split_masked_loop runs blocks [first, end) of `unmasked_block_range` without masking code: they
    must be exactly the blocks `block_is_partial` calls full (CPU, Python ints)."""
    from fa4_jax.kernels.common import masking

    windows = [(None, None), (0, 0), (70, 10), (None, 33), (200, None), (5, None)]
    for causal, (left, right), q_lengths, segments in itertools.product(
            (False, True), windows, (False, True), (False, True)):
        shape = masking.MaskShape(causal=causal, window_left=left, window_right=right,
                                  has_q_lengths=q_lengths, has_segments=segments)
        for tile_m, tile_n in ((128, 128), (192, 128), (128, 64), (128, 176)):
            for _ in range(4):
                q_len, kv_len = (int(n) for n in rng.integers(1, 1500, size=2))
                q_valid = int(rng.integers(1, q_len + 1))
                offset = kv_len - q_valid
                for row_start in range(0, q_len, tile_m):
                    first, end = masking.unmasked_block_range(shape, row_start, tile_m, tile_n, kv_len, q_valid,
                                                              offset)
                    for n_block in range(-(-kv_len // tile_n) + 1):
                        full = not masking.block_is_partial(shape, n_block, row_start, tile_m, tile_n, kv_len,
                                                            q_valid, offset)
                        assert (first <= n_block < end) == full, (shape, tile_m, tile_n, q_len, kv_len, q_valid,
                                                                   row_start, n_block, first, end)


def test_zigzag_tiles_cover_every_tile_once():
    """zigzag_tiles: the persistent CTAs, each walking waves while its tile is below num_tiles, visit
    every tile exactly once (CPU, Python ints), and the longest-first waves balance better than the
    plain stride on the D = 256 causal 2k row (1024 tiles on 132 CTAs)."""
    from fa4_jax.kernels.common import tile_scheduler

    def walk(cta, grid, num_tiles):
        tile, wave = cta, 0
        while tile < num_tiles:
            yield tile
            wave += 1
            tile = tile_scheduler.zigzag_tile(wave, cta, grid)

    for num_tiles, grid in ((1024, 132), (7, 7), (10, 4), (265, 132), (1, 1)):
        seen = [tile for cta in range(grid) for tile in walk(cta, grid, num_tiles)]
        assert sorted(seen) == list(range(num_tiles)), (num_tiles, grid)

    # Key blocks per tile, longest first: query block m of 128 rows sees 2 (m + 1) key blocks of 64.
    num_m_blocks, heads_times_batch, grid = 16, 64, 132
    num_tiles = num_m_blocks * heads_times_batch
    blocks = [2 * (num_m_blocks - tile // heads_times_batch) for tile in range(num_tiles)]
    stride = max(sum(blocks[cta::grid]) for cta in range(grid))
    zigzag = max(sum(blocks[tile] for tile in walk(cta, grid, num_tiles)) for cta in range(grid))
    assert zigzag < stride, (zigzag, stride)
