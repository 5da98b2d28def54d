"""`fa4_jax.attention_varlen` on the sm90 forward kernel (packed sequences, cu_seqlens read at run time)
against the float64 oracle applied to each sequence on its own, on an H200 (skipped without a GPU).

`VarlenTestBase` (tests/test_varlen.py) with implementation="cute" for the forward: the device memory
pool is poisoned with NaN before each call, so a row the kernel leaves unwritten shows up; the cases
mix empty sequences (no query rows, no keys), lengths off the tile multiples, sequences spanning several
query and key tiles, GQA/MQA, causal with len_q != len_k per sequence, windows, softcap, sinks and
every head dim (80 reaches the D = 96 kernel zero-padded). The gradient checks run the forward kernel
and the reference backward (no backward kernel takes packed sequences yet: implementation=None, with
its warning). The kernel-only checks: three packings of the same shapes share one compile, and tokens
outside the offsets get out 0 and lse -inf, as on the reference.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
import numpy_reference as oracle
from kernel_cases import poison_device_memory
from test_varlen import TOLERANCE, VarlenTestBase, by_name
from varlen_cases import VarlenCase, build, draw_lengths, offsets, oracle_forward

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
# bf16 only: the reference backward is checked against the oracle in bf16 on the CPU too (tests/test_varlen.py).
GRADIENT_CASES = [CASES[1], CASES[5], CASES[7]]


@gpu
class TestSm90Varlen(VarlenTestBase):
    implementation = "cute"

    @property
    def gradient_implementation(self):
        return None   # the forward kernel, then the reference backward (no backward kernel takes packing)

    def before_call(self, nbytes: int):
        poison_device_memory(nbytes)

    @by_name(CASES)
    def test_forward(self, case, inputs, rng):
        self.check_forward(case, inputs, rng)

    @by_name(GRADIENT_CASES)
    def test_gradients(self, case, inputs, rng):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*packed variable-length sequences")
            self.check_gradients(case, inputs, rng)


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
