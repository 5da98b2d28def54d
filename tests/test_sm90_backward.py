"""The Hopper backward kernel against the float64 NumPy oracle, on an H200 (skipped without a GPU).

The kernel gets the oracle's own out and LSE (rounded to the kernel's types), so these tests do not
depend on the forward kernel; one test goes through `jax.grad` of the public API as well. Device memory
is poisoned with NaN before each run, so an element the kernel forgets to write shows up.

Tolerance: the kernel rounds P and dS to bf16/fp16 before the tensor-core GEMMs (as every
FlashAttention backward does), so its error is a few roundings of the inputs' type relative to the
gradient's magnitude: we allow 4 roundings of max |expected|. (The fa4_jax reference, fp32 throughout,
is within ~1e-6 of the oracle on these inputs, so "2x the reference's error" would be tighter than any
bf16 kernel can be; compiling it per case on the GPU also cost ~10 s each.) Measured on the H200 against
the reference: 3e-3 to 6e-3 for bf16.
"""

from __future__ import annotations

import dataclasses

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
from fa4_jax.kernels.sm90 import backward as sm90_backward  # noqa: E402

pytestmark = pytest.mark.gpu

CASES = [
    Case("plain-aligned", q_len=256, kv_len=256),
    *[Case(f"plain-d{d}", head_dim=d) for d in (64, 128)],
    Case("fp16", dtype=jnp.float16),
    *[Case(f"causal-d{d}", head_dim=d, causal=True, q_len=300, kv_len=300) for d in (64, 128)],
    Case("causal-cross", causal=True, q_len=100, kv_len=357),
    Case("causal-more-queries", causal=True, q_len=300, kv_len=150, head_dim=64),
    Case("window", window=(32, 16), q_len=300, kv_len=300),
    Case("window-causal-left", window=(70, None), causal=True, q_len=400, kv_len=400, head_dim=64),
    Case("gqa", q_heads=8, kv_heads=2, causal=True),
    Case("softcap", softcap=5.0, scale=1.0),
    Case("sinks-dlse", sinks=True, d_lse=True),
    Case("sinks-causal-empty-rows", sinks=True, causal=True, q_len=300, kv_len=150, head_dim=64),
    Case("segments", segments=True, q_len=300, kv_len=300),
    Case("lengths-causal", q_lengths=True, kv_lengths=True, causal=True),
    Case("single-row", q_len=1, kv_len=77),
    Case("d64-causal-gqa", head_dim=64, causal=True, q_heads=8, kv_heads=2, q_len=300, kv_len=300),
    Case("plain-d96", head_dim=96),
    Case("causal-gqa-d96", head_dim=96, causal=True, q_heads=8, kv_heads=2, q_len=300, kv_len=300),
    Case("gqa-long", q_heads=8, kv_heads=2, q_len=700, kv_len=900),
]

# The default, and the candidates under measurement: the grid launched key block slowest (longest
# walks first); the dQ staging as a swizzled tile with TMA tensor reduces (the default stages it in the
# accumulator's register order); dS^T staged with plain 32-bit stores (the default uses stmatrix,
# docs/sm90_backward_tuning.md, "SASS budget"); every 4th / 6th exp2 of P on the FMA pipe;
# deterministic full-mask walks from the first query block with the turns highest key block first (the
# default rotates them, `Tuning.rotated_turns`); dS^T stored before dV is issued; the staged row statistics
# loaded before the waits; the staged dQ published after the dK wait. Select their tests with
# `-k key_blocks_outer`, `-k tiled_dq`, `-k ds_plain_store`, `-k poly_exp2`, `-k plain_turns`,
# `-k ds_store_first`, `-k row_stats_early`, `-k dq_publish_after_dk` or `-k rotated_turns` (the default's
# own rotated-walk cases).
TUNINGS = {
    "default": sm90_backward.DEFAULT_TUNING,
    "key_blocks_outer": dataclasses.replace(sm90_backward.DEFAULT_TUNING, key_blocks_outer=True),
    "tiled_dq": dataclasses.replace(sm90_backward.DEFAULT_TUNING, flat_dq=False),
    "ds_plain_store": dataclasses.replace(sm90_backward.DEFAULT_TUNING, ds_stmatrix=False),
    "poly_exp2_4": dataclasses.replace(sm90_backward.DEFAULT_TUNING, poly_exp2_every=4),
    "poly_exp2_6": dataclasses.replace(sm90_backward.DEFAULT_TUNING, poly_exp2_every=6),
    "plain_turns": dataclasses.replace(sm90_backward.DEFAULT_TUNING, rotated_turns=False),
    "ds_store_first": dataclasses.replace(sm90_backward.DEFAULT_TUNING, ds_store_first=True),
    "row_stats_early": dataclasses.replace(sm90_backward.DEFAULT_TUNING, row_stats_early=True),
    "dq_publish_after_dk": dataclasses.replace(sm90_backward.DEFAULT_TUNING, dq_publish_after_dk=True),
}
# Rotated turns beyond the shared cases: more key blocks than query blocks (several key blocks reach a
# tile at the same step of their walks), query and key lengths, each also with head splits of 2.
ROTATED_TURN_CASES = [Case("more-keys", q_len=130, kv_len=1500, q_heads=8, kv_heads=2),
                      Case("lengths-gqa", q_lengths=True, kv_lengths=True, q_len=700, kv_len=900, q_heads=8,
                           kv_heads=2, head_dim=64)]

# Head splits (`Tuning.head_splits`): the CTAs sharing a (key block, KV head) add fp32 partial dK / dV.
# GQA and MQA groups of 4, 8 and 16, each with every split of 2, 4, 8, 16 that divides it (the largest:
# one query head per CTA); lengths off the tiles (Sq not a multiple of 64, Sk not of 128). The default
# tuning reaches head splits too: `head_splits_for` splits the GQA cases above.
HEAD_SPLIT_CASES = [
    Case("gqa4-causal", q_heads=8, kv_heads=2, causal=True, q_len=300, kv_len=333),
    Case("gqa4-d64", head_dim=64, q_heads=8, kv_heads=2),
    Case("gqa8-causal-cross-d96", head_dim=96, q_heads=16, kv_heads=2, causal=True, q_len=100, kv_len=357),
    Case("mqa16-causal", q_heads=16, kv_heads=1, batch=1, causal=True, q_len=333, kv_len=333),
    Case("mqa8-d64", head_dim=64, q_heads=8, kv_heads=1),
    Case("mqa8-causal-more-queries", q_heads=8, kv_heads=1, causal=True, q_len=300, kv_len=150, head_dim=64),
    Case("gqa4-lengths-causal", q_heads=8, kv_heads=2, q_lengths=True, kv_lengths=True, causal=True),
    Case("gqa4-window", q_heads=8, kv_heads=2, window=(32, 16), q_len=300, kv_len=300),
    Case("gqa4-softcap", q_heads=8, kv_heads=2, softcap=5.0, scale=1.0),
    Case("gqa4-segments", q_heads=8, kv_heads=2, segments=True, q_len=300, kv_len=300),
]
HEAD_SPLITS = (2, 4, 8, 16)
# Deterministic mode takes head splits of 2 (two partial sums add onto zero in either order alike).
DETERMINISTIC_HEAD_SPLIT_CASES = ["gqa4-causal", "gqa8-causal-cross-d96", "mqa16-causal",
                                  "gqa4-lengths-causal", "gqa4-window"]


# 128 query rows per block (`Tuning.query_rows`, head dim 64 only, without softcap or segment ids; the
# default there) and 64 forced: the D = 64 cases, and the others that make sense at D = 64, with
# lengths off the 128-row blocks; default and deterministic.
WIDE_QUERY_CASES = [case if case.head_dim == 64 else dataclasses.replace(case, name=f"{case.name}-d64", head_dim=64)
                    for case in CASES if case.head_dim in (64, 128) and case.name not in ("plain-d128", "causal-d128")
                    and case.softcap is None and not case.segments]
WIDE_QUERY_TUNINGS = {f"query_rows_{rows}{'' if flat else '_tiled_dq'}": dataclasses.replace(
    sm90_backward.DEFAULT_TUNING, query_rows=rows, flat_dq=flat) for rows in (64, 128) for flat in (False, True)}
# At 128 rows the default splits dQ between the warp groups by query rows (`Tuning.dq_row_split`); the
# column split it replaced, with its 128 rows forced (the default gives them up for head splits on GQA).
# Select with `-k dq_column_split`.
WIDE_QUERY_TUNINGS["dq_column_split"] = dataclasses.replace(
    sm90_backward.DEFAULT_TUNING, dq_row_split=False, query_rows=sm90_backward.WIDE_QUERY_ROWS)


# 80 query rows per block at D = 128 forced (`Tuning.query_rows=80`: dQ computed transposed, one dQ staging
# buffer; the default takes them without a mask, so the shared cases run them there), outside deterministic
# mode and without softcap or segment ids (refused there): the cases at D = 128, those of other head dims
# whose lengths or masks differ, moved to D = 128 (lengths off the 80-row blocks everywhere), causal and
# windowed ones included, GQA unsplit. Select with `-k query_rows_80`.
ROWS_80_CASES = [case if case.head_dim == 128 else dataclasses.replace(case, name=f"{case.name}-d128", head_dim=128)
                 for case in CASES if case.softcap is None and not case.segments
                 and case.name not in ("plain-d64", "causal-d64", "plain-d96")]
ROWS_80 = dataclasses.replace(sm90_backward.DEFAULT_TUNING, query_rows=80)


def _head_split_parameters(cases, splits=HEAD_SPLITS):
    """(case, head_splits) for every split that divides the case's group; ids `split<n>-<case>`."""
    return [pytest.param(case, head_splits, id=f"split{head_splits}-{case.name}")
            for case in cases for head_splits in splits if (case.q_heads // case.kv_heads) % head_splits == 0]


# Deterministic mode again on every case whose key blocks start at different query blocks (causal,
# windows, Sq != Sk, GQA, lengths), where a wrong dQ turn would hang or race.
DETERMINISTIC_CASES = ["plain-d64", "causal-d128", "causal-cross", "causal-more-queries", "window",
                       "window-causal-left", "gqa", "segments", "lengths-causal", "causal-gqa-d96",
                       "gqa-long"]


def _make_problem(case: Case, inputs):
    v_head_dim = case.v_head_dim or case.head_dim
    shape_q = (case.batch, case.q_len, case.q_heads, case.head_dim)
    shape_k = (case.batch, case.kv_len, case.kv_heads, case.head_dim)
    query, key, value = (inputs.normal(shape_q, case.dtype), inputs.normal(shape_k, case.dtype),
                         inputs.normal(shape_k[:3] + (v_head_dim,), case.dtype))
    d_out = inputs.normal(shape_q[:3] + (v_head_dim,), case.dtype)
    options, optional = dict(scale=case.scale, causal=case.causal, window=case.window,
                             softcap=case.softcap), {}
    if case.sinks:
        optional["sinks"] = options["sinks"] = inputs.normal((case.q_heads,), jnp.float32, scale=2.0)
    if case.segments:
        ids = inputs.segment_ids(case.batch, case.q_len, segments=4)
        options["segment_ids"] = ids
        optional["q_segment_ids"] = optional["kv_segment_ids"] = ids
    if case.q_lengths:
        optional["q_seq_lengths"] = options["q_seq_lengths"] = inputs.lengths(case.batch, case.q_len)
    if case.kv_lengths:
        optional["kv_seq_lengths"] = options["kv_seq_lengths"] = inputs.lengths(case.batch, case.kv_len)
    d_lse = inputs.normal((case.batch, case.q_heads, case.q_len), jnp.float32) if case.d_lse else None
    config = AttentionConfig(
        scale=case.scale if case.scale is not None else case.head_dim ** -0.5, causal=case.causal,
        window_left=case.window[0] if case.window else None,
        window_right=case.window[1] if case.window else None, softcap=case.softcap,
        has_sinks=case.sinks, has_segment_ids=case.segments, has_q_seq_lengths=case.q_lengths,
        has_kv_seq_lengths=case.kv_lengths)
    return query, key, value, d_out, d_lse, options, optional, config


def _numpy_options(options):
    return {name: (np.asarray(value) if hasattr(value, "shape") else value)
            for name, value in options.items()}


def _oracle(query, key, value, d_out, d_lse, options):
    as64 = numpy_reference.to_float64
    numpy_options = _numpy_options(options)
    out, lse = numpy_reference.attention_forward(as64(query), as64(key), as64(value), **numpy_options)
    grads = numpy_reference.attention_backward(
        as64(query), as64(key), as64(value), as64(d_out),
        None if d_lse is None else np.asarray(d_lse, np.float64), **numpy_options)
    return out, lse, grads


@pytest.mark.parametrize("tuning", sorted(TUNINGS))
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_backward_matches_oracle(case: Case, tuning, inputs):
    _check_against_oracle(case, TUNINGS[tuning], inputs)


@pytest.mark.parametrize("tuning", sorted(TUNINGS))
@pytest.mark.parametrize("case", [case for case in CASES if case.name in DETERMINISTIC_CASES],
                         ids=lambda case: case.name)
def test_deterministic_matches_oracle(case: Case, tuning, inputs):
    _check_against_oracle(case, TUNINGS[tuning], inputs, deterministic=True)


@pytest.mark.parametrize("flat_dq", [True, False], ids=["flat_dq", "tiled_dq"])
@pytest.mark.parametrize("case,head_splits", _head_split_parameters(HEAD_SPLIT_CASES))
def test_head_splits_match_oracle(case: Case, head_splits, flat_dq, inputs):
    tuning = dataclasses.replace(sm90_backward.DEFAULT_TUNING, head_splits=head_splits, flat_dq=flat_dq)
    _check_against_oracle(case, tuning, inputs)


@pytest.mark.parametrize("tuning", sorted(TUNINGS))
@pytest.mark.parametrize("case,head_splits", _head_split_parameters(
    [case for case in HEAD_SPLIT_CASES if case.name in DETERMINISTIC_HEAD_SPLIT_CASES], (2,)))
def test_deterministic_head_splits_match_oracle(case: Case, head_splits, tuning, inputs):
    tuning = dataclasses.replace(TUNINGS[tuning], head_splits=head_splits)
    _check_against_oracle(case, tuning, inputs, deterministic=True)


@pytest.mark.parametrize("head_splits", [1, 2])
@pytest.mark.parametrize("case", ROTATED_TURN_CASES, ids=lambda case: case.name)
def test_rotated_turns_match_oracle(case: Case, head_splits, inputs):
    tuning = dataclasses.replace(TUNINGS["default"], head_splits=head_splits)
    query, key, value, *_, config = _make_problem(case, inputs)
    options = sm90_backward.options(config.replace(deterministic=True), host.Problem.of(query, key, value), tuning)
    assert options.tuning.rotated_turns, "resolved off: the case would not test the rotated walk"
    _check_against_oracle(case, tuning, inputs, deterministic=True)


# Two dQ writer warps, one per staging buffer (deterministic mode's default, `Tuning.dq_writers`): each tile's
# adds keep their turns, so the gradients are one writer's bit for bit (the inputs are drawn once per test:
# both runs see the same). The deterministic cases, the rotated walk's, head splits of 2, the sanitizer
# shapes and the tiled dQ staging. Select with `-k two_dq_writers`.
TWO_DQ_WRITER_CASES = ([case for case in CASES if case.name in DETERMINISTIC_CASES] + ROTATED_TURN_CASES
                       + [Case(f"sanitizer-d{d}{'-causal' if causal else ''}", head_dim=d, batch=1, q_heads=2,
                               kv_heads=2, q_len=200, kv_len=200, causal=causal)
                          for d in (64, 128) for causal in (False, True)])


@pytest.mark.parametrize("head_splits, flat_dq", [(1, True), (2, True), (1, False)],
                         ids=["one-split", "head-splits-2", "tiled-dq"])
@pytest.mark.parametrize("case", TWO_DQ_WRITER_CASES, ids=lambda case: case.name)
def test_two_dq_writers_match_one_bit_for_bit(case: Case, head_splits, flat_dq, inputs):
    if head_splits > 1 and case.q_heads == case.kv_heads:
        pytest.skip("head splits need a GQA group")
    two = dataclasses.replace(sm90_backward.DEFAULT_TUNING, head_splits=head_splits, flat_dq=flat_dq)
    assert two.dq_writers == sm90_backward.DQ_BUFFERS
    one = dataclasses.replace(two, dq_writers=1)
    _check_same_bits_deterministic(case, one, two, inputs)


def _check_same_bits_deterministic(case: Case, tuning, other, inputs, kernel=sm90_backward):
    """Deterministic `kernel.run` with `tuning` and with `other` on the same draws: each against the oracle,
    and the gradients of the two equal bit for bit (candidates that change when dQ adds are issued, not
    their order in a tile)."""
    state = inputs.generator.bit_generator.state
    first = _check_against_oracle(case, tuning, inputs, deterministic=True, kernel=kernel)
    inputs.generator.bit_generator.state = state   # the same draws again
    second = _check_against_oracle(case, other, inputs, deterministic=True, kernel=kernel)
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), first, second):
        if a is not None:
            assert np.array_equal(np.asarray(jnp.asarray(a, jnp.float32)), np.asarray(jnp.asarray(b, jnp.float32))), \
                f"{case.name} {name}: {other} differs from {tuning}"


@pytest.mark.parametrize("tuning", sorted(WIDE_QUERY_TUNINGS))
@pytest.mark.parametrize("deterministic", [False, True], ids=["unordered_dq", "deterministic"])
@pytest.mark.parametrize("case", WIDE_QUERY_CASES, ids=lambda case: case.name)
def test_wide_query_blocks_match_oracle(case: Case, deterministic, tuning, inputs):
    _check_against_oracle(case, WIDE_QUERY_TUNINGS[tuning], inputs, deterministic=deterministic)


@pytest.mark.parametrize("case", ROWS_80_CASES, ids=lambda case: case.name)
def test_query_rows_80_match_oracle(case: Case, inputs):
    _check_against_oracle(case, ROWS_80, inputs)


def _check_against_oracle(case: Case, tuning, inputs, deterministic=False, kernel=sm90_backward):
    """`kernel.run` (this module's kernel or its large-head twin) with `tuning` on the oracle's out and
    LSE, against the oracle's gradients; returns the kernel's gradients."""
    query, key, value, d_out, d_lse, options, optional, config = _make_problem(case, inputs)
    config = config.replace(deterministic=deterministic)
    problem = host.Problem.of(query, key, value)
    assert kernel.unsupported_reason(config, problem) is None
    kernel_options = kernel.options(config, problem, tuning)
    out64, lse64, expected = _oracle(query, key, value, d_out, d_lse, options)
    out = jnp.asarray(out64, jnp.float32).astype(case.dtype)
    lse = jnp.asarray(lse64, jnp.float32)

    poison_device_memory(sum(4 * g.size for g in expected.values() if g is not None))
    grads = jax.jit(lambda *a: kernel.run(kernel_options, *a, optional))(
        query, key, value, out, lse, d_out, d_lse)

    tolerance = 4 * ROUNDING[case.dtype]
    for name, actual in zip(("dq", "dk", "dv", "dsinks"), grads):
        if expected[name] is None:
            assert actual is None
            continue
        actual = np.asarray(jnp.asarray(actual, jnp.float32))
        assert not np.any(np.isnan(actual)), f"{case.name} {name}: NaN"
        numpy_reference.assert_close(actual, expected[name], tolerance, f"{case.name} {name}")
    return grads


# Small shapes for compute-sanitizer (racecheck on shared memory, memcheck with one allocation per
# buffer): select with `-k sanitizer_shapes`, docs/sm90_backward_tuning.md has the commands.
@pytest.mark.parametrize("tuning", sorted(TUNINGS))
@pytest.mark.parametrize("deterministic", [False, True], ids=["unordered_dq", "deterministic"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_sanitizer_shapes(head_dim, causal, deterministic, tuning, inputs):
    case = Case(f"sanitizer-d{head_dim}", head_dim=head_dim, batch=1, q_heads=2, kv_heads=2,
                q_len=200, kv_len=200, causal=causal)
    _check_against_oracle(case, TUNINGS[tuning], inputs, deterministic=deterministic)


@pytest.mark.parametrize("causal,tuning", [(causal, tuning) for tuning in sorted(TUNINGS) for causal in (False, True)])
def test_deterministic_is_bitwise_reproducible(causal, tuning, inputs):
    """deterministic=True: ten runs give identical bits (many key blocks add into each dQ tile)."""
    batch, length, heads, dim = 2, 1024, 4, 128
    query, key, value, d_out = (inputs.normal((batch, length, heads, dim), jnp.bfloat16)
                                for _ in range(4))
    config = AttentionConfig(scale=dim ** -0.5, causal=causal, deterministic=True)
    as64 = numpy_reference.to_float64
    out, lse = numpy_reference.attention_forward(as64(query), as64(key), as64(value), causal=causal)
    out, lse = jnp.asarray(out, jnp.float32).astype(jnp.bfloat16), jnp.asarray(lse, jnp.float32)
    problem = host.Problem.of(query, key, value)
    options = sm90_backward.options(config, problem, TUNINGS[tuning])
    backward = jax.jit(lambda *a: sm90_backward.run(options, *a, None, {})[:3])
    first = [np.asarray(g.astype(jnp.float32)) for g in backward(query, key, value, out, lse, d_out)]
    for _ in range(9):
        again = backward(query, key, value, out, lse, d_out)
        for a, b in zip(first, again):
            assert np.array_equal(a, np.asarray(b.astype(jnp.float32)))
    loose_options = sm90_backward.options(config.replace(deterministic=False), problem)
    loose = jax.jit(lambda *a: sm90_backward.run(loose_options, *a, None, {})[:3])(
        query, key, value, out, lse, d_out)
    for a, b in zip(first, loose):
        np.testing.assert_allclose(a, np.asarray(b.astype(jnp.float32)), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("causal", [False, True])
def test_deterministic_head_splits_are_bitwise_reproducible(causal, inputs):
    """deterministic=True with head splits of 2 (GQA 4, lengths off the tiles): ten runs give identical
    bits. dQ is the unsplit kernel's bit for bit (each query head is still walked by one CTA per key
    block, whose dQ adds take the same turns), so the split walks exactly the heads it should; dK and
    dV, summed in another order, are close to the unsplit ones."""
    batch, length, q_heads, kv_heads, dim = 2, 1000, 8, 2, 128
    query, d_out = (inputs.normal((batch, length, q_heads, dim), jnp.bfloat16) for _ in range(2))
    key, value = (inputs.normal((batch, length, kv_heads, dim), jnp.bfloat16) for _ in range(2))
    config = AttentionConfig(scale=dim ** -0.5, causal=causal, deterministic=True)
    as64 = numpy_reference.to_float64
    out, lse = numpy_reference.attention_forward(as64(query), as64(key), as64(value), causal=causal)
    out, lse = jnp.asarray(out, jnp.float32).astype(jnp.bfloat16), jnp.asarray(lse, jnp.float32)
    problem = host.Problem.of(query, key, value)

    def backward(head_splits):
        tuning = dataclasses.replace(sm90_backward.DEFAULT_TUNING, head_splits=head_splits)
        options = sm90_backward.options(config, problem, tuning)
        assert options.head_splits == head_splits
        return jax.jit(lambda *a: sm90_backward.run(options, *a, None, {})[:3])

    split = backward(2)
    first = [np.asarray(g.astype(jnp.float32)) for g in split(query, key, value, out, lse, d_out)]
    for _ in range(9):
        again = split(query, key, value, out, lse, d_out)
        for a, b in zip(first, again):
            assert np.array_equal(a, np.asarray(b.astype(jnp.float32)))
    unsplit = [np.asarray(g.astype(jnp.float32)) for g in backward(1)(query, key, value, out, lse, d_out)]
    assert np.array_equal(first[0], unsplit[0]), "dQ differs from the unsplit kernel's"
    for a, b in zip(first[1:], unsplit[1:]):
        np.testing.assert_allclose(a, b, atol=2e-2, rtol=2e-2)


def test_grad_through_public_api(inputs):
    """jax.grad of fa4_jax.attention(implementation='cute') reaches this kernel (the transpose of the
    forward's tangent is the backward primitive)."""
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


# Sequence-sharded queries (q_start), as context parallelism calls the kernel: one shard's rows at
# their global offset against the whole key sequence. The backward is linear in (d_out, d_lse), so
# the shard's part of dK / dV is the unsharded oracle's gradient with both zeroed outside the shard's
# rows, and its dQ is those rows of the whole. Shard 0 of a causal split leaves most key blocks with no
# visible query block (m_lo == m_hi), the last shard every key block with all of them.
Q_START_CASES = [
    # (name, case over the whole sequence, shards)
    ("causal-gqa", Case("q-start-causal-gqa", q_heads=4, kv_heads=2, q_len=1024, kv_len=1024, causal=True), 4),
    ("causal-mha-d64", Case("q-start-causal-d64", head_dim=64, q_len=1024, kv_len=1024, causal=True), 2),
    ("window", Case("q-start-window", q_len=1024, kv_len=1024, window=(200, 200)), 4),
    # No mask at D = 128: the 80-row blocks (dQ^T), 250-row shards ending mid-block.
    ("full", Case("q-start-full", q_len=1000, kv_len=1024), 4),
    ("causal-window-cross", Case("q-start-causal-cross", q_len=512, kv_len=1024, causal=True,
                                 window=(300, None)), 2),
]


@pytest.mark.parametrize("tuning", ["default", "tiled_dq"])
@pytest.mark.parametrize("name,case,shards", Q_START_CASES, ids=[c[0] for c in Q_START_CASES])
def test_query_shard_backward_matches_oracle(name, case, shards, tuning, inputs):
    _check_query_shards(case, shards, TUNINGS[tuning], inputs)


def _check_query_shards(case: Case, shards, tuning, inputs, deterministic=False, kernel=sm90_backward):
    """`kernel.run` on each of `shards` equal row shards of `case` at its q_start, against the whole
    keys, against the unsharded oracle's gradients with d_out and d_lse zeroed outside the shard."""
    query, key, value, d_out, d_lse, options, optional, config = _make_problem(case, inputs)
    d_lse = inputs.normal((case.batch, case.q_heads, case.q_len), jnp.float32)
    as64 = numpy_reference.to_float64
    numpy_options = _numpy_options(options)
    out64, lse64 = numpy_reference.attention_forward(as64(query), as64(key), as64(value), **numpy_options)
    rows = case.q_len // shards
    shard_config = config.replace(has_q_start=True, q_total=case.q_len, deterministic=deterministic)
    failures = []
    for shard in range(shards):
        part = slice(shard * rows, (shard + 1) * rows)
        d_out64 = np.zeros_like(as64(d_out))
        d_out64[:, part] = as64(d_out)[:, part]
        d_lse64 = np.zeros((case.batch, case.q_heads, case.q_len))
        d_lse64[..., part] = np.asarray(d_lse, np.float64)[..., part]
        expected = numpy_reference.attention_backward(as64(query), as64(key), as64(value), d_out64, d_lse64,
                                                      **numpy_options)
        shard_query = query[:, part]
        problem = host.Problem.of(shard_query, key, value)
        assert kernel.unsupported_reason(shard_config, problem) is None
        kernel_options = kernel.options(shard_config, problem, tuning)
        shard_optional = dict(optional, q_start=jnp.asarray([shard * rows], jnp.int32))
        out = jnp.asarray(out64[:, part], jnp.float32).astype(case.dtype)
        lse = jnp.asarray(lse64[..., part], jnp.float32)
        poison_device_memory(4 * (query.size + 2 * key.size))
        grads = jax.jit(lambda *a: kernel.run(kernel_options, *a, shard_optional))(
            shard_query, key, value, out, lse, d_out[:, part], d_lse[..., part])
        wanted = {"dq": expected["dq"][:, part], "dk": expected["dk"], "dv": expected["dv"]}
        for grad_name, actual in zip(("dq", "dk", "dv"), grads):
            actual = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
            want = wanted[grad_name]
            scale = max(np.max(np.abs(want)), 1e-6)
            # Per 128-row block of the sequence axis: where the error sits says which loop is wrong.
            blocks = [float(np.max(np.abs(actual[:, b:b + 128] - want[:, b:b + 128]), initial=0.0) / scale)
                      for b in range(0, actual.shape[1], 128)]
            if np.any(np.isnan(actual)) or max(blocks) > 4 * ROUNDING[case.dtype]:
                failures.append(f"shard {shard} {grad_name}: NaN={bool(np.any(np.isnan(actual)))} relative error "
                                f"per 128-block {[round(b, 4) for b in blocks]}")
    assert not failures, f"{case.name} ({kernel_options}):\n" + "\n".join(failures)
