"""`fa4_jax.attention_varlen` on the sm90 forward and backward kernels (packed sequences, cu_seqlens read
at run time) against the float64 oracle applied to each sequence on its own, on an H200 (skipped
without a GPU).

`VarlenTestBase` (tests/test_varlen.py) with implementation="cute": the device memory pool is poisoned
with NaN before each call, so a row (or a key's dK / dV) the kernel leaves unwritten shows up; the
cases mix empty sequences (no query rows, no keys), lengths off the tile multiples, sequences spanning
several query and key tiles (and key blocks that straddle sequences in the packed axis), GQA/MQA,
causal with len_q != len_k per sequence, windows, softcap, sinks and every head dim (80 reaches the
D = 96 kernels zero-padded). The gradient checks of head dims up to 128 run the sm90 backward kernel
(implementation="cute" and the routing recorded); 192 and 256, which the large-head backward does not
take packed, run the reference backward after the forward kernel. The kernel-only checks: three
packings of the same shapes share one compile, tokens outside the offsets get out 0 and lse -inf and
zero gradients, as on the reference, and deterministic=True gives the same bits on every run.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
import numpy_reference as oracle
from fa4_jax.lowering import cuda
from kernel_cases import poison_device_memory
from test_varlen import TOLERANCE, VarlenTestBase, by_name
from varlen_cases import VarlenCase, build, draw_lengths, offsets, oracle_backward, oracle_forward

pytest.importorskip("cutlass")  # the kernel modules need nvidia-cutlass-dsl (Linux only)

gpu = pytest.mark.gpu

BF16, FP16 = "bfloat16", "float16"
CASES = [
    # Several 128-row query tiles and 128-key blocks per sequence, lengths drawn off tile multiples.
    VarlenCase(dtype=BF16, head_dim=128, max_len=400),
    VarlenCase(dtype=BF16, head_dim=128, max_len=400, causal=True),
    VarlenCase(dtype=FP16, head_dim=64, max_len=500, causal=True, q_heads=8, kv_heads=2),
    VarlenCase(dtype=BF16, head_dim=128, max_len=400, window=(50, 10)),
    VarlenCase(dtype=BF16, head_dim=64, max_len=400, causal=True, window=(70, None), kv_heads=1),
    VarlenCase(dtype=BF16, head_dim=128, max_len=300, softcap=20.0, sinks=True),
    VarlenCase(dtype=FP16, head_dim=128, max_len=300, causal=True, sinks=True, q_heads=6, kv_heads=3),
    VarlenCase(dtype=BF16, head_dim=256, max_len=300, causal=True, sinks=True, kv_heads=1),
    VarlenCase(dtype=BF16, head_dim=192, max_len=300),
    VarlenCase(dtype=BF16, head_dim=96, max_len=300, causal=True),
    VarlenCase(dtype=BF16, head_dim=80, max_len=200, causal=True),
    # Many sequences: a deeper search over the offsets, most sequences shorter than one tile.
    VarlenCase(dtype=BF16, head_dim=128, sequences=70, max_len=150, causal=True),
    VarlenCase(dtype=BF16, head_dim=64, lengths=((1, 1),) * 9 + ((3, 0), (0, 3)), causal=True),
    # Exact tile multiples next to one-row remainders, and an all-empty sequence in between.
    VarlenCase(dtype=BF16, head_dim=128, lengths=((128, 128), (256, 200), (0, 0), (129, 1), (1, 384)), causal=True),
]
# The sm90 backward kernel takes head dims up to 128 packed (80 zero-padded to 96); 192 and 256 keep the
# reference backward (bf16 only: it is checked against the oracle in bf16 on the CPU too, tests/test_varlen.py).
KERNEL_GRADIENT_CASES = [case for case in CASES if case.head_dim <= 128]
REFERENCE_GRADIENT_CASES = [case for case in CASES if case.head_dim > 128]


@pytest.fixture
def backward_modules(monkeypatch):
    """The kernel module the CUDA lowering picks for each backward pass lowered during the test."""
    chosen = []
    choose = cuda.choose_kernel

    def recording(pass_, config, problem):
        result = choose(pass_, config, problem)
        if pass_ == "backward":
            chosen.append(None if result is None else result[0].__name__)
        return result
    monkeypatch.setattr(cuda, "choose_kernel", recording)
    return chosen


@gpu
class TestSm90Varlen(VarlenTestBase):
    implementation = "cute"
    gradient_implementation = "cute"

    def before_call(self, nbytes: int):
        poison_device_memory(nbytes)

    @by_name(CASES)
    def test_forward(self, case, inputs, rng):
        self.check_forward(case, inputs, rng)

    @by_name(KERNEL_GRADIENT_CASES)
    def test_gradients(self, case, inputs, rng, backward_modules):
        self.check_gradients(case, inputs, rng)
        assert backward_modules == ["fa4_jax.kernels.sm90.backward"]


@gpu
class TestSm90VarlenReferenceBackward(VarlenTestBase):
    implementation = "cute"
    gradient_implementation = None   # the forward kernel, then the reference backward (named in a warning)

    def before_call(self, nbytes: int):
        poison_device_memory(nbytes)

    @by_name(REFERENCE_GRADIENT_CASES)
    def test_gradients(self, case, inputs, rng, backward_modules):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*packed variable-length sequences")
            self.check_gradients(case, inputs, rng)
        assert backward_modules == [None]


# Deterministic dQ: many sequences, key blocks straddling sequences, GQA, causal with len_q != len_k.
DETERMINISTIC_CASES = [
    VarlenCase(dtype=BF16, head_dim=128, sequences=9, max_len=700, causal=True, q_heads=8, kv_heads=2),
    VarlenCase(dtype=BF16, head_dim=64, sequences=5, max_len=500, window=(90, 30)),
]


@gpu
@by_name(DETERMINISTIC_CASES)
def test_deterministic_backward_is_bitwise_reproducible(case, inputs, rng, backward_modules):
    """deterministic=True on packed sequences: five runs of the sm90 backward give identical bits (the
    dQ turns are per (sequence, query block) slot; the zero rows a sequence's last query block adds
    into the next sequence's dQ change no bits), and the result matches the oracle."""
    packed = build(case, inputs, draw_lengths(rng, case))
    d_out = inputs.normal((packed.query.shape[0], case.q_heads, case.v_dim), packed.query.dtype)

    @jax.jit
    def pullback(q, k, v):
        def function(q, k, v):
            return fa4_jax.attention_varlen(q, k, v, packed.cu_q, packed.cu_k, deterministic=True,
                                            implementation="cute", **case.options())
        return jax.vjp(function, q, k, v)[1](d_out)

    runs = [[np.asarray(g.astype(jnp.float32)) for g in pullback(packed.query, packed.key, packed.value)]
            for _ in range(5)]
    assert backward_modules == ["fa4_jax.kernels.sm90.backward"]
    for run in runs[1:]:
        for name, first, again in zip(("dq", "dk", "dv"), runs[0], run):
            np.testing.assert_array_equal(first.view(np.uint32), again.view(np.uint32), err_msg=name)
    d_lse = np.zeros((case.q_heads, packed.query.shape[0]), np.float32)
    expected = oracle_backward(case, packed, d_out, d_lse)
    for name, grad in zip(("dq", "dk", "dv"), runs[0]):
        oracle.assert_close(grad, expected[name], TOLERANCE[case.dtype] * 2, name)


@gpu
def test_one_kernel_compile_serves_every_packing(inputs):
    """The offsets are runtime data for the kernel too: three packings of the same token counts and
    sequence count run one compiled program, each giving its own packing's result."""
    case = VarlenCase(dtype=BF16, head_dim=128, causal=True, sinks=True)
    function = jax.jit(lambda q, k, v, cu_q, cu_k, sinks: fa4_jax.attention_varlen(
        q, k, v, cu_q, cu_k, causal=True, sinks=sinks, return_lse=True, implementation="cute"))
    packings = [np.array([[300, 200], [0, 90], [250, 0], [100, 310]]),
                np.array([[1, 400], [640, 1], [0, 0], [9, 199]]),
                np.array([[650, 600], [0, 0], [0, 0], [0, 0]])]
    base = build(case, inputs, packings[0])
    for lengths in packings:
        packed = build(case, inputs, lengths)
        packed.query, packed.key, packed.value, packed.sinks = base.query, base.key, base.value, base.sinks
        expected_out, expected_lse = oracle_forward(case, packed)
        poison_device_memory(4 * expected_out.size + 4 * expected_lse.size)
        out, lse = function(base.query, base.key, base.value, packed.cu_q, packed.cu_k, base.sinks)
        oracle.assert_close(out, expected_out, TOLERANCE[BF16], f"out of {lengths.tolist()}")
        oracle.assert_close(lse, expected_lse, TOLERANCE[BF16], f"lse of {lengths.tolist()}", floor=1.0)
    assert function._cache_size() == 1


@gpu
def test_kernel_writes_tokens_outside_the_offsets_as_seeing_nothing(inputs):
    """Under jit the offsets are not checked: tokens after the last query offset get out 0 and lse
    -inf from the kernel (its key-less tail item), keys after the last key offset are seen by no row."""
    query = inputs.normal((700, 4, 128), jnp.bfloat16)
    key, value = (inputs.normal((500, 2, 128), jnp.bfloat16) for _ in range(2))
    cu_q, cu_k = offsets([200, 300]), offsets([150, 250])    # 500 of 700 rows, 400 of 500 keys
    poison_device_memory(4 * 700 * 4 * 128 + 4 * 4 * 700)
    out, lse = jax.jit(lambda a, b: fa4_jax.attention_varlen(query, key, value, a, b, causal=True, return_lse=True,
                                                             implementation="cute"))(cu_q, cu_k)
    out, lse = np.asarray(out.astype(jnp.float32)), np.asarray(lse)
    assert np.all(out[500:] == 0) and np.all(np.isneginf(lse[:, 500:]))
    expected = fa4_jax.attention_varlen(query[:500], key[:400], value[:400], cu_q, cu_k, causal=True,
                                        implementation="reference")
    oracle.assert_close(out[:500], expected, TOLERANCE[BF16], "rows before the end")


@gpu
def test_backward_kernel_gives_tokens_outside_the_offsets_zero_gradients(inputs, backward_modules):
    """Under jit the offsets are not checked: the backward kernel gives the rows after the last query
    offset dQ 0 and the keys after the last key offset dK = dV = 0 (stored by its key-less tail items
    into memory poisoned with NaN), and the tokens inside the offsets the gradients of the sequences
    alone."""
    query = inputs.normal((700, 4, 128), jnp.bfloat16)
    key, value = (inputs.normal((500, 2, 128), jnp.bfloat16) for _ in range(2))
    d_out = inputs.normal((700, 4, 128), jnp.bfloat16)
    cu_q, cu_k = offsets([200, 300]), offsets([150, 250])    # 500 of 700 rows, 400 of 500 keys

    def pullback(q, k, v, cu_q, cu_k, implementation):
        def function(q, k, v):
            return fa4_jax.attention_varlen(q, k, v, cu_q, cu_k, causal=True, implementation=implementation)
        return jax.vjp(function, q, k, v)[1](d_out[:q.shape[0]])

    poison_device_memory(4 * (query.size + key.size + value.size))
    d_query, d_key, d_value = (np.asarray(g.astype(jnp.float32)) for g in jax.jit(
        lambda a, b: pullback(query, key, value, a, b, "cute"))(cu_q, cu_k))
    assert backward_modules == ["fa4_jax.kernels.sm90.backward"]
    assert np.all(d_query[500:] == 0) and np.all(d_key[400:] == 0) and np.all(d_value[400:] == 0)
    expected = pullback(query[:500], key[:400], value[:400], cu_q, cu_k, "reference")
    for name, grad, reference in zip(("dq", "dk", "dv"), (d_query[:500], d_key[:400], d_value[:400]), expected):
        oracle.assert_close(grad, reference, TOLERANCE[BF16] * 2, name)
