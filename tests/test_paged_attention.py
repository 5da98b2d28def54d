"""`fa4_jax.paged_attention` on the reference path (CPU) against the float64 oracle over the same tokens
laid out densely, its argument checks, and what it refuses (gradients, 'cute' off the GPU).

`PagedAttentionTestBase` holds the cases and the check once; the GPU kernel's tests
(tests/test_sm90_decode.py) subclass it with implementation="cute".
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
import numpy_reference as oracle
import paged_cases
from paged_cases import PagedCase

CASES = [
    PagedCase(),
    PagedCase(q_len=4, q_heads=8, kv_heads=2),
    PagedCase(q_len=5, q_heads=4, kv_heads=4, block_size=7, max_blocks=6),       # odd page, MHA
    PagedCase(q_len=3, q_heads=6, kv_heads=1, block_size=1, max_blocks=40),      # MQA, one-token pages
    PagedCase(q_len=2, window=(10, None), block_size=8, max_blocks=12),
    PagedCase(q_len=6, window=(5, 1)),
    PagedCase(q_len=2, softcap=3.0, sinks=True),
    PagedCase(q_len=1, sinks=True, scale=0.37, head_dim=32, v_head_dim=48),
    PagedCase(q_len=4, lengths=(1, 2, 3), block_size=4, max_blocks=3),           # lengths below q_len
    PagedCase(q_len=8, q_heads=8, kv_heads=2, block_size=64, max_blocks=3),      # 32 packed rows
    PagedCase(batch=1, q_len=1, lengths=(144,)),                                 # the full table
]


class PagedAttentionTestBase:
    implementation = "reference"
    dtypes = (jnp.float32,)
    tolerance = 2e-5

    def supports(self, case: PagedCase) -> bool:
        return True

    def cases(self):
        return [case for case in CASES if self.supports(case)]

    def check(self, case: PagedCase, rng):
        drawn = paged_cases.build(case, rng)
        out, lse = fa4_jax.paged_attention(
            *paged_cases.arguments(drawn), scale=case.scale, softcap=case.softcap, sinks=drawn["sinks"],
            window=case.window, return_lse=True, implementation=self.implementation)
        expected_out, expected_lse = paged_cases.expected(case, drawn)
        oracle.assert_close(out, expected_out, self.tolerance, f"{case.name}: out")
        oracle.assert_close(lse, expected_lse, self.tolerance, f"{case.name}: lse")


class TestReferencePagedAttention(PagedAttentionTestBase):
    @pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
    def test_matches_dense_oracle(self, case, rng):
        self.check(case, rng)


def test_reference_equals_dense_attention_over_gathered_pages(rng):
    """The reference is `fa4_jax.attention` (causal, with key lengths) over the gathered pages."""
    case = PagedCase(q_len=3, block_size=5, max_blocks=7)
    drawn = paged_cases.build(case, rng)
    out = fa4_jax.paged_attention(*paged_cases.arguments(drawn), implementation="reference")
    dense = fa4_jax.attention(drawn["query"], jnp.asarray(drawn["dense_key"], jnp.float32),
                              jnp.asarray(drawn["dense_value"], jnp.float32), causal=True,
                              kv_seq_lengths=drawn["kv_seq_lengths"], implementation="reference")
    np.testing.assert_allclose(np.asarray(out), np.asarray(dense), rtol=1e-6, atol=1e-6)


def test_garbage_in_unused_pages_is_never_read(rng):
    """Changing what unused table entries and unowned cache slots hold changes nothing."""
    case = PagedCase(q_len=2, block_size=6, max_blocks=5)
    drawn = paged_cases.build(case, rng)
    query, key_cache, value_cache, tables, lengths = paged_cases.arguments(drawn)
    first = fa4_jax.paged_attention(query, key_cache, value_cache, tables, lengths)
    pages = (np.asarray(lengths) + case.block_size - 1) // case.block_size
    unused = np.arange(case.max_blocks)[None, :] >= pages[:, None]
    other_tables = jnp.where(unused, -123456, tables)
    second = fa4_jax.paged_attention(query, jnp.nan_to_num(key_cache, nan=1e4),
                                     jnp.nan_to_num(value_cache, nan=-3.0), other_tables, lengths)
    assert not np.any(np.isnan(np.asarray(first)))
    np.testing.assert_array_equal(np.asarray(first), np.asarray(second))


def test_jit_and_vmap(rng):
    case = PagedCase(q_len=2)
    drawn = paged_cases.build(case, rng)
    arguments = paged_cases.arguments(drawn)
    eager = fa4_jax.paged_attention(*arguments)
    jitted = jax.jit(fa4_jax.paged_attention)(*arguments)
    np.testing.assert_array_equal(np.asarray(eager), np.asarray(jitted))
    query = arguments[0]
    stacked = jnp.stack([query, query * 0.5])
    mapped = jax.vmap(lambda q: fa4_jax.paged_attention(q, *arguments[1:]))(stacked)
    np.testing.assert_allclose(np.asarray(mapped[0]), np.asarray(eager), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(mapped[1]),
                               np.asarray(fa4_jax.paged_attention(query * 0.5, *arguments[1:])), rtol=1e-6)



def test_eager_calls_reuse_the_compiled_computation(rng):
    """A second eager call with the same shapes and options must not compile again (one jitted
    function per parameter set, as for `attention`). The first call, after the caches are cleared,
    must be seen compiling: else a renamed event would pass vacuously."""
    drawn = paged_cases.build(PagedCase(q_len=3, sinks=True), rng)
    arguments = paged_cases.arguments(drawn)
    compiled = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(event)

    def call():
        return jax.block_until_ready(fa4_jax.paged_attention(*arguments, sinks=drawn["sinks"], softcap=2.0,
                                                             return_lse=True))
    jax.clear_caches()
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        first = call()
        assert compiled, "no compile event seen for the first call"
        compiled.clear()
        second = call()
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert not compiled, f"the second eager call compiled {len(compiled)} time(s)"
    for a, b in zip(first, second):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_no_gradient(rng):
    drawn = paged_cases.build(PagedCase(), rng)
    arguments = paged_cases.arguments(drawn)
    with pytest.raises(TypeError, match="forward-only"):
        jax.grad(lambda q: fa4_jax.paged_attention(q, *arguments[1:]).sum())(arguments[0])
    # Under stop_gradient the function still differentiates (to zero).
    grad = jax.grad(lambda q: fa4_jax.paged_attention(jax.lax.stop_gradient(q), *arguments[1:]).sum())(arguments[0])
    assert not np.any(np.asarray(grad))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="lowers for the CPU: on a GPU 'cute' runs")
def test_cute_needs_a_gpu(rng):
    drawn = paged_cases.build(PagedCase(dtype=jnp.bfloat16), rng)
    with pytest.raises(NotImplementedError, match="needs an NVIDIA GPU"):
        fa4_jax.paged_attention(*paged_cases.arguments(drawn), implementation="cute")


def _valid():
    return dict(query=jnp.zeros((2, 1, 4, 64)), key_cache=jnp.zeros((5, 16, 2, 64)),
                value_cache=jnp.zeros((5, 16, 2, 64)), block_tables=jnp.zeros((2, 3), jnp.int32),
                kv_seq_lengths=jnp.ones((2,), jnp.int32))


@pytest.mark.parametrize("change, error, message", [
    ({"query": jnp.zeros((2, 4, 64))}, ValueError, "rank 4"),
    ({"key_cache": jnp.zeros((5, 16, 2, 32))}, ValueError, "same head_dim"),
    ({"value_cache": jnp.zeros((5, 8, 2, 64))}, ValueError, "must agree"),
    ({"query": jnp.zeros((2, 1, 3, 64))}, ValueError, "multiple of kv_heads"),
    ({"key_cache": jnp.zeros((5, 16, 2, 64), jnp.bfloat16)}, TypeError, "share one dtype"),
    ({"block_tables": jnp.zeros((2, 3))}, TypeError, "block_tables must be an int32"),
    ({"block_tables": jnp.zeros((3, 3), jnp.int32)}, ValueError, r"block_tables must be \[batch"),
    ({"block_tables": jnp.zeros((2,), jnp.int32)}, ValueError, "block_tables must be"),
    ({"kv_seq_lengths": jnp.ones((3,), jnp.int32)}, ValueError, "kv_seq_lengths must have shape"),
    ({"kv_seq_lengths": jnp.ones((2,))}, TypeError, "kv_seq_lengths must be an int32"),
    ({"query": jnp.zeros((2, 1, 4, 64), jnp.int32), "key_cache": jnp.zeros((5, 16, 2, 64), jnp.int32),
      "value_cache": jnp.zeros((5, 16, 2, 64), jnp.int32)}, TypeError, "bfloat16, float16 or float32"),
])
def test_argument_errors(change, error, message):
    arguments = dict(_valid(), **change)
    with pytest.raises(error, match=message):
        fa4_jax.paged_attention(**arguments)


@pytest.mark.parametrize("options, message", [
    ({"window": (3,)}, "window must be a pair"),
    ({"softcap": -1.0}, "softcap"),
    ({"scale": float("inf")}, "scale"),
    ({"implementation": "triton"}, "implementation"),
    ({"sinks": jnp.zeros((3,))}, "sinks"),
])
def test_option_errors(options, message):
    with pytest.raises((ValueError, TypeError), match=message):
        fa4_jax.paged_attention(**_valid(), **options)


def test_wide_integer_tables_and_lengths(enable_x64, rng):
    """int64 tables and lengths are narrowed to int32 (lengths clipped first): the same result."""
    drawn = paged_cases.build(PagedCase(q_len=2), rng)
    query, key_cache, value_cache, tables, lengths = paged_cases.arguments(drawn)
    narrow = fa4_jax.paged_attention(query, key_cache, value_cache, tables, lengths)
    wide = fa4_jax.paged_attention(query, key_cache, value_cache, tables.astype(jnp.int64),
                                   lengths.astype(jnp.int64))
    np.testing.assert_array_equal(np.asarray(narrow), np.asarray(wide))


def test_int32_lengths_out_of_range_mean_the_clipped_ones(rng):
    """int32 lengths reach the primitive unclipped (no XLA kernel for the clip); a negative length
    still means an empty sequence and one past the table the whole table, as the clipped lengths do."""
    case = PagedCase(batch=3, q_len=1, lengths=(7, 144, 50))   # sequence 1 fills its table (9 x 16)
    drawn = paged_cases.build(case, rng)
    query, key_cache, value_cache, tables, lengths = paged_cases.arguments(drawn)
    table_len = tables.shape[1] * key_cache.shape[1]
    wild = jnp.asarray([-5, table_len + 1000, int(lengths[2])], jnp.int32)
    jaxpr = jax.make_jaxpr(lambda n: fa4_jax.paged_attention(query, key_cache, value_cache, tables, n))(wild)
    assert "name=clip" not in str(jaxpr)
    out = fa4_jax.paged_attention(query, key_cache, value_cache, tables, wild, implementation="reference")
    clipped = fa4_jax.paged_attention(query, key_cache, value_cache, tables, jnp.clip(wild, 0, table_len),
                                      implementation="reference")
    assert np.all(np.isfinite(np.asarray(out, np.float32)))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(clipped))
