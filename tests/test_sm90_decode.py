"""The split-KV paged decode kernel (fa4_jax/kernels/sm90/decode.py) on the GPU against the float64
oracle: through `fa4_jax.paged_attention(implementation="cute")` on hostile paged caches
(tests/paged_cases.py: permuted blocks, lengths off the page size, a length-1 sequence, garbage ids in
unused table entries, NaN in every unowned cache slot), with forced split counts, and through
`fa4_jax.attention(..., kv_seq_lengths=...)` with a short query (the contiguous-cache route).

Device memory is poisoned with NaN before each kernel call, so an unwritten partial shows up. The
tolerance is twice the larger of the reference path's own error (it rounds the output to the input
dtype) and the dtype's rounding, as in tests/test_sm90_forward.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
import numpy_reference as oracle
import paged_cases
from kernel_cases import ROUNDING, poison_device_memory
from paged_cases import PagedCase
pytest.importorskip("cutlass")  # the kernel module needs nvidia-cutlass-dsl (Linux only)
from fa4_jax.kernels.sm90 import decode  # noqa: E402

gpu = pytest.mark.gpu

BF16, FP16 = jnp.bfloat16, jnp.float16
CASES = [
    # The benchmark's heads (32 / 8, D = 128), one and four new tokens, pages of 16 and 64.
    PagedCase(batch=3, q_len=1, q_heads=32, kv_heads=8, head_dim=128, block_size=16, max_blocks=40, dtype=BF16),
    PagedCase(batch=3, q_len=4, q_heads=32, kv_heads=8, head_dim=128, block_size=64, max_blocks=12, dtype=BF16),
    # One long sequence: many splits, each over many key blocks.
    PagedCase(batch=1, q_len=1, q_heads=32, kv_heads=8, head_dim=128, block_size=16, max_blocks=400, dtype=BF16,
              lengths=(6001,)),
    PagedCase(batch=2, q_len=3, q_heads=8, kv_heads=2, head_dim=64, block_size=7, max_blocks=30, dtype=FP16),
    PagedCase(batch=2, q_len=2, q_heads=16, kv_heads=2, head_dim=256, block_size=32, max_blocks=10, dtype=BF16),
    PagedCase(batch=3, q_len=5, q_heads=6, kv_heads=1, head_dim=128, block_size=1, max_blocks=300, dtype=BF16),
    PagedCase(batch=2, q_len=8, q_heads=16, kv_heads=2, head_dim=128, block_size=16, max_blocks=20, dtype=BF16),
    PagedCase(batch=2, q_len=2, q_heads=8, kv_heads=2, head_dim=128, block_size=16, max_blocks=30, dtype=BF16,
              window=(100, None)),
    PagedCase(batch=2, q_len=6, q_heads=8, kv_heads=4, head_dim=64, block_size=16, max_blocks=30, dtype=FP16,
              window=(40, 2)),
    PagedCase(batch=3, q_len=2, q_heads=8, kv_heads=2, head_dim=128, block_size=16, max_blocks=20, dtype=BF16,
              softcap=5.0, sinks=True),
    PagedCase(batch=2, q_len=1, q_heads=8, kv_heads=2, head_dim=64, block_size=64, max_blocks=8, dtype=FP16,
              sinks=True, scale=0.3),
    PagedCase(batch=3, q_len=4, q_heads=8, kv_heads=2, head_dim=128, block_size=4, max_blocks=3, dtype=BF16,
              lengths=(1, 3, 12)),   # lengths below q_len: rows before the sequence start see nothing
    # 320 CTAs fill the 264 slots of 132 SMs: one split, whose kernel writes O and LSE itself, sinks folded in.
    PagedCase(batch=40, q_len=1, q_heads=32, kv_heads=8, head_dim=128, block_size=16, max_blocks=12, dtype=BF16,
              sinks=True),
]


def _error(actual, expected):
    return float(np.max(np.abs(oracle.to_float64(actual) - expected)) / max(np.max(np.abs(expected)), 1e-6))


def _check(case: PagedCase, out, lse, drawn, reference_out):
    expected_out, expected_lse = paged_cases.expected(case, drawn)
    out, lse = np.asarray(out.astype(jnp.float32)), np.asarray(lse)
    assert not np.any(np.isnan(out)) and not np.any(np.isnan(lse)), "NaN in the kernel's outputs"
    tolerance = 2 * max(_error(reference_out.astype(jnp.float32), expected_out), ROUNDING[case.dtype])
    oracle.assert_close(out, expected_out, tolerance, f"{case.name} out")
    oracle.assert_close(lse, expected_lse, 1e-4, f"{case.name} lse")


def _options(case):
    return dict(scale=case.scale, softcap=case.softcap, window=case.window, return_lse=True)


@gpu
@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_paged_decode_matches_oracle(case, rng):
    _check_paged_case(case, rng)


# Options that are not the default, on every paged case through the public API (the kernel's options
# patched): the XLA merge after the decode kernel (the default merges in a kernel of ours) and the page
# numbers loaded right before their cp.async (the default loads them a block ahead). Select with
# `-k xla_combine` or `-k page_lookahead`.
EVERY_CASE_OPTIONS = {"xla_combine": {"combine": "xla"}, "no_page_lookahead": {"page_lookahead": False}}


@gpu
@pytest.mark.parametrize("variant", sorted(EVERY_CASE_OPTIONS))
@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_option_matches_oracle_on_every_case(case, variant, rng, monkeypatch):
    default_options = decode.options
    monkeypatch.setattr(decode, "options", lambda *args, **overrides: default_options(
        *args, **{**EVERY_CASE_OPTIONS[variant], **overrides}))
    _check_paged_case(case, rng)


def _check_paged_case(case, rng):
    drawn = paged_cases.build(case, rng)
    arguments = paged_cases.arguments(drawn)
    reference_out, _ = fa4_jax.paged_attention(*arguments, sinks=drawn["sinks"], implementation="reference",
                                               **_options(case))
    poison_device_memory(64 * 2 ** 20)
    out, lse = jax.jit(lambda *a: fa4_jax.paged_attention(*a[:5], sinks=a[5], implementation="cute",
                                                          **_options(case)))(*arguments, drawn["sinks"])
    _check(case, out, lse, drawn, reference_out)


# One split writes the final O itself (sinks folded in); more are merged by the combine kernel (the
# default) or XLA: 2, 7, 33 (one group of 32 loads in flight, then one of 1), 40 and 128 (15 blocks: 113
# splits empty, merged as -inf).
FORCED = [{"num_splits": 1}, {"num_splits": 2}, {"num_splits": 7}, {"num_splits": 33}, {"num_splits": 40},
          {"num_splits": 128},
          {"tile_n": 128, "num_stages": 2}, {"num_stages": 4}, {"tile_n": 128, "num_stages": 2, "num_splits": 3},
          {"tile_n": 128, "num_stages": 2, "num_splits": 1},
          # Page numbers loaded right before their cp.async (the default: a block ahead): one split (15
          # blocks through the loop), 7, four stages.
          {"page_lookahead": False, "num_splits": 1}, {"page_lookahead": False, "num_splits": 7},
          {"page_lookahead": False, "num_stages": 4, "num_splits": 2},
          # The XLA merge: 2, 40 and 128 splits.
          {"combine": "xla", "num_splits": 2}, {"combine": "xla", "num_splits": 40},
          {"combine": "xla", "num_splits": 128}]


@gpu
@pytest.mark.parametrize("overrides", FORCED, ids=lambda o: "-".join(f"{k}{v}" for k, v in o.items()))
def test_forced_options(overrides, rng):
    """Every split count merges to the same attention (splits past the key blocks get none: -inf; 128
    splits of 15 blocks leave 113 empty), in the combine kernel and in XLA, one split without a merge,
    and the tuning alternatives (block size, stages) compute it too. Sinks, LSE, poisoned memory."""
    from fa4_jax import paged
    from fa4_jax.kernels.sm90 import decode

    case = PagedCase(batch=2, q_len=2, q_heads=16, kv_heads=4, head_dim=128, block_size=16, max_blocks=60,
                     dtype=BF16, sinks=True)
    drawn = paged_cases.build(case, rng)
    arguments = paged_cases.arguments(drawn)
    config = fa4_jax.AttentionConfig(scale=case.head_dim ** -0.5, causal=True, has_sinks=True,
                                     has_kv_seq_lengths=True)
    problem = paged.paged_problem(*arguments[:4])
    options = decode.options(config, problem, **overrides)
    reference_out, _ = fa4_jax.paged_attention(*arguments, sinks=drawn["sinks"], implementation="reference",
                                               return_lse=True)
    poison_device_memory(64 * 2 ** 20)
    out, lse = jax.jit(lambda *a: decode.run(options, *a))(*arguments, drawn["sinks"])
    _check(case, out, lse, drawn, reference_out)


@gpu
@pytest.mark.parametrize("q_len, causal, window", [(1, True, None), (4, True, None), (4, False, None),
                                                   (3, True, (50, 0))])
def test_contiguous_cache_through_attention(q_len, causal, window, inputs):
    """attention(..., kv_seq_lengths=...) with a short query runs the decode kernel (one page per
    sequence) and matches the oracle."""
    from fa4_jax.kernels import host
    from fa4_jax.kernels.sm90 import decode
    from fa4_jax.lowering import cuda

    batch, kv_len, q_heads, kv_heads, head_dim = 3, 1500, 32, 8, 128
    query = inputs.normal((batch, q_len, q_heads, head_dim), BF16)
    key = inputs.normal((batch, kv_len, kv_heads, head_dim), BF16)
    value = inputs.normal((batch, kv_len, kv_heads, head_dim), BF16)
    lengths = jnp.asarray([kv_len, 777, 2], jnp.int32)
    config = fa4_jax.AttentionConfig(scale=head_dim ** -0.5, causal=causal, has_kv_seq_lengths=True,
                                     window_left=None if window is None else window[0],
                                     window_right=None if window is None else window[1])
    assert cuda.decode_module_for_attention(config, host.Problem.of(query, key, value)) is decode
    options = dict(causal=causal, window=window, kv_seq_lengths=lengths, return_lse=True)
    expected_out, expected_lse = oracle.attention_forward(
        oracle.to_float64(query), oracle.to_float64(key), oracle.to_float64(value), causal=causal, window=window,
        kv_seq_lengths=np.asarray(lengths))
    reference_out, _ = fa4_jax.attention(query, key, value, implementation="reference", **options)
    poison_device_memory(64 * 2 ** 20)
    out, lse = jax.jit(lambda q, k, v: fa4_jax.attention(q, k, v, implementation="cute", **options))(query, key, value)
    out, lse = np.asarray(out.astype(jnp.float32)), np.asarray(lse)
    assert not np.any(np.isnan(out)) and not np.any(np.isnan(lse))
    tolerance = 2 * max(_error(reference_out.astype(jnp.float32), expected_out), ROUNDING[BF16])
    oracle.assert_close(out, expected_out, tolerance, "out")
    oracle.assert_close(lse, expected_lse, 1e-4, "lse")


@gpu
def test_garbage_is_never_read(rng):
    """The kernel's output does not change when unused table entries and unowned cache slots change."""
    case = dataclasses.replace(CASES[0], batch=2)
    drawn = paged_cases.build(case, rng)
    query, key_cache, value_cache, tables, lengths = paged_cases.arguments(drawn)
    run = jax.jit(lambda *a: fa4_jax.paged_attention(*a, implementation="cute"))
    first = run(query, key_cache, value_cache, tables, lengths)
    pages = (np.asarray(lengths) + case.block_size - 1) // case.block_size
    unused = np.arange(case.max_blocks)[None, :] >= pages[:, None]
    second = run(query, jnp.nan_to_num(key_cache, nan=1e4), jnp.nan_to_num(value_cache, nan=-3.0),
                 jnp.where(unused, -123456, tables), lengths)
    assert not np.any(np.isnan(np.asarray(first.astype(jnp.float32))))
    np.testing.assert_array_equal(np.asarray(first.astype(jnp.float32)), np.asarray(second.astype(jnp.float32)))


@gpu
def test_kernel_clamps_int32_lengths(rng):
    """The kernel clamps the lengths itself (the API passes int32 ones unclipped): negative means no
    key, past the table the whole table; the same output as the clipped lengths and as the reference."""
    # Sequence 1 fills its table (entries past a length may point at NaN-poisoned blocks, and "past the
    # table" reads every entry); sequence 0's length goes negative.
    case = PagedCase(batch=3, q_len=2, q_heads=16, kv_heads=4, head_dim=128, block_size=16, max_blocks=60,
                     dtype=BF16, lengths=(7, 960, 333))
    drawn = paged_cases.build(case, rng)
    query, key_cache, value_cache, tables, lengths = paged_cases.arguments(drawn)
    table_len = tables.shape[1] * key_cache.shape[1]
    wild = jnp.asarray([-5, table_len + 1000, int(lengths[2])], jnp.int32)
    run = lambda n, implementation: fa4_jax.paged_attention(query, key_cache, value_cache, tables, n,
                                                            implementation=implementation)
    out = np.asarray(run(wild, "cute").astype(jnp.float32))
    clipped = np.asarray(run(jnp.clip(wild, 0, table_len), "cute").astype(jnp.float32))
    reference = np.asarray(run(wild, "reference").astype(jnp.float32))
    assert not np.any(np.isnan(out))
    np.testing.assert_array_equal(out, clipped)
    np.testing.assert_allclose(out, reference, atol=2e-2, rtol=0)
