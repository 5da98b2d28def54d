"""The Hopper large-head backward kernel (D = 192, 256, and MLA's D / Dv = 192 / 128) against the float64
NumPy oracle, on an H200 (skipped without a GPU); and, on the CPU, the mapping of its dQ accumulator back
to rows and columns.

Same harness as tests/test_sm90_backward.py (its Case, problem builder, oracle and NaN poisoning):
the kernel gets the oracle's out and LSE rounded to the kernel's types, so the forward kernel is not
involved, and the tolerance is the same 4 roundings of the inputs' type relative to max |expected|.
Every case runs with the default kernel and with each `Tuning` candidate in the mode it applies to
(VARIANTS; `three_warpgroups` and the D = 192 candidates on their own cases: THREE_WARPGROUPS_*,
MLA_*; `rotated_turns` asked for on deterministic full masks: ROTATED_TURN_CASES; the plain walk there:
`plain_turns`); the deterministic ones are also checked for bitwise reproducibility, with more CTAs than the GPU
holds at once (a turn order that waited for a CTA launched later would hang there).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fa4_jax.config import AttentionConfig
from kernel_cases import Case
pytest.importorskip("cutlass")  # the kernel modules need nvidia-cutlass-dsl (Linux only)
from fa4_jax import reference  # noqa: E402
from fa4_jax.kernels import host  # noqa: E402
from fa4_jax.kernels.sm90 import backward_large_heads as sm90_backward_large_heads  # noqa: E402
from test_sm90_backward import _check_against_oracle, _check_query_shards, _make_problem  # noqa: E402

VARIANTS = {   # name -> (Tuning, deterministic)
    "default": (sm90_backward_large_heads.DEFAULT_TUNING, False),
    "no_stagger": (sm90_backward_large_heads.Tuning(stagger=False), False),
    "deterministic": (sm90_backward_large_heads.DEFAULT_TUNING, True),
    # The plain walk (every key block from the first query block: full masks too long for rotated turns,
    # causal masks, and every deterministic full mask before rotated turns were the default), its turns
    # diagonal first, and lowest first.
    "plain_turns": (sm90_backward_large_heads.Tuning(rotated_turns=False), True),
    "lowest_first": (sm90_backward_large_heads.Tuning(diagonal_first=False, rotated_turns=False), True),
    # dQ staged once dK is done (`Tuning.stage_dq_under_dk=False`; the default stages it under dK at D = 192
    # and in deterministic mode at D = 256): `-k dq_after_dk`.
    "dq_after_dk": (sm90_backward_large_heads.Tuning(stage_dq_under_dk=False), False),
    "deterministic_dq_after_dk": (sm90_backward_large_heads.Tuning(stage_dq_under_dk=False), True),
    # The staged dQ published after the dK wait (`Tuning.dq_publish_after_dk`, a candidate where dQ is staged
    # under dK: D = 192, deterministic D = 256): `-k large_dq_publish_after_dk`.
    "large_dq_publish_after_dk": (sm90_backward_large_heads.Tuning(dq_publish_after_dk=True), False),
    "deterministic_large_dq_publish_after_dk": (sm90_backward_large_heads.Tuning(dq_publish_after_dk=True), True),
}

CASES = [
    Case("plain-d256", head_dim=256),
    Case("plain-d192", head_dim=192),
    Case("aligned-d256", head_dim=256, q_len=256, kv_len=256),
    Case("fp16-d256", head_dim=256, dtype=jnp.float16),
    Case("causal-d256", head_dim=256, causal=True, q_len=300, kv_len=300),
    Case("causal-cross-d192", head_dim=192, causal=True, q_len=100, kv_len=357),
    Case("causal-more-queries-d256", head_dim=256, causal=True, q_len=300, kv_len=150),
    Case("gqa-causal-d256", head_dim=256, q_heads=8, kv_heads=2, causal=True),
    Case("gqa-d192-fp16", head_dim=192, q_heads=8, kv_heads=2, dtype=jnp.float16),
    Case("window-d256", head_dim=256, window=(32, 16), q_len=300, kv_len=300),
    Case("window-causal-left-d192", head_dim=192, window=(70, None), causal=True, q_len=400,
         kv_len=400),
    Case("softcap-d256", head_dim=256, softcap=5.0, scale=1.0),
    Case("sinks-dlse-d256", head_dim=256, sinks=True, d_lse=True),
    Case("sinks-causal-empty-rows-d192", head_dim=192, sinks=True, causal=True, q_len=300,
         kv_len=150),
    Case("segments-d256", head_dim=256, segments=True, q_len=300, kv_len=300),
    Case("lengths-causal-d256", head_dim=256, q_lengths=True, kv_lengths=True, causal=True),
    Case("single-row-d256", head_dim=256, q_len=1, kv_len=77),
    Case("gqa-long-d256", head_dim=256, q_heads=8, kv_heads=2, q_len=700, kv_len=900),
]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_backward_matches_oracle(case: Case, variant, inputs):
    tuning, deterministic = VARIANTS[variant]
    _check_against_oracle(case, tuning, inputs, deterministic, kernel=sm90_backward_large_heads)


# `Tuning(three_warpgroups=True)` (D = 192 only: 96 keys a CTA, three consumer warp groups, dK / dV
# computed transposed), unordered and deterministic: the D = 192 cases above and the other masks and
# features at D = 192, with lengths off the 64-row and the 96-key blocks (333 x 300, 197 x 333, 700 x
# 900), on them (384 = 6 x 64 = 4 x 96), fewer keys than one block (77), GQA and MQA. Select with
# `-k three_warpgroups`.
THREE_WARPGROUPS_VARIANTS = {   # name -> (Tuning, deterministic)
    "three_warpgroups": (sm90_backward_large_heads.Tuning(three_warpgroups=True), False),
    "deterministic_three_warpgroups": (sm90_backward_large_heads.Tuning(three_warpgroups=True), True),
    # D = 192's former layout (two warp groups, 64 keys), which the default no longer takes there
    # (benchmarks/attention_backward.py times it for comparison: `-k two_warpgroups`).
    "two_warpgroups": (sm90_backward_large_heads.Tuning(three_warpgroups=False), False),
    "deterministic_two_warpgroups": (sm90_backward_large_heads.Tuning(three_warpgroups=False), True),
    # Two Q stages and one P / dS buffer asked for (`-k prefetch_query`): the default at D = Dv = 192, and
    # with segment ids and at MLA's 192 / 128 a candidate. Its former one Q stage and two buffers
    # (`-k one_query_stage`; benchmarks/attention_backward.py times it for comparison).
    "prefetch_query": (sm90_backward_large_heads.Tuning(prefetch_query=True), False),
    "deterministic_prefetch_query": (sm90_backward_large_heads.Tuning(prefetch_query=True), True),
    "one_query_stage": (sm90_backward_large_heads.Tuning(three_warpgroups=True, prefetch_query=False), False),
    "deterministic_one_query_stage": (sm90_backward_large_heads.Tuning(three_warpgroups=True, prefetch_query=False),
                                      True),
}
THREE_WARPGROUPS_CASES = [case for case in CASES if case.head_dim == 192] + [
    Case("aligned-d192", head_dim=192, q_len=384, kv_len=384),
    Case("causal-gqa-odd-d192", head_dim=192, q_heads=8, kv_heads=2, causal=True, q_len=333, kv_len=300),
    Case("causal-more-queries-d192", head_dim=192, causal=True, q_len=300, kv_len=150),
    Case("mqa-causal-d192", head_dim=192, q_heads=4, kv_heads=1, causal=True, q_len=400, kv_len=400),
    Case("window-d192", head_dim=192, window=(32, 16), q_len=300, kv_len=300),
    Case("softcap-d192", head_dim=192, softcap=5.0, scale=1.0),
    Case("sinks-dlse-d192", head_dim=192, sinks=True, d_lse=True),
    Case("segments-d192", head_dim=192, segments=True, q_len=300, kv_len=300),
    Case("lengths-causal-d192", head_dim=192, q_lengths=True, kv_lengths=True, causal=True),
    Case("single-row-d192", head_dim=192, q_len=1, kv_len=77),
    Case("gqa-long-d192", head_dim=192, q_heads=8, kv_heads=2, q_len=700, kv_len=900),
]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(THREE_WARPGROUPS_VARIANTS))
@pytest.mark.parametrize("case", THREE_WARPGROUPS_CASES, ids=lambda case: case.name)
def test_three_warpgroups_matches_oracle(case: Case, variant, inputs):
    tuning, deterministic = THREE_WARPGROUPS_VARIANTS[variant]
    _check_against_oracle(case, tuning, inputs, deterministic, kernel=sm90_backward_large_heads)


# DeepSeek MLA's D / Dv = 192 / 128 (EXTRA_HEAD_DIM_PAIRS), which `fa4_jax.attention` runs on this kernel
# unpadded: V, dO and dV 128 wide; with three warp groups (the default) group 2 holds no dV. Full and
# causal with Sq < Sk and Sq > Sk, GQA and MQA, lengths off the 64-row and 96-key blocks and on them
# (384), fewer keys than one block, fp16, windows, softcap, sinks with d_lse, segment ids (two warp
# groups by default), sequence lengths; unordered and deterministic (both turn orders), the two-group
# layout and the prefetch_query candidate. Select with `-k mla`.
MLA_VARIANTS = {   # name -> (Tuning, deterministic)
    "default": (sm90_backward_large_heads.DEFAULT_TUNING, False),
    "deterministic": (sm90_backward_large_heads.DEFAULT_TUNING, True),
    "lowest_first": (sm90_backward_large_heads.Tuning(diagonal_first=False, rotated_turns=False), True),
    "no_stagger": (sm90_backward_large_heads.Tuning(stagger=False), False),
    **{name: THREE_WARPGROUPS_VARIANTS[name] for name in (
        "two_warpgroups", "deterministic_two_warpgroups", "prefetch_query", "deterministic_prefetch_query")},
    # dQ staged under dK asked for (the default leaves it off at 192 / 128, not timed there).
    "stage_dq_under_dk": (sm90_backward_large_heads.Tuning(stage_dq_under_dk=True), False),
}
MLA_CASES = [
    Case("mla", head_dim=192, v_head_dim=128),
    Case("mla-aligned", head_dim=192, v_head_dim=128, q_len=384, kv_len=384),
    Case("mla-causal-gqa-odd", head_dim=192, v_head_dim=128, q_heads=8, kv_heads=2, causal=True, q_len=333,
         kv_len=300),
    Case("mla-causal-cross", head_dim=192, v_head_dim=128, causal=True, q_len=100, kv_len=357),
    Case("mla-causal-more-queries", head_dim=192, v_head_dim=128, causal=True, q_len=300, kv_len=150),
    Case("mla-mqa-causal-fp16", head_dim=192, v_head_dim=128, q_heads=4, kv_heads=1, causal=True, q_len=400,
         kv_len=400, dtype=jnp.float16),
    Case("mla-window-causal-left", head_dim=192, v_head_dim=128, window=(70, None), causal=True, q_len=400,
         kv_len=400),
    Case("mla-window", head_dim=192, v_head_dim=128, window=(32, 16), q_len=300, kv_len=300),
    Case("mla-softcap", head_dim=192, v_head_dim=128, softcap=5.0, scale=1.0),
    Case("mla-sinks-dlse", head_dim=192, v_head_dim=128, sinks=True, d_lse=True),
    Case("mla-segments", head_dim=192, v_head_dim=128, segments=True, q_len=300, kv_len=300),
    Case("mla-lengths-causal", head_dim=192, v_head_dim=128, q_lengths=True, kv_lengths=True, causal=True),
    Case("mla-single-row", head_dim=192, v_head_dim=128, q_len=1, kv_len=77),
    Case("mla-gqa-long", head_dim=192, v_head_dim=128, q_heads=8, kv_heads=2, q_len=700, kv_len=900),
]


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(MLA_VARIANTS))
@pytest.mark.parametrize("case", MLA_CASES, ids=lambda case: case.name)
def test_mla_matches_oracle(case: Case, variant, inputs):
    tuning, deterministic = MLA_VARIANTS[variant]
    _check_against_oracle(case, tuning, inputs, deterministic, kernel=sm90_backward_large_heads)


# Sequence-sharded queries (q_start), as context parallelism calls the kernel: each shard's rows at their
# global offset against the whole keys, checked as in tests/test_sm90_backward.py (`_check_query_shards`:
# the unsharded oracle's gradients with d_out and d_lse zeroed outside the shard's rows). Causal shard 0
# leaves most key blocks with no query block to visit, the last shard every key block with all of them;
# the window shards cut key blocks' query ranges at both ends; the cross case's shards of 150 rows start
# off the 64-row tiles. Deterministic mode takes its dQ turns at the shard's global rows, highest key block
# first (the default) or lowest first. Small batches and heads: the float64 oracle runs once per shard.
Q_START_CASES = [
    # (case over the whole sequence, shards)
    (Case("q-start-causal-gqa-d256", head_dim=256, batch=1, q_heads=4, kv_heads=2, q_len=512, kv_len=512,
          causal=True), 4),
    (Case("q-start-causal-d192", head_dim=192, batch=1, q_heads=2, kv_heads=2, q_len=512, kv_len=512,
          causal=True), 2),
    (Case("q-start-window-d256", head_dim=256, batch=1, q_heads=2, kv_heads=2, q_len=512, kv_len=512,
          window=(100, 100)), 4),
    (Case("q-start-causal-window-cross-mqa-d192", head_dim=192, batch=1, q_heads=2, kv_heads=1, q_len=300,
          kv_len=512, causal=True, window=(150, None)), 2),
    (Case("q-start-causal-gqa-mla", head_dim=192, v_head_dim=128, batch=1, q_heads=4, kv_heads=2, q_len=512,
          kv_len=512, causal=True), 2),
]
Q_START_VARIANTS = {   # name -> (Tuning, deterministic)
    "default": (sm90_backward_large_heads.DEFAULT_TUNING, False),
    "deterministic": (sm90_backward_large_heads.DEFAULT_TUNING, True),
    "lowest_first": (sm90_backward_large_heads.Tuning(diagonal_first=False, rotated_turns=False), True),
}


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(Q_START_VARIANTS))
@pytest.mark.parametrize("case,shards", Q_START_CASES, ids=[case.name for case, _ in Q_START_CASES])
def test_query_shard_backward_matches_oracle(case: Case, shards, variant, inputs):
    tuning, deterministic = Q_START_VARIANTS[variant]
    _check_query_shards(case, shards, tuning, inputs, deterministic, kernel=sm90_backward_large_heads)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", list(THREE_WARPGROUPS_VARIANTS))
@pytest.mark.parametrize("case,shards", [(case, shards) for case, shards in Q_START_CASES if case.head_dim == 192],
                         ids=[case.name for case, _ in Q_START_CASES if case.head_dim == 192])
def test_three_warpgroups_query_shards_match_oracle(case: Case, shards, variant, inputs):
    tuning, deterministic = THREE_WARPGROUPS_VARIANTS[variant]
    _check_query_shards(case, shards, tuning, inputs, deterministic, kernel=sm90_backward_large_heads)


# `Tuning.rotated_turns` (the default since rev bc0bd69's measurement; select with `-k rotated`): deterministic
# full masks, where `options` keeps it, at D = 256 and D = 192 (three warp groups: 96-key blocks), MHA, GQA and
# MQA, MLA's 192 / 128; lengths off the 64-row and key blocks, more key blocks than query blocks (several key
# blocks reach a tile at the same step of their walks), query and key lengths (the key blocks past a batch's
# keys walk nothing, the turns count only the others), a single key block.
ROTATED_TURNS = sm90_backward_large_heads.Tuning(rotated_turns=True)
ROTATED_TURN_CASES = [
    Case("rotated-d256", head_dim=256),
    Case("rotated-gqa-long-d256", head_dim=256, q_heads=8, kv_heads=2, q_len=700, kv_len=900),
    Case("rotated-more-keys-mqa-d256", head_dim=256, q_heads=4, kv_heads=1, q_len=130, kv_len=1000),
    Case("rotated-d192", head_dim=192),
    Case("rotated-gqa-more-keys-d192", head_dim=192, q_heads=8, kv_heads=2, q_len=130, kv_len=1500),
    Case("rotated-lengths-gqa-d192", head_dim=192, q_heads=8, kv_heads=2, q_lengths=True, kv_lengths=True,
         q_len=700, kv_len=900),
    Case("rotated-single-block-d192", head_dim=192, q_len=300, kv_len=77),
    Case("rotated-mla-gqa", head_dim=192, v_head_dim=128, q_heads=8, kv_heads=2, q_len=333, kv_len=700),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", ROTATED_TURN_CASES, ids=lambda case: case.name)
def test_rotated_turns_match_oracle(case: Case, inputs):
    query, key, value, *_, config = _make_problem(case, inputs)
    options = sm90_backward_large_heads.options(config.replace(deterministic=True), host.Problem.of(query, key, value),
                                                ROTATED_TURNS)
    assert options.tuning.rotated_turns, "resolved off: the case would not test the rotated walk"
    _check_against_oracle(case, ROTATED_TURNS, inputs, deterministic=True, kernel=sm90_backward_large_heads)


DETERMINISTIC_TUNINGS = {name: tuning for name, (tuning, deterministic) in VARIANTS.items()
                         if deterministic}
# Lowest key block first: D = 256's default order, D = 192's before diagonal-first became its default.
DETERMINISTIC_TUNINGS["lowest_first"] = sm90_backward_large_heads.Tuning(diagonal_first=False, rotated_turns=False)
DETERMINISTIC_TUNINGS["three_warpgroups"] = sm90_backward_large_heads.Tuning(three_warpgroups=True)
DETERMINISTIC_TUNINGS["prefetch_query"] = sm90_backward_large_heads.Tuning(prefetch_query=True)
# On the full-mask runs (the causal ones resolve it off): 4 x 4 KV heads x 32 key blocks at D = 256, 22 of 96
# keys at D = 192 and MLA's 192 / 128, each head's fitting on half the SMs, the grid not on the GPU at once.
DETERMINISTIC_TUNINGS["rotated_turns"] = ROTATED_TURNS

REPRODUCIBILITY_SHAPES = [   # (B, S, Hq, Hkv, D), or (B, S, Hq, Hkv, D, Dv)
    (1, 1024, 4, 4, 192), (1, 1024, 4, 4, 256),
    # 4 x 4 KV heads x 32 key blocks = 512 CTAs, about four waves on an H200 (one CTA per SM).
    (4, 2048, 8, 4, 256),
    # MLA: 4 x 4 KV heads x 22 key blocks of 96 = 352 CTAs, warp group 2 of each without dV.
    (4, 2048, 8, 4, 192, 128),
]
# D = 192 only; 4 x 4 KV heads x 22 key blocks of 96 = 352 CTAs, between two and three waves.
THREE_WARPGROUPS_REPRODUCIBILITY_SHAPES = [(1, 1024, 4, 4, 192), (4, 2048, 8, 4, 192)]
# `Tuning.prefetch_query`: D = 192 and MLA (three warp groups at both).
PREFETCH_QUERY_REPRODUCIBILITY_SHAPES = THREE_WARPGROUPS_REPRODUCIBILITY_SHAPES + [(4, 2048, 8, 4, 192, 128)]
# `Tuning.rotated_turns`: those and D = Dv = 192's 352 CTAs.
ROTATED_TURNS_REPRODUCIBILITY_SHAPES = REPRODUCIBILITY_SHAPES + [(4, 2048, 8, 4, 192)]


def _reproducibility_parameters():
    """(shape, tuning name) for each deterministic tuning on the shapes it is built for."""
    return [pytest.param(shape, name, id=f"{'x'.join(map(str, shape))}-{name}")
            for name, tuning in DETERMINISTIC_TUNINGS.items()
            for shape in (THREE_WARPGROUPS_REPRODUCIBILITY_SHAPES if tuning.three_warpgroups
                          else PREFETCH_QUERY_REPRODUCIBILITY_SHAPES if tuning.prefetch_query
                          else ROTATED_TURNS_REPRODUCIBILITY_SHAPES if tuning.rotated_turns
                          else REPRODUCIBILITY_SHAPES)]


@pytest.mark.gpu
@pytest.mark.parametrize("shape,tuning", _reproducibility_parameters())
@pytest.mark.parametrize("causal", [False, True])
def test_deterministic_is_bitwise_reproducible(causal, shape, tuning, inputs):
    """deterministic=True: five runs give identical bits (11 to 32 key blocks add into each dQ
    tile), close to the unordered sums. Out and LSE from the reference forward (on the GPU)."""
    batch, length, heads, kv_heads, head_dim, *v_head_dim = shape
    v_head_dim = (v_head_dim or [head_dim])[0]
    query, d_out = (inputs.normal((batch, length, heads, dim), jnp.bfloat16) for dim in (head_dim, v_head_dim))
    key, value = (inputs.normal((batch, length, kv_heads, dim), jnp.bfloat16) for dim in (head_dim, v_head_dim))
    config = AttentionConfig(scale=head_dim ** -0.5, causal=causal, deterministic=True)
    out, lse = jax.jit(lambda *a: reference.reference_forward(*a, {}, config))(query, key, value)

    def backward(config):
        options = sm90_backward_large_heads.options(config, host.Problem.of(query, key, value),
                                                    DETERMINISTIC_TUNINGS[tuning])
        return jax.jit(lambda *a: sm90_backward_large_heads.run(options, *a, None, {})[:3])

    first = [np.asarray(g.astype(jnp.float32))
             for g in backward(config)(query, key, value, out, lse, d_out)]
    for _ in range(4):
        again = backward(config)(query, key, value, out, lse, d_out)
        for a, b in zip(first, again):
            assert np.array_equal(a, np.asarray(b.astype(jnp.float32)))
    loose = backward(config.replace(deterministic=False))(query, key, value, out, lse, d_out)
    for a, b in zip(first, loose):
        np.testing.assert_allclose(a, np.asarray(b.astype(jnp.float32)), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("head_dim,three_warpgroups", [(192, False), (256, False), (192, True)],
                         ids=["d192", "d256", "d192-three_warpgroups"])
def test_dq_accumulator_order(head_dim, three_warpgroups):
    """Each (warp group, chunk, thread, value) slot of a block lands on the row and column the wgmma
    accumulator layout gives it: thread t = 32 w + 4 q + r, value 4 j + 2 h + c of group g of G holds
    row 16 w + 8 h + q, column g D/G + 8 j + 2 r + c (G = 2, or 3 with `three_warpgroups`)."""
    batch, heads, blocks, q_len = 2, 3, 2, 100
    groups = 3 if three_warpgroups else 2
    columns = head_dim // groups
    expected = np.zeros((batch, blocks * 64, heads, head_dim), np.float32)
    accumulator = np.zeros((batch, heads, blocks, 64 * head_dim), np.float32)
    rng = np.random.default_rng(0)
    values = rng.standard_normal(accumulator.shape).astype(np.float32)
    for g in range(groups):
        for j in range(columns // 8):
            for t in range(128):
                w, q, r = t // 32, (t % 32) // 4, t % 4
                for h in range(2):
                    for c in range(2):
                        flat = ((g * columns // 8 + j) * 128 + t) * 4 + 2 * h + c
                        row, column = 16 * w + 8 * h + q, g * columns + 8 * j + 2 * r + c
                        for block in range(blocks):
                            expected[:, block * 64 + row, :, column] = values[:, :, block, flat]
    accumulator[:] = values
    reader = sm90_backward_large_heads.dq_reader(sm90_backward_large_heads.Tuning(three_warpgroups=three_warpgroups))
    actual = reader(jnp.asarray(accumulator), q_len)
    np.testing.assert_array_equal(np.asarray(actual), expected[:, :q_len])
