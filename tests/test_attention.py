"""Forward and gradients of `fa4_jax.attention` against the float64 NumPy oracle.

`AttentionTestBase` holds every case and every check once. A backend subclasses it and narrows it:
`implementation` is passed to `fa4_jax.attention`, `default_dtype` fills cases that leave the dtype
open, `supports(case)` drops what the backend cannot run (at collection, so nothing shows as skipped),
and `tolerance(case, quantity)` sets how close it must be. `TestReferenceAttention` (the pure-JAX
path on the CPU) is the first subclass; a GPU kernel's tests look like

    from test_attention import AttentionTestBase

    class TestSm90Attention(AttentionTestBase):
        pytestmark = pytest.mark.gpu
        implementation = "cute"
        default_dtype = "bfloat16"
        has_backward = False  # a forward-only kernel

        def supports(self, case):
            return case.dtype != "float32" and case.head_dim in (64, 128)
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
import numpy_reference as oracle
from fa4_jax import api

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
SHORT_DTYPE_NAMES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


@dataclasses.dataclass(frozen=True)
class Case:
    """One attention configuration. Masking options are symbolic; `build_arguments` draws the arrays.

    segments: None, "shared" (one [B, S] array, needs Sq == Sk), "pair" (independent query and key
      packings) or "disjoint" (a pair where one query segment has no key: fully masked rows).
    lengths: None, "q", "kv", "both" (random valid prefixes), "empty" (the last batch has no key),
      "past-end" (both, with lengths beyond the axes, up to the int32 maximum) or "negative" (both,
      with a negative query length for batch 1 and a negative key length for the last batch); the
      contract clips lengths to [0, axis].
    sinks_off: with sinks, the even heads get a sink of -inf (a sink turned off), so a row that sees
      no key has lse -inf there although sinks are given.
    dtype None means the backend's `default_dtype`. logit_scale: the standard deviation of the
    logits (query values are scaled by it); large values stress the online softmax's rescaling.
    """

    batch: int = 2
    q_len: int = 77
    kv_len: int = 77
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    value_dim: Optional[int] = None
    dtype: Optional[str] = None
    causal: bool = False
    window: Optional[tuple] = None
    softcap: Optional[float] = None
    sinks: bool = False
    sinks_off: bool = False
    segments: Optional[str] = None
    lengths: Optional[str] = None
    scale: Optional[float] = None
    logit_scale: float = 1.5

    @property
    def v_dim(self) -> int:
        return self.head_dim if self.value_dim is None else self.value_dim

    @property
    def has_q_lengths(self) -> bool:
        return self.lengths in ("q", "both", "past-end", "negative")

    @property
    def has_kv_lengths(self) -> bool:
        return self.lengths in ("kv", "both", "empty", "past-end", "negative")

    @property
    def name(self) -> str:
        parts = [f"b{self.batch}", f"q{self.q_len}", f"k{self.kv_len}", f"h{self.q_heads}-{self.kv_heads}",
                 f"d{self.head_dim}" + (f"-v{self.value_dim}" if self.value_dim is not None else ""),
                 SHORT_DTYPE_NAMES.get(self.dtype, "default")]
        if self.causal:
            parts.append("causal")
        if self.window is not None:
            parts.append("w{}-{}".format(*("inf" if side is None else side for side in self.window)))
        if self.softcap is not None:
            parts.append(f"cap{self.softcap:g}")
        if self.sinks:
            parts.append("sinks-off" if self.sinks_off else "sinks")
        if self.segments:
            parts.append(f"seg-{self.segments}")
        if self.lengths:
            parts.append(f"len-{self.lengths}")
        if self.scale is not None:
            parts.append(f"scale{self.scale:g}")
        if self.logit_scale != 1.5:
            parts.append(f"logits{self.logit_scale:g}")
        return "_".join(parts)


def all_pairs(factors: dict, valid, seed=0) -> list[dict]:
    """A small set of rows in which every valid pair of factor values appears (greedy covering).

    Deterministic for a given seed, so the case list (and the test ids) do not change between runs.
    """
    names = list(factors)
    chooser = random.Random(seed)

    def pairs_of(row):
        return {((a, row[a]), (b, row[b])) for a, b in itertools.combinations(names, 2)}

    def random_row(fixed):
        row = {name: chooser.choice(factors[name]) for name in names}
        row.update(fixed)
        return row

    uncovered = set()
    for a, b in itertools.combinations(names, 2):
        for value_a, value_b in itertools.product(factors[a], factors[b]):
            # Keep only pairs some valid row can hold.
            if any(valid(random_row({a: value_a, b: value_b})) for _ in range(200)):
                uncovered.add(((a, value_a), (b, value_b)))
    rows = []
    while uncovered:
        (a, value_a), (b, value_b) = sorted(uncovered, key=repr)[0]
        candidates = [random_row({a: value_a, b: value_b}) for _ in range(300)]
        candidates = [row for row in candidates if valid(row)]
        best = max(candidates, key=lambda row: len(pairs_of(row) & uncovered))
        rows.append(best)
        uncovered -= pairs_of(best)
    return rows


def _feature_cases() -> list[Case]:
    factors = {
        "causal": [False, True],
        "window": [None, (24, 8), (40, None), (None, 0)],
        "softcap": [None, 2.0],
        "sinks": [False, True],
        "segments": [None, "shared", "pair"],
        "lengths": [None, "q", "kv", "both"],
        "heads": [(4, 4), (4, 2), (4, 1)],
        "shape": [(2, 77, 77), (2, 50, 131), (1, 131, 50)],
    }

    def valid(row):
        return row["segments"] != "shared" or row["shape"][1] == row["shape"][2]

    cases = []
    for row in all_pairs(factors, valid):
        batch, q_len, kv_len = row.pop("shape")
        q_heads, kv_heads = row.pop("heads")
        cases.append(Case(batch=batch, q_len=q_len, kv_len=kv_len, q_heads=q_heads, kv_heads=kv_heads, **row))
    return cases


# Each feature alone first, so a failure in the combinations below can be traced to one option.
SINGLE_FEATURE_CASES = [
    Case(kv_heads=4),
    Case(kv_heads=1),
    Case(q_len=50, kv_len=131),
    Case(q_len=131, kv_len=50, batch=1),
    Case(causal=True),
    Case(window=(16, 16)),
    Case(window=(16, None)),
    Case(window=(None, 3)),
    Case(window=(0, 0)),
    Case(causal=True, window=(20, None)),
    Case(softcap=2.0),
    Case(sinks=True),
    Case(segments="shared"),
    Case(segments="pair", q_len=50, kv_len=131),
    Case(lengths="q"),
    Case(lengths="kv"),
    Case(lengths="both", q_len=50, kv_len=131),
    Case(lengths="past-end"),
    Case(lengths="past-end", causal=True, window=(24, 8), q_len=50, kv_len=131),
    Case(lengths="past-end", causal=True, sinks=True, q_len=131, kv_len=50, batch=3),
    Case(scale=0.37),
    # Decoding one token against a padded cache, and a chunk of a prefill against a longer cache.
    Case(q_len=1, kv_len=200, causal=True, lengths="kv", sinks=True),
    Case(q_len=16, kv_len=200, causal=True, window=(64, 0), lengths="both"),
]
FEATURE_CASES = _feature_cases()

# Head dims the kernels are built for, and others that reach them zero-padded
# (fa4_jax/lowering/head_padding.py): 72 -> 80 (the sm90 forward; 96 elsewhere), 80 (its own on the sm90
# forward; 96 elsewhere), 112 -> 128, 160 -> 192, 36 -> 64, and value head
# dims of their own (MLA's 192/128 -> 192/192, 96/64 -> 96/96, 64/128 and 128/64 -> 128/128,
# 256/128 and 96/256 -> 256/256); causal and not.
PADDED_HEAD_DIMS = [(72, None), (80, None), (112, None), (160, None), (192, 128), (96, 64), (64, 128),
                    (256, 128)]
HEAD_DIM_CASES = [
    Case(batch=1, q_len=70, kv_len=70, head_dim=head_dim, value_dim=value_dim, causal=causal)
    for head_dims, causal in [([(64, None), (96, None), (128, None), (192, None), (256, None), (128, 64),
                                (96, 256), (36, None)] + PADDED_HEAD_DIMS, True), (PADDED_HEAD_DIMS, False)]
    for head_dim, value_dim in head_dims
] + [
    # Padded head dims with the other features: what padding must leave alone (lse, sinks, softcap,
    # masks, lengths, GQA / MQA).
    Case(head_dim=80, causal=True, sinks=True, softcap=2.0, lengths="both", q_len=50, kv_len=131),
    Case(head_dim=192, value_dim=128, window=(24, 8), segments="pair", kv_heads=1, q_len=50, kv_len=131),
    Case(head_dim=112, value_dim=64, lengths="past-end", sinks=True, sinks_off=True, causal=True),
]

DTYPE_CASES = [
    Case(dtype=dtype, **features)
    for dtype in DTYPES
    for features in [dict(),
                     dict(causal=True, sinks=True, softcap=2.0, kv_heads=1),
                     dict(window=(16, 4), segments="pair", lengths="both", q_len=50, kv_len=131)]
]

ODD_LENGTH_CASES = [
    Case(batch=1, q_len=q_len, kv_len=kv_len, causal=causal)
    for q_len, kv_len in [(1, 1), (1, 257), (257, 1), (3, 300), (129, 255), (255, 129)]
    for causal in (False, True)
]

# Cases where some query rows see no key at all (out 0, lse -inf or the sink, never NaN).
FULLY_MASKED_CASES = [
    Case(q_len=131, kv_len=50, causal=True, sinks=sinks)
    for sinks in (False, True)
] + [
    Case(q_len=131, kv_len=50, window=(0, 0)),
    Case(segments="disjoint", q_len=50, kv_len=131),
    Case(segments="disjoint", sinks=True, causal=True),
    Case(lengths="q", sinks=True),
    Case(lengths="empty"),
    Case(lengths="empty", sinks=True, softcap=2.0),
    Case(lengths="empty", causal=True, q_len=131, kv_len=50, dtype="bfloat16"),
    Case(lengths="negative", batch=3, causal=True, sinks=True),
    Case(lengths="negative", batch=3, window=(16, 4), q_len=50, kv_len=131),
    Case(segments="disjoint", sinks=True, dtype="float16"),
    Case(lengths="negative", batch=3, causal=True, sinks=True, sinks_off=True),
    Case(segments="disjoint", sinks=True, sinks_off=True, softcap=2.0, dtype="bfloat16"),
]

# Peaked softmax over more than one key block (256 in the reference, 128 in kernels): the running
# maximum changes between blocks, so the online rescaling is exercised.
PEAKED_CASES = [
    Case(batch=1, q_len=40, kv_len=300, logit_scale=12.0, sinks=True),
    Case(batch=1, q_len=300, kv_len=300, logit_scale=12.0, causal=True, softcap=30.0),
    Case(batch=1, q_len=40, kv_len=300, logit_scale=12.0, dtype="bfloat16"),
]

# Logits near 1e10 (float32 only): one ulp of a logit is then far above 88, so exp(logit - row max)
# overflows unless every logit the softmax exponentiates is at most the maximum it was shifted by, even
# when the logits are evaluated more than once. The largest logit wins outright; the gradients are
# ill-conditioned (scale times a rounding error) and not compared.
HUGE_LOGIT_CASES = [
    Case(batch=1, q_len=5, kv_len=7, head_dim=8, dtype="float32", logit_scale=1e10),
    Case(batch=1, q_len=5, kv_len=7, head_dim=8, dtype="float32", logit_scale=1e10, causal=True, sinks=True),
    Case(batch=2, q_len=40, kv_len=300, dtype="float32", logit_scale=1e10, lengths="both"),
]

ALL_CASES = (SINGLE_FEATURE_CASES + FEATURE_CASES + HEAD_DIM_CASES + DTYPE_CASES + ODD_LENGTH_CASES
             + FULLY_MASKED_CASES + PEAKED_CASES)

# Small sets for checks that need not sweep every feature.
SMALL_CASES = [
    Case(),
    Case(causal=True, window=(20, 5), softcap=2.0, sinks=True, segments="shared", lengths="both"),
    Case(q_len=131, kv_len=50, causal=True, sinks=True, kv_heads=1),
]


def with_cases(*groups, needs_backward=True):
    """Declares which case lists a test method runs on; the backend's `supports` filters them."""
    def mark(function):
        function.cases = tuple(itertools.chain(*groups))
        function.needs_backward = needs_backward
        return function
    return mark


@dataclasses.dataclass
class Arguments:
    query: jax.Array
    key: jax.Array
    value: jax.Array
    sinks: Optional[jax.Array]
    options: dict  # the keyword arguments of fa4_jax.attention, arrays as jax arrays (sinks excluded)

    def oracle_options(self) -> dict:
        options = {name: value for name, value in self.options.items() if name != "deterministic"}
        for name in ("q_seq_lengths", "kv_seq_lengths"):
            if options.get(name) is not None:
                options[name] = np.asarray(options[name])
        if isinstance(options.get("segment_ids"), tuple):
            options["segment_ids"] = tuple(np.asarray(ids) for ids in options["segment_ids"])
        elif options.get("segment_ids") is not None:
            options["segment_ids"] = np.asarray(options["segment_ids"])
        sinks = None if self.sinks is None else np.asarray(self.sinks)
        return dict(options, sinks=sinks)


def build_arguments(case: Case, inputs) -> Arguments:
    dtype = DTYPES[case.dtype]
    # Logits of standard deviation ~logit_scale (default 1.5: peaked enough that softcap and masking matter).
    query = inputs.normal((case.batch, case.q_len, case.q_heads, case.head_dim), dtype, scale=case.logit_scale)
    key = inputs.normal((case.batch, case.kv_len, case.kv_heads, case.head_dim), dtype)
    value = inputs.normal((case.batch, case.kv_len, case.kv_heads, case.v_dim), dtype)
    sinks = inputs.normal((case.q_heads,), jnp.float32) if case.sinks else None
    if case.sinks_off:
        sinks = sinks.at[::2].set(-jnp.inf)

    options = dict(causal=case.causal, window=case.window, softcap=case.softcap, scale=case.scale)
    if case.segments == "shared":
        options["segment_ids"] = inputs.segment_ids(case.batch, case.q_len)
    elif case.segments in ("pair", "disjoint"):
        q_ids = inputs.segment_ids(case.batch, case.q_len)
        kv_ids = inputs.segment_ids(case.batch, case.kv_len)
        if case.segments == "disjoint":
            # The last query segment of batch 0 gets an id no key has.
            q_ids = q_ids.at[0].set(jnp.where(q_ids[0] == q_ids[0, -1], 7, q_ids[0]))
        options["segment_ids"] = (q_ids, kv_ids)
    if case.lengths in ("q", "both"):
        options["q_seq_lengths"] = inputs.lengths(case.batch, case.q_len)
    if case.lengths in ("kv", "both"):
        options["kv_seq_lengths"] = inputs.lengths(case.batch, case.kv_len)
    if case.lengths == "empty":
        options["kv_seq_lengths"] = jnp.asarray([case.kv_len] * (case.batch - 1) + [0], jnp.int32)
    if case.lengths == "past-end":
        # Batch 0 asks for a few more rows and keys than there are, the last batch for all int32 keys;
        # a batch in between (batch >= 3) keeps a shorter draw.
        q_lengths = np.array(inputs.lengths(case.batch, case.q_len))
        kv_lengths = np.array(inputs.lengths(case.batch, case.kv_len))
        q_lengths[0] += inputs.generator.integers(1, case.q_len + 1)
        kv_lengths[0] += inputs.generator.integers(1, case.kv_len + 1)
        kv_lengths[-1] = np.iinfo(np.int32).max
        options["q_seq_lengths"], options["kv_seq_lengths"] = jnp.asarray(q_lengths), jnp.asarray(kv_lengths)
    if case.lengths == "negative":
        q_lengths = np.array(inputs.lengths(case.batch, case.q_len))
        kv_lengths = np.array(inputs.lengths(case.batch, case.kv_len))
        q_lengths[1] = -inputs.generator.integers(1, case.q_len + 1)
        kv_lengths[-1] = np.iinfo(np.int32).min
        options["q_seq_lengths"], options["kv_seq_lengths"] = jnp.asarray(q_lengths), jnp.asarray(kv_lengths)
    return Arguments(query, key, value, sinks, options)


def _no_visible_key(arguments: Arguments) -> np.ndarray:
    """Boolean [B, Sq]: query rows that see no key under the oracle's semantics."""
    options = arguments.oracle_options()
    batch, q_len = arguments.query.shape[:2]
    masking = oracle.Masking(options["causal"], options["window"], options.get("segment_ids"),
                             options.get("q_seq_lengths"), options.get("kv_seq_lengths"))
    return ~oracle.visible_keys(batch, q_len, arguments.key.shape[1], masking).any(axis=-1)


class AttentionTestBase:
    """Every forward and gradient check, on every case list; subclasses narrow it to a backend."""

    implementation: Optional[str] = "reference"
    default_dtype = "float32"

    has_backward = True  # False for a forward-only kernel: the gradient tests are not collected

    # max |error| / max |expected| against the float64 oracle (the lse: / max(1, max |lse|); dQ, dK, dV:
    # / max(max |expected|, the oracle's root-sum-square of the terms behind one entry), because
    # dS = P (dP - Delta) cancels: a row with one visible key has dQ = scale dlse K exactly while the
    # rounding errors of dP and Delta stay those of |dP|; on random inputs the two scales are within 3x).
    # float32: the reference's errors are ~5e-7 (float32 sums of a few hundred terms); 1e-5 leaves
    # room for longer sums without hiding anything. bfloat16 / float16: outputs and gradients are
    # rounded to the dtype (unit roundoff u = 2^-8 / 2^-11: up to u/2 of the largest element; the
    # reference measures ~0.75u) and a kernel may also round P and dS to the dtype before each matmul;
    # 4u (forward) and 8u (gradients, where dS = P (dP - Delta) subtracts nearly equal terms) bound
    # that, while a real bug shows up as errors of order 1. The lse stays float32 whatever the input
    # dtype (computed from float32 logits), so its bound only allows for an approximate exp2 in kernels.
    tolerances = {
        "float32": {"forward": 1e-5, "lse": 1e-5, "gradient": 1e-5},
        "bfloat16": {"forward": 4 * 2.0**-8, "lse": 1e-4, "gradient": 8 * 2.0**-8},
        "float16": {"forward": 4 * 2.0**-11, "lse": 1e-4, "gradient": 8 * 2.0**-11},
    }

    def supports(self, case: Case) -> bool:
        """Whether this backend runs `case`; unsupported cases are not collected."""
        return True

    def tolerance(self, case: Case, quantity: str) -> float:
        return self.tolerances[case.dtype][quantity]

    def adapt(self, case: Case) -> Case:
        return case if case.dtype is not None else dataclasses.replace(case, dtype=self.default_dtype)

    def pytest_generate_tests(self, metafunc):
        if "case" not in metafunc.fixturenames:
            return
        if getattr(metafunc.function, "needs_backward", False) and not self.has_backward:
            metafunc.parametrize("case", [])
            return
        cases = {}
        for case in map(self.adapt, metafunc.function.cases):
            if self.supports(case):
                cases.setdefault(case.name, case)
        metafunc.parametrize("case", list(cases.values()), ids=list(cases))

    def attention(self, query, key, value, **options):
        return fa4_jax.attention(query, key, value, implementation=self.implementation, **options)

    def forward(self, arguments: Arguments, return_lse=True):
        function = jax.jit(lambda q, k, v, sinks: self.attention(
            q, k, v, sinks=sinks, return_lse=return_lse, **arguments.options))
        return function(arguments.query, arguments.key, arguments.value, arguments.sinks)

    def gradients(self, arguments: Arguments, d_out, d_lse):
        """The VJP of (out, lse) with cotangents (d_out, d_lse): (dq, dk, dv, dsinks)."""
        def function(q, k, v, sinks):
            return self.attention(q, k, v, sinks=sinks, return_lse=True, **arguments.options)

        @jax.jit
        def pullback(q, k, v, sinks, d_out, d_lse):
            _, vjp = jax.vjp(function, q, k, v, sinks)
            return vjp((d_out, d_lse))
        return pullback(arguments.query, arguments.key, arguments.value, arguments.sinks, d_out, d_lse)

    def check_gradients(self, case, arguments, grads, expected):
        tolerance = self.tolerance(case, "gradient")
        for name, grad, operand in zip(("dq", "dk", "dv"), grads, (arguments.query, arguments.key,
                                                                   arguments.value)):
            assert grad.dtype == operand.dtype, f"{name} dtype {grad.dtype} != operand dtype {operand.dtype}"
            oracle.assert_close(grad, expected[name], tolerance, name, floor=expected[f"{name}_scale"])
        if arguments.sinks is None:
            assert grads[3] is None
        else:
            assert grads[3].dtype == jnp.float32
            oracle.assert_close(grads[3], expected["dsinks"], tolerance, "dsinks", floor=expected["dsinks_scale"])

    @with_cases(ALL_CASES, needs_backward=False)
    def test_forward(self, case, inputs):
        self.check_forward(case, inputs)

    @with_cases(HUGE_LOGIT_CASES, needs_backward=False)
    def test_forward_with_huge_logits(self, case, inputs):
        self.check_forward(case, inputs)

    def check_forward(self, case, inputs):
        arguments = build_arguments(case, inputs)
        out, lse = self.forward(arguments)
        expected_out, expected_lse = oracle.attention_forward(
            arguments.query, arguments.key, arguments.value, **arguments.oracle_options())
        assert out.shape == (case.batch, case.q_len, case.q_heads, case.v_dim) and out.dtype == DTYPES[case.dtype]
        assert lse.shape == (case.batch, case.q_heads, case.q_len) and lse.dtype == jnp.float32
        oracle.assert_close(out, expected_out, self.tolerance(case, "forward"), "out")
        oracle.assert_close(lse, expected_lse, self.tolerance(case, "lse"), "lse", floor=1.0)

    @with_cases(ALL_CASES)
    def test_gradients(self, case, inputs):
        """Cotangents on both out and lse, so the lse path of the backward is always exercised."""
        arguments = build_arguments(case, inputs)
        d_out = inputs.normal((case.batch, case.q_len, case.q_heads, case.v_dim), DTYPES[case.dtype])
        d_lse = inputs.normal((case.batch, case.q_heads, case.q_len), jnp.float32)
        grads = self.gradients(arguments, d_out, d_lse)
        expected = oracle.attention_backward(arguments.query, arguments.key, arguments.value, d_out, d_lse,
                                             **arguments.oracle_options())
        self.check_gradients(case, arguments, grads, expected)

    @with_cases(FULLY_MASKED_CASES, needs_backward=False)
    def test_fully_masked_rows(self, case, inputs):
        """Rows that see no key: out exactly 0 and lse -inf (or the sink), no NaN anywhere."""
        arguments = build_arguments(case, inputs)
        empty = _no_visible_key(arguments)
        assert empty.any(), "the case should have fully masked rows"
        out, lse = self.forward(arguments)
        out, lse = np.asarray(out.astype(jnp.float32)), np.asarray(lse)
        assert not np.any(np.isnan(out)) and not np.any(np.isnan(lse))
        assert np.all(out[empty] == 0.0)
        empty_lse = lse.transpose(0, 2, 1)[empty]  # [rows, Hq]
        if arguments.sinks is None:
            assert np.all(empty_lse == -np.inf)
        else:
            np.testing.assert_allclose(empty_lse, np.broadcast_to(np.asarray(arguments.sinks), empty_lse.shape),
                                       rtol=1e-6)

    @with_cases(FULLY_MASKED_CASES)
    def test_fully_masked_rows_gradients(self, case, inputs):
        """Their gradients are finite and dq is exactly 0 there (cotangents on both out and lse)."""
        arguments = build_arguments(case, inputs)
        empty = _no_visible_key(arguments)
        d_out = inputs.normal((case.batch, case.q_len, case.q_heads, case.v_dim), DTYPES[case.dtype])
        d_lse = inputs.normal((case.batch, case.q_heads, case.q_len), jnp.float32)
        grads = self.gradients(arguments, d_out, d_lse)
        for name, grad in zip(("dq", "dk", "dv", "dsinks"), grads):
            assert grad is None or np.all(np.isfinite(np.asarray(grad.astype(jnp.float32)))), name
        assert np.all(np.asarray(grads[0].astype(jnp.float32))[empty] == 0.0)

    @with_cases(SMALL_CASES, [Case(dtype="bfloat16", causal=True, sinks=True)])
    def test_without_lse(self, case, inputs):
        """return_lse=False (the default) returns the output alone; its gradient has no lse term."""
        arguments = build_arguments(case, inputs)
        out_alone = self.forward(arguments, return_lse=False)
        out, _ = self.forward(arguments)
        assert isinstance(out_alone, jax.Array)
        np.testing.assert_array_equal(np.asarray(out_alone.astype(jnp.float32)), np.asarray(out.astype(jnp.float32)))

        d_out = inputs.normal(out.shape, DTYPES[case.dtype])

        @jax.jit
        def grad_of_weighted_sum(q, k, v, sinks, d_out):
            def loss(q, k, v, sinks):
                out = self.attention(q, k, v, sinks=sinks, **arguments.options)
                return jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32))
            return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, sinks)

        grads = grad_of_weighted_sum(arguments.query, arguments.key, arguments.value, arguments.sinks, d_out)
        expected = oracle.attention_backward(arguments.query, arguments.key, arguments.value, d_out,
                                             **arguments.oracle_options())
        self.check_gradients(case, arguments, grads, expected)

    @with_cases(SMALL_CASES, [Case(lengths="empty", sinks=True)])
    def test_gradient_through_lse_only(self, case, inputs):
        """A loss that reads only the lse: d_out is zero and every gradient comes from d_lse."""
        arguments = build_arguments(case, inputs)
        d_out = jnp.zeros((case.batch, case.q_len, case.q_heads, case.v_dim), DTYPES[case.dtype])
        d_lse = inputs.normal((case.batch, case.q_heads, case.q_len), jnp.float32)
        grads = self.gradients(arguments, d_out, d_lse)
        expected = oracle.attention_backward(arguments.query, arguments.key, arguments.value, d_out, d_lse,
                                             **arguments.oracle_options())
        self.check_gradients(case, arguments, grads, expected)

    @with_cases(SMALL_CASES, [Case(dtype="bfloat16", causal=True, kv_heads=1, sinks=True)])
    def test_deterministic_backward_is_reproducible(self, case, inputs):
        arguments = build_arguments(case, inputs)
        arguments.options["deterministic"] = True
        d_out = inputs.normal((case.batch, case.q_len, case.q_heads, case.v_dim), DTYPES[case.dtype])
        d_lse = inputs.normal((case.batch, case.q_heads, case.q_len), jnp.float32)
        first = self.gradients(arguments, d_out, d_lse)
        for _ in range(2):
            again = self.gradients(arguments, d_out, d_lse)
            for name, a, b in zip(("dq", "dk", "dv", "dsinks"), first, again):
                if a is not None:
                    np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)),
                                                  np.asarray(b.astype(jnp.float32)), err_msg=name)
        expected = oracle.attention_backward(arguments.query, arguments.key, arguments.value, d_out, d_lse,
                                             **arguments.oracle_options())
        self.check_gradients(case, arguments, first, expected)


class TestReferenceAttention(AttentionTestBase):
    """The pure-JAX reference, which is also what every non-CUDA platform runs."""

    implementation = "reference"


def test_default_implementation_is_the_reference_on_cpu(inputs):
    """implementation=None on a non-CUDA platform lowers to the reference: the same numbers."""
    arguments = build_arguments(dataclasses.replace(SMALL_CASES[1], dtype="float32"), inputs)
    outputs = {}
    for implementation in (None, "reference"):
        function = jax.jit(lambda q, k, v, sinks: fa4_jax.attention(
            q, k, v, sinks=sinks, return_lse=True, implementation=implementation, **arguments.options))
        outputs[implementation] = function(arguments.query, arguments.key, arguments.value, arguments.sinks)
    for default, reference in zip(outputs[None], outputs["reference"]):
        np.testing.assert_array_equal(np.asarray(default), np.asarray(reference))


# A window side >= Sq + Sk hides no key (the bound is proved in fa4_jax/api.py `_window`).
HUGE_WINDOWS = {
    "left-2**31": ((2**31, 0), (None, 0)),
    "right-int32-max": ((None, 2**31 - 1), (None, None)),
    "left-2**40": ((2**40, 5), (None, 5)),
}


@pytest.mark.parametrize("window,unbounded", HUGE_WINDOWS.values(), ids=HUGE_WINDOWS.keys())
def test_huge_window_sides_are_unbounded(inputs, window, unbounded):
    """They are traced as None: the same primitive parameters (so the same config and compiled kernel)
    and the same numbers, where they used to overflow int32 (wrong mask) or fail to lower."""
    case = Case(q_len=50, kv_len=131, dtype="float32", causal=True, sinks=True, lengths="both")
    arguments = build_arguments(case, inputs)
    traced, results = {}, {}
    for name, sides in (("huge", window), ("unbounded", unbounded)):
        options = dict(arguments.options, window=sides)

        def gradient(q, k, v, sinks):
            return jax.grad(lambda *operands: fa4_jax.attention(
                *operands[:3], sinks=operands[3], implementation="reference", **options).sum(),
                argnums=(0, 1, 2, 3))(q, k, v, sinks)
        operands = (arguments.query, arguments.key, arguments.value, arguments.sinks)
        traced[name] = str(jax.make_jaxpr(gradient)(*operands))
        results[name] = jax.jit(gradient)(*operands)
    for huge, unbounded in zip(results["huge"], results["unbounded"]):
        np.testing.assert_array_equal(np.asarray(huge), np.asarray(unbounded))
    assert traced["huge"] == traced["unbounded"]


def test_window_sides_just_below_the_bound_hide_no_key(inputs):
    """Sides of Sq + Sk - 1 stay ints (a separate config) and, as the bound says, mask nothing."""
    case = Case(q_len=50, kv_len=131, dtype="float32", lengths="both")
    arguments = build_arguments(case, inputs)
    side = case.q_len + case.kv_len - 1
    assert api._window((side, side), case.q_len, case.kv_len) == (side, side)
    assert api._window((side + 1, side + 1), case.q_len, case.kv_len) == (None, None)
    outputs = [fa4_jax.attention(arguments.query, arguments.key, arguments.value, implementation="reference",
                                 **dict(arguments.options, window=sides))
               for sides in ((side, side), (None, None))]
    np.testing.assert_allclose(np.asarray(outputs[0]), np.asarray(outputs[1]), rtol=1e-6, atol=1e-6)


# (dtype, q lengths, kv lengths) for q_len 20, kv_len 30: values that narrowing to int32 would wrap.
WIDE_LENGTHS = {
    "int64": ("int64", [2**32 + 5, 7, 2**33 + 7], [2**32 + 3, -2**32 + 9, 11]),
    "uint32": ("uint32", [2**32 - 1, 7, 2**31 + 7], [2**31 + 3, 2**32 - 2, 11]),
    "uint64": ("uint64", [2**64 - 1, 7, 2**32 + 7], [2**63, 2**32 + 9, 11]),
}


@pytest.mark.parametrize("dtype,q_lengths,kv_lengths", WIDE_LENGTHS.values(), ids=WIDE_LENGTHS.keys())
def test_lengths_of_wide_integer_dtypes_clip_before_narrowing(inputs, enable_x64, dtype, q_lengths, kv_lengths):
    """Lengths are clipped to [0, axis] in their own dtype: a length past int32 is still past the axis,
    and a negative one below int32 still nothing (narrowing first wrapped both into other lengths)."""
    case = Case(batch=3, q_len=20, kv_len=30, dtype="float32", causal=True, sinks=True)
    arguments = build_arguments(case, inputs)
    out, lse = fa4_jax.attention(arguments.query, arguments.key, arguments.value, sinks=arguments.sinks,
                                 causal=True, q_seq_lengths=jnp.asarray(np.array(q_lengths, dtype)),
                                 kv_seq_lengths=jnp.asarray(np.array(kv_lengths, dtype)), return_lse=True,
                                 implementation="reference")
    clipped = lambda lengths, axis: np.array([min(max(length, 0), axis) for length in lengths])
    expected_out, expected_lse = oracle.attention_forward(
        arguments.query, arguments.key, arguments.value, sinks=np.asarray(arguments.sinks), causal=True,
        q_seq_lengths=clipped(q_lengths, case.q_len), kv_seq_lengths=clipped(kv_lengths, case.kv_len))
    oracle.assert_close(out, expected_out, 1e-5, "out")
    oracle.assert_close(lse, expected_lse, 1e-5, "lse", floor=1.0)


def test_reference_memory_grows_linearly_with_sequence():
    """The reference is blockwise over keys: compiled forward + backward scratch memory grows ~linearly
    with the sequence (4x for 4x), far below one [Sq, Sk] logits matrix."""
    scratch = {}
    for length in (1024, 4096):
        spec = jax.ShapeDtypeStruct((1, length, 2, 64), jnp.float32)
        gradient = jax.jit(jax.grad(lambda q, k, v: fa4_jax.attention(
            q, k, v, causal=True, implementation="reference").sum(), argnums=(0, 1, 2)))
        scratch[length] = gradient.lower(spec, spec, spec).compile().memory_analysis().temp_size_in_bytes
    logits_bytes = 4096 * 4096 * 2 * 4
    assert scratch[4096] < 5 * scratch[1024], scratch
    assert scratch[4096] < logits_bytes / 2, (scratch, logits_bytes)
