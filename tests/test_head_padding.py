"""Head dims the kernels are not built for, reached by zero-padding (fa4_jax/lowering/head_padding.py).

On the CPU: which kernel head dims the routing table picks for every head dim and the value head dims
models use; that the padding itself is exact (pad, the reference at the padded dims with the call's
scale, slice: forward and gradients against the float64 oracle); and the CUDA lowering rules end to
end, with stand-in kernel modules that run the reference at the dims they are handed, through
`fa4_jax.attention` and its VJP; and the real sm90 and sm100 kernels, lowered at the padded dims
(compiled for sm_90a / sm_100a here). The GPU cases are the padded rows of the shared grid
(`test_attention.HEAD_DIM_CASES`, run by tests/test_attention_cute.py).
"""

from __future__ import annotations

import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.interpreters import mlir as mlir_internals

import numpy_reference as oracle
from conftest import has_gpu
from fa4_jax.config import AttentionConfig
from fa4_jax.kernels import host
from fa4_jax.lowering import cuda, head_padding
from fa4_jax.primitive import attention_bwd_inner_p, attention_fwd_inner_p, attention_tangent_inner_p
from fa4_jax.reference import reference_backward, reference_forward, reference_tangent
from test_attention import AttentionTestBase, Case, with_cases

KERNEL_HEAD_DIMS = (64, 96, 128, 192, 256)   # the sm100 forward's, and the sm90 backward's
SM90_FORWARD_HEAD_DIMS = (64, 80, 96, 128, 192, 256)   # D = 80 has a kernel of its own there
SM100_BACKWARD_HEAD_DIMS = (64, 96, 128)
MLA = (192, 128)   # DeepSeek MLA's (D, Dv): the sm90 forward and large-head backward take it besides D = Dv
SM90_FORWARD_PAIRS = tuple((d, d) for d in SM90_FORWARD_HEAD_DIMS) + (MLA,)
SM90_BACKWARD_PAIRS = tuple((d, d) for d in KERNEL_HEAD_DIMS) + (MLA,)   # the small- and large-head kernels'
SM90_PAIRS = {"forward": SM90_FORWARD_PAIRS, "backward": SM90_BACKWARD_PAIRS}


def _problem(head_dim, v_head_dim=None):
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    return host.Problem((1, 8, 4, head_dim), (1, 8, 2, head_dim), (1, 8, 2, v_head_dim), "bfloat16")


def _next_kernel_head_dim(head_dim, kernel_head_dims):
    return min(d for d in kernel_head_dims if d >= head_dim)


def _route(pass_, capability, head_dim, v_head_dim=None):
    route, padding, reason = cuda.route_for(pass_, capability, _problem(head_dim, v_head_dim))
    return route, padding, reason


# ------------------------------------------------------------------------------------- routing decision

@pytest.mark.parametrize("capability", [(9, 0), (10, 0)], ids=["sm90", "sm100"])
def test_forward_pads_every_head_dim_to_the_next_kernel_head_dim(capability):
    """Every head dim 1..256 (the multiples of 8 models use, and the rest) runs the forward kernel of
    the next head dim up, value padded alike; the kernel's own head dims are not padded. On sm_90 that
    includes D = 80 (so 65..79 pad to 80), on sm_100 not (65..95 pad to 96)."""
    head_dims = SM90_FORWARD_HEAD_DIMS if capability == (9, 0) else KERNEL_HEAD_DIMS
    for head_dim in range(1, 257):
        route, padding, reason = _route("forward", capability, head_dim)
        assert reason is None, (head_dim, reason)
        kernel_head_dim = _next_kernel_head_dim(head_dim, head_dims)
        assert (padding.kernel_head_dim, padding.kernel_v_head_dim) == (kernel_head_dim, kernel_head_dim)
        assert padding.is_identity == (head_dim in head_dims)
        assert route.module == f"fa4_jax.kernels.sm{capability[0]}0.forward"


def test_sm90_backward_pads_to_the_small_or_the_large_head_kernel():
    for head_dim in range(1, 257):
        route, padding, reason = _route("backward", (9, 0), head_dim)
        kernel_head_dim = _next_kernel_head_dim(head_dim, KERNEL_HEAD_DIMS)
        assert reason is None and padding.kernel_head_dim == padding.kernel_v_head_dim == kernel_head_dim
        large = kernel_head_dim in (192, 256)
        assert route.module == "fa4_jax.kernels.sm90." + ("backward_large_heads" if large else "backward")


def test_sm100_backward_pads_up_to_128_and_names_larger_head_dims():
    for head_dim in range(1, 257):
        route, padding, reason = _route("backward", (10, 0), head_dim)
        if head_dim <= 128:
            assert reason is None and route.module == "fa4_jax.kernels.sm100.backward"
            assert padding.kernel_head_dim == _next_kernel_head_dim(head_dim, SM100_BACKWARD_HEAD_DIMS)
        else:
            assert route is None and f"take head dims up to 128" in reason and reason.endswith(f"not {head_dim}")


def test_sm90_tangent_pads_up_to_128_and_names_larger_head_dims():
    """The tangent kernel is built for D = 64 and 128: every head dim up to 128 pads to the next of
    those (D = 80 runs it at 128: 1.6x the FLOPs, still one fused pass), larger ones are named."""
    for head_dim in range(1, 257):
        route, padding, reason = _route("tangent", (9, 0), head_dim)
        if head_dim <= 128:
            assert reason is None and route.module == "fa4_jax.kernels.sm90.tangent"
            assert padding.kernel_head_dim == padding.kernel_v_head_dim == _next_kernel_head_dim(head_dim, (64, 128))
            assert padding.is_identity == (head_dim in (64, 128))
        else:
            assert route is None and reason == ("the tangent kernels for compute capability 9.x take head dims up "
                                                f"to 128 (smaller ones zero-padded to one of (64, 128)), not {head_dim}")
    for dims in ((96, 64), (64, 128), (40, 72)):
        _, padding, _ = _route("tangent", (9, 0), *dims)
        assert (padding.kernel_head_dim, padding.kernel_v_head_dim) == (128, 128)
    assert _route("tangent", (9, 0), 192, 128)[2].endswith("not 192 with value head dim 128")
    assert _route("tangent", (10, 0), 80)[2].startswith("there is no CuTe tangent kernel for compute capability 10.0")


# (head dim, value head dim) -> the kernels' (D', Dv') on the sm100 forward (kernels of D = Dv only).
VALUE_HEAD_DIMS = {
    (192, 128): (192, 192),   # DeepSeek MLA
    (160, 128): (192, 192),
    (192, 64): (192, 192),
    (96, 64): (96, 96),
    (64, 128): (128, 128),
    (256, 128): (256, 256),
    (128, 64): (128, 128),
    (96, 256): (256, 256),
    (40, 72): (96, 96),
    (80, 80): (96, 96),
}
# The sm90 forward and backward also take MLA's 192/128 themselves, and it is the cheaper kernel for
# every call of 128 < D <= 192 and Dv <= 128 (160/128: 320 / 288 = 1.11x the FLOPs, not 192/192's 1.33x).
SM90_BACKWARD_VALUE_HEAD_DIMS = {**VALUE_HEAD_DIMS, (192, 128): MLA, (160, 128): MLA, (192, 64): MLA}
# The sm90 forward's own D = 80 kernel holds 80/80 unpadded and 40/72 at 160 / 112 = 1.43x the FLOPs
# (96/96: 1.71x).
SM90_FORWARD_VALUE_HEAD_DIMS = {**SM90_BACKWARD_VALUE_HEAD_DIMS, (40, 72): (80, 80), (80, 80): (80, 80)}


@pytest.mark.parametrize("dims", list(VALUE_HEAD_DIMS), ids=[f"{d}-{v}" for d, v in VALUE_HEAD_DIMS])
@pytest.mark.parametrize("capability, pass_, kernel_dims", [
    ((9, 0), "forward", SM90_FORWARD_VALUE_HEAD_DIMS), ((9, 0), "backward", SM90_BACKWARD_VALUE_HEAD_DIMS),
    ((10, 0), "forward", VALUE_HEAD_DIMS)], ids=["sm90-forward", "sm90-backward", "sm100-forward"])
def test_value_head_dims_pad_to_the_cheapest_kernel_that_holds_them(dims, capability, pass_, kernel_dims):
    _, padding, reason = _route(pass_, capability, *dims)
    assert reason is None
    assert (padding.head_dim, padding.v_head_dim) == dims
    assert (padding.kernel_head_dim, padding.kernel_v_head_dim) == kernel_dims[dims]


@pytest.mark.parametrize("pass_", ["forward", "backward"])
def test_sm90_takes_every_call_the_mla_pair_holds_and_pads_the_rest_as_before(pass_):
    """Every (D, Dv) up to 256: the sm90 forward and backward run the 192/128 kernel exactly where it
    holds the call and no D = Dv kernel of less work does (128 < D <= 192, Dv <= 128), unpadded only for
    192/128 itself; everywhere else they pick what the D = Dv kernels alone would (the forward's
    include D = 80, the backward's not)."""
    head_dims = SM90_FORWARD_HEAD_DIMS if pass_ == "forward" else KERNEL_HEAD_DIMS
    for head_dim in range(1, 257):
        for v_head_dim in range(1, 257):
            route, padding, reason = _route(pass_, (9, 0), head_dim, v_head_dim)
            kernel_dims = (padding.kernel_head_dim, padding.kernel_v_head_dim)
            module = ("forward" if pass_ == "forward" else
                      "backward_large_heads" if kernel_dims[0] in (192, 256) else "backward")
            assert reason is None and route.module == "fa4_jax.kernels.sm90." + module
            if 128 < head_dim <= 192 and v_head_dim <= 128:
                assert kernel_dims == MLA, (head_dim, v_head_dim, kernel_dims)
            else:
                d = _next_kernel_head_dim(max(head_dim, v_head_dim), head_dims)
                assert kernel_dims == (d, d), (head_dim, v_head_dim, kernel_dims)
            assert padding.is_identity == ((head_dim, v_head_dim) in SM90_PAIRS[pass_])


def test_mla_runs_the_sm90_forward_and_backward_unpadded():
    """Each pass is planned on its own routes: MLA's forward runs the sm90 forward at its own dims, its
    backward the large-head kernel at its own dims too; the tangent has nothing to pad it to, and
    Blackwell's forward (no MLA pair) pads it to 192/192."""
    route, padding, reason = _route("forward", (9, 0), *MLA)
    assert reason is None and route.module == "fa4_jax.kernels.sm90.forward" and padding.is_identity
    route, padding, reason = _route("backward", (9, 0), *MLA)
    assert reason is None and route.module == "fa4_jax.kernels.sm90.backward_large_heads" and padding.is_identity
    assert _route("tangent", (9, 0), *MLA)[2].endswith("not 192 with value head dim 128")
    route, padding, _ = _route("forward", (10, 0), *MLA)
    assert route.module == "fa4_jax.kernels.sm100.forward"
    assert (padding.kernel_head_dim, padding.kernel_v_head_dim) == (192, 192)


def test_sm100_backward_names_a_value_head_dim_beyond_its_kernel():
    _, _, reason = _route("backward", (10, 0), 192, 128)
    assert reason.endswith("not 192 with value head dim 128")
    _, padding, _ = _route("backward", (10, 0), 96, 64)
    assert (padding.kernel_head_dim, padding.kernel_v_head_dim) == (96, 96)


def test_decode_is_not_padded():
    """The decode kernel reads the cache in place: a head dim it lacks gets the table's reason."""
    _, _, reason = _route("decode", (9, 0), 80)
    assert reason == "the decode kernels for compute capability 9.x take head dims (64, 128, 256), not 80"


def test_plan_takes_the_least_work():
    """A kernel pair of its own value head dim (the sm90 forward's MLA pair) wins over padding V; among
    pairs of equal work the smaller head dim; nothing large enough: None."""
    assert head_padding.plan(192, 128, [(256, 256), (192, 192), (192, 128)]) == head_padding.HeadPadding(
        192, 128, 192, 128)
    assert head_padding.plan(100, 60, [(128, 128), (128, 64), (192, 64)]).kernel_v_head_dim == 64
    assert head_padding.plan(100, 100, [(160, 128), (128, 160)]).kernel_head_dim == 128
    assert head_padding.plan(200, 64, [(128, 128), (192, 192)]) is None


def test_flop_ratios_in_the_docstring():
    """The cost head_padding.py's docstring and the README quote."""
    ratios = {(80, 80): 1.2, (72, 72): 4 / 3, (112, 112): 8 / 7, (160, 160): 1.2, (192, 128): 1.2,
              (64, 128): 4 / 3, (256, 128): 4 / 3, (96, 64): 1.2}
    for (head_dim, v_head_dim), ratio in ratios.items():
        padding = head_padding.plan(head_dim, v_head_dim, [(d, d) for d in KERNEL_HEAD_DIMS])
        assert padding.flop_ratio == pytest.approx(ratio)
    # On the sm90 forward and backward, with their MLA pair, and the forward's D = 80.
    for pass_ in ("forward", "backward"):
        for (head_dim, v_head_dim), ratio in {(160, 128): 10 / 9, MLA: 1.0}.items():
            assert head_padding.plan(head_dim, v_head_dim, SM90_PAIRS[pass_]).flop_ratio == pytest.approx(ratio)
    for (head_dim, v_head_dim), ratio in {(80, 80): 1.0, (72, 72): 10 / 9}.items():
        assert head_padding.plan(head_dim, v_head_dim, SM90_FORWARD_PAIRS).flop_ratio == pytest.approx(ratio)


# ---------------------------------------------------------------------------- the padding is exact

# (head dim, value head dim, features): padded ones, each with masks / sinks / softcap / GQA it must
# leave alone.
EXACTNESS_CASES = {
    "d80-causal-sinks-gqa": (80, 80, dict(causal=True, sinks=True), 4, 2),
    "d72-window-softcap-mqa": (72, 72, dict(window=(12, 3), softcap=2.0), 4, 1),
    "d112-lengths": (112, 112, dict(lengths=True, causal=True), 2, 2),
    "d160-segments": (160, 160, dict(segments=True), 4, 2),
    "d192-v128-causal-sinks": (192, 128, dict(causal=True, sinks=True), 4, 2),
    "d96-v64-lengths-softcap": (96, 64, dict(lengths=True, softcap=3.0), 4, 2),
    "d64-v128-window": (64, 128, dict(window=(None, 0)), 4, 4),
    "d256-v128-causal-segments": (256, 128, dict(causal=True, segments=True), 4, 2),
    "d36-odd": (36, 36, dict(causal=True), 2, 1),
}


def _exactness_inputs(inputs, head_dim, v_head_dim, features, q_heads, kv_heads):
    batch, q_len, kv_len = 2, 37, 53
    query = inputs.normal((batch, q_len, q_heads, head_dim), scale=1.5)
    key = inputs.normal((batch, kv_len, kv_heads, head_dim))
    value = inputs.normal((batch, kv_len, kv_heads, v_head_dim))
    window = features.get("window")
    config = AttentionConfig(scale=head_dim ** -0.5, causal=features.get("causal", False),
                             window_left=window[0] if window else None, window_right=window[1] if window else None,
                             softcap=features.get("softcap"), has_sinks=features.get("sinks", False),
                             has_segment_ids=features.get("segments", False),
                             has_q_seq_lengths=features.get("lengths", False),
                             has_kv_seq_lengths=features.get("lengths", False))
    optional, oracle_options = {}, dict(scale=config.scale, causal=config.causal, window=window,
                                        softcap=config.softcap)
    if config.has_sinks:
        optional["sinks"] = inputs.normal((q_heads,))
        oracle_options["sinks"] = np.asarray(optional["sinks"])
    if config.has_segment_ids:
        optional["q_segment_ids"] = inputs.segment_ids(batch, q_len)
        optional["kv_segment_ids"] = inputs.segment_ids(batch, kv_len)
        oracle_options["segment_ids"] = (np.asarray(optional["q_segment_ids"]), np.asarray(optional["kv_segment_ids"]))
    if config.has_q_seq_lengths:
        optional["q_seq_lengths"] = inputs.lengths(batch, q_len)
        optional["kv_seq_lengths"] = inputs.lengths(batch, kv_len)
        oracle_options["q_seq_lengths"] = np.asarray(optional["q_seq_lengths"])
        oracle_options["kv_seq_lengths"] = np.asarray(optional["kv_seq_lengths"])
    return query, key, value, config, optional, oracle_options


@pytest.mark.parametrize("head_dim, v_head_dim, features, q_heads, kv_heads", EXACTNESS_CASES.values(),
                         ids=EXACTNESS_CASES.keys())
def test_padding_is_exact(inputs, head_dim, v_head_dim, features, q_heads, kv_heads):
    """Pad, the reference at the kernel's head dims with the call's own scale (1/sqrt of the original
    head dim), slice: out, lse and every gradient as the float64 oracle has them at the original dims,
    and the columns the kernel adds come out exactly zero."""
    query, key, value, config, optional, oracle_options = _exactness_inputs(
        inputs, head_dim, v_head_dim, features, q_heads, kv_heads)
    padding = head_padding.plan(head_dim, v_head_dim, [(d, d) for d in KERNEL_HEAD_DIMS])
    assert not padding.is_identity

    @jax.jit
    def forward(q, k, v, optional):
        """(out, lse, the kernel's padded out)."""
        kernel_out = []

        def kernel(q, k, v, optional):
            assert q.shape[-1] == k.shape[-1] == padding.kernel_head_dim
            assert v.shape[-1] == padding.kernel_v_head_dim
            out, lse = reference_forward(q, k, v, optional, config)
            kernel_out.append(out)
            return out, lse
        out, lse = padding.forward(kernel, q, k, v, optional)
        return out, lse, kernel_out[0]

    @jax.jit
    def backward(q, k, v, out, lse, d_out, d_lse, optional):
        """(dq, dk, dv, dsinks, the kernel's padded (dq, dk, dv))."""
        kernel_grads = []

        def kernel(q, k, v, out, lse, d_out, d_lse, optional):
            assert out.shape[-1] == d_out.shape[-1] == padding.kernel_v_head_dim
            grads = reference_backward(q, k, v, out, lse, d_out, d_lse, optional, config)
            kernel_grads.append(grads[:3])
            return grads
        return padding.backward(kernel, q, k, v, out, lse, d_out, d_lse, optional), kernel_grads[0]

    out, lse, kernel_out = forward(query, key, value, optional)
    expected_out, expected_lse = oracle.attention_forward(query, key, value, **oracle_options)
    oracle.assert_close(out, expected_out, 1e-5, "out")
    oracle.assert_close(lse, expected_lse, 1e-5, "lse", floor=1.0)
    assert np.all(np.asarray(kernel_out)[..., v_head_dim:] == 0)

    d_out = inputs.normal(out.shape)
    d_lse = inputs.normal(lse.shape)
    grads, kernel_grads = backward(query, key, value, out, lse, d_out, d_lse, optional)
    expected = oracle.attention_backward(query, key, value, d_out, d_lse, **oracle_options)
    for name, grad, operand in zip(("dq", "dk", "dv"), grads, (query, key, value)):
        assert grad.shape == operand.shape
        oracle.assert_close(grad, expected[name], 1e-5, name, floor=expected[f"{name}_scale"])
    if config.has_sinks:
        oracle.assert_close(grads[3], expected["dsinks"], 1e-5, "dsinks", floor=expected["dsinks_scale"])
    kernel_dq, kernel_dk, kernel_dv = (np.asarray(grad) for grad in kernel_grads)
    assert np.all(kernel_dq[..., head_dim:] == 0) and np.all(kernel_dk[..., head_dim:] == 0)
    assert np.all(kernel_dv[..., v_head_dim:] == 0)


TANGENT_HEAD_DIMS = (64, 128)   # the sm90 tangent kernel's


@pytest.mark.parametrize("head_dim, v_head_dim, features, q_heads, kv_heads",
                         [case for case in EXACTNESS_CASES.values() if max(case[:2]) <= max(TANGENT_HEAD_DIMS)],
                         ids=[name for name, case in EXACTNESS_CASES.items() if max(case[:2]) <= max(TANGENT_HEAD_DIMS)])
def test_tangent_padding_is_exact(inputs, head_dim, v_head_dim, features, q_heads, kv_heads):
    """Pad to the tangent kernel's head dims, the reference tangent there, slice: (t_out, t_lse) as the
    reference tangent has them at the call's dims (itself checked against the oracle by duality,
    tests/test_forward_mode.py), and the kernel's extra t_out columns exactly zero."""
    query, key, value, config, optional, _ = _exactness_inputs(inputs, head_dim, v_head_dim, features, q_heads,
                                                               kv_heads)
    padding = head_padding.plan(head_dim, v_head_dim, [(d, d) for d in TANGENT_HEAD_DIMS])
    assert not padding.is_identity
    out, lse = reference_forward(query, key, value, optional, config)
    tangents = [inputs.normal(x.shape) for x in (query, key, value)]
    t_sinks = inputs.normal(optional["sinks"].shape) if config.has_sinks else None

    @jax.jit
    def padded(*operands):
        kernel_t_out = []

        def kernel(q, k, v, out, lse, t_q, t_k, t_v, t_sinks, optional):
            assert q.shape[-1] == k.shape[-1] == t_q.shape[-1] == t_k.shape[-1] == padding.kernel_head_dim
            assert v.shape[-1] == out.shape[-1] == t_v.shape[-1] == padding.kernel_v_head_dim
            t_out, t_lse = reference_tangent(q, k, v, out, lse, t_q, t_k, t_v, t_sinks, optional, config)
            kernel_t_out.append(t_out)
            return t_out, t_lse
        return padding.tangent(kernel, *operands, optional), kernel_t_out[0]

    (t_out, t_lse), kernel_t_out = padded(query, key, value, out, lse, *tangents, t_sinks)
    expected_t_out, expected_t_lse = jax.jit(lambda *operands: reference_tangent(*operands, optional, config))(
        query, key, value, out, lse, *tangents, t_sinks)
    assert t_out.shape == expected_t_out.shape and t_lse.shape == expected_t_lse.shape
    oracle.assert_close(t_out, expected_t_out, 1e-5, "t_out")
    oracle.assert_close(t_lse, expected_t_lse, 1e-5, "t_lse", floor=1.0)
    assert np.all(np.asarray(kernel_t_out)[..., v_head_dim:] == 0)


# ------------------------------------------------------------- the CUDA lowering rules, end to end

class _KernelCalls:
    """What the stand-in kernel modules were asked: (module, kernel problem's head dims, scale)."""

    def __init__(self):
        self.calls = []
        self.configs = []   # the AttentionConfig of each call


def _stand_in_kernel(name, calls: _KernelCalls, pass_: str):
    """A kernel module face that takes every call and runs the reference at the head dims it is handed."""
    module = types.ModuleType(name)
    module.unsupported_reason = lambda config, problem: None
    module.options = lambda config, problem: (config, problem)

    def run(options, *operands):
        config, problem = options
        query, key, value = operands[:3]
        assert query.shape == problem.query and key.shape == problem.key and value.shape == problem.value
        calls.calls.append((name, problem.head_dim, problem.v_head_dim, config.scale))
        calls.configs.append(config)
        reference = {"forward": reference_forward, "backward": reference_backward, "tangent": reference_tangent}
        return reference[pass_](*operands, config)
    module.run = run
    return module


@pytest.fixture
def cuda_rules_on_cpu(monkeypatch):
    """The CUDA lowering rules on the CPU, on a pretended compute capability 9.0 whose kernel modules
    (the real routing table's) are stand-ins running the reference: what the rules pad and slice, and
    what the modules are handed, run for real."""
    calls = _KernelCalls()
    for name, pass_ in (("fa4_jax.kernels.sm90.forward", "forward"), ("fa4_jax.kernels.sm90.backward", "backward"),
                        ("fa4_jax.kernels.sm90.backward_large_heads", "backward"),
                        ("fa4_jax.kernels.sm90.tangent", "tangent")):
        monkeypatch.setitem(sys.modules, name, _stand_in_kernel(name, calls, pass_))
    decode = types.ModuleType("fa4_jax.kernels.sm90.decode")
    decode.unsupported_reason = lambda config, problem: "not the decode kernel"
    monkeypatch.setitem(sys.modules, "fa4_jax.kernels.sm90.decode", decode)
    monkeypatch.setattr(cuda, "compute_capability", lambda: (9, 0))
    cpu_rules = mlir_internals._platform_specific_lowerings["cpu"]
    for primitive, rule in ((attention_fwd_inner_p, cuda._forward_rule), (attention_bwd_inner_p, cuda._backward_rule),
                            (attention_tangent_inner_p, cuda._tangent_rule)):
        monkeypatch.setitem(cpu_rules, primitive, mlir_internals.LoweringRuleEntry(rule, True))
    return calls


def _padded(case: Case) -> bool:
    """Whether `case` is padded on sm_90 in either pass (D = 80: the backward only)."""
    return not all(head_padding.plan(case.head_dim, case.v_dim, pairs).is_identity for pairs in SM90_PAIRS.values())


# return_lse=False and deterministic=True on padded head dims (the shared grid runs those on D 64); 160/128
# pads Q and K to MLA's 192/128.
PADDED_OPTION_CASES = [Case(head_dim=80, causal=True, sinks=True), Case(head_dim=160, value_dim=128, kv_heads=1)]


@pytest.mark.skipif(has_gpu(), reason="drives the CUDA rules on the CPU; on a GPU test_attention_cute.py runs them")
class TestPaddedThroughCudaRules(AttentionTestBase):
    """The shared grid's padded head-dim cases through `fa4_jax.attention(implementation="cute")`,
    its custom VJP and the CUDA rules, each kernel a stand-in running the reference at the padded dims
    (float32, so the reference's own tolerance applies)."""

    implementation = "cute"

    @pytest.fixture(autouse=True)
    def _rules(self, cuda_rules_on_cpu):
        self.calls = cuda_rules_on_cpu
        yield
        # Every case reached the stand-ins at head dims their kernel takes.
        assert self.calls.calls, "no kernel module was called"
        for name, kernel_head_dim, kernel_v_head_dim, _ in self.calls.calls:
            pairs = (SM90_FORWARD_PAIRS if name.endswith(".forward") else
                     SM90_BACKWARD_PAIRS if name.endswith(".backward_large_heads") else
                     [(d, d) for d in KERNEL_HEAD_DIMS])
            assert (kernel_head_dim, kernel_v_head_dim) in pairs

    def supports(self, case: Case) -> bool:
        return _padded(case)

    @with_cases(PADDED_OPTION_CASES)
    def test_padded_without_lse(self, case, inputs):
        AttentionTestBase.test_without_lse(self, case, inputs)

    @with_cases(PADDED_OPTION_CASES)
    def test_padded_deterministic_backward(self, case, inputs):
        AttentionTestBase.test_deterministic_backward_is_reproducible(self, case, inputs)
        backward = [config for (name, *_), config in zip(self.calls.calls, self.calls.configs) if "backward" in name]
        assert len(backward) == 3 and all(config.deterministic for config in backward)   # three gradients taken


def test_the_kernels_get_the_callers_scale(cuda_rules_on_cpu, inputs):
    """The scale the kernel gets is the call's: 1/sqrt(72) by default at D = 72 (not 1/sqrt(80), the
    forward kernel it pads to), or the one given; D = 80's forward runs unpadded and its backward at 96
    with 1/sqrt(80); and the backward of D = 160 runs the large-head module at 192."""
    import fa4_jax

    query = inputs.normal((1, 16, 2, 72))
    for scale, expected in ((None, 72 ** -0.5), (0.3, 0.3)):
        jax.jit(lambda q: fa4_jax.attention(q, q, q, scale=scale, implementation="cute"))(query)
        assert cuda_rules_on_cpu.calls[-1] == ("fa4_jax.kernels.sm90.forward", 80, 80, pytest.approx(expected))
    query = inputs.normal((1, 16, 2, 80))
    jax.jit(jax.grad(lambda q: fa4_jax.attention(q, q, q, implementation="cute").sum()))(query)
    assert [call[:3] for call in cuda_rules_on_cpu.calls[-2:]] == [("fa4_jax.kernels.sm90.forward", 80, 80),
                                                                   ("fa4_jax.kernels.sm90.backward", 96, 96)]
    assert cuda_rules_on_cpu.calls[-1][3] == pytest.approx(80 ** -0.5)
    query = inputs.normal((1, 16, 2, 160))
    jax.jit(jax.grad(lambda q: fa4_jax.attention(q, q, q, implementation="cute").sum()))(query)
    assert cuda_rules_on_cpu.calls[-1] == ("fa4_jax.kernels.sm90.backward_large_heads", 192, 192,
                                           pytest.approx(160 ** -0.5))


@pytest.mark.parametrize("dims", [MLA, (160, 128)], ids=["d192-v128", "d160-v128"])
def test_mla_forward_and_backward_at_192_128_through_the_api(cuda_rules_on_cpu, inputs, dims):
    """`fa4_jax.attention` and its gradient at MLA-like head dims, causal with Sq != Sk and GQA: the
    forward and the backward module are each handed 192/128 (192/128 itself unpadded, 160/128 with Q
    and K padded), the backward fed the forward's O at the call's Dv = 128; out, LSE and every gradient
    equal the reference's at the call's dims."""
    import fa4_jax

    head_dim, v_head_dim = dims
    query, key = inputs.normal((2, 37, 4, head_dim), scale=1.5), inputs.normal((2, 53, 2, head_dim))
    value = inputs.normal((2, 53, 2, v_head_dim))

    def loss(implementation):
        def function(q, k, v):
            out, lse = fa4_jax.attention(q, k, v, causal=True, return_lse=True, implementation=implementation)
            return jnp.sum(out * jnp.cos(out)) + jnp.sum(jnp.sin(lse)), (out, lse)
        return jax.jit(jax.value_and_grad(function, argnums=(0, 1, 2), has_aux=True))(query, key, value)
    (_, (out, lse)), grads = loss("cute")
    assert [call[:3] for call in cuda_rules_on_cpu.calls] == [
        ("fa4_jax.kernels.sm90.forward", 192, 128), ("fa4_jax.kernels.sm90.backward_large_heads", 192, 128)]
    (_, (expected_out, expected_lse)), expected_grads = loss("reference")
    assert out.shape == expected_out.shape == (2, 37, 4, v_head_dim)
    oracle.assert_close(out, expected_out, 1e-5, "out")
    oracle.assert_close(lse, expected_lse, 1e-5, "lse", floor=1.0)
    for name, grad, expected, operand in zip(("dq", "dk", "dv"), grads, expected_grads, (query, key, value)):
        assert grad.shape == operand.shape
        oracle.assert_close(grad, expected, 1e-5, name)


@pytest.mark.parametrize("dims", [(80, 80), (96, 64), (40, 40)], ids=["d80", "d96-v64", "d40"])
def test_jvp_of_a_padded_head_dim_runs_the_tangent_kernel(cuda_rules_on_cpu, inputs, dims):
    """jax.jvp through `fa4_jax.attention(implementation="cute")` at a head dim the tangent kernel
    lacks: the tangent module is handed the padded operands (D = 80 and 96/64 at 128, 40 at 64) with
    the call's scale, and the JVP equals the reference's at the call's dims."""
    import fa4_jax

    head_dim, v_head_dim = dims
    query, key = inputs.normal((1, 24, 4, head_dim), scale=1.5), inputs.normal((1, 40, 2, head_dim))
    value = inputs.normal((1, 40, 2, v_head_dim))
    primals = (query, key, value)
    tangents = tuple(inputs.normal(x.shape) for x in primals)

    def jvp(implementation):
        function = lambda *p: fa4_jax.attention(*p, causal=True, softcap=4.0, return_lse=True,
                                                implementation=implementation)
        return jax.jit(lambda p, t: jax.jvp(function, p, t))(primals, tangents)
    (out, lse), (t_out, t_lse) = jvp("cute")
    kernel_dim = 64 if max(dims) <= 64 else 128
    assert cuda_rules_on_cpu.calls[-1] == ("fa4_jax.kernels.sm90.tangent", kernel_dim, kernel_dim,
                                           pytest.approx(head_dim ** -0.5))
    (expected_out, expected_lse), (expected_t_out, expected_t_lse) = jvp("reference")
    assert t_out.shape == expected_t_out.shape == out.shape and t_lse.shape == lse.shape
    oracle.assert_close(t_out, expected_t_out, 1e-5, "t_out")
    oracle.assert_close(t_lse, expected_t_lse, 1e-5, "t_lse", floor=1.0)


def test_jvp_beyond_the_tangent_kernel_names_why(cuda_rules_on_cpu, inputs):
    """D = 192 has no tangent kernel to pad to: "cute" refuses, naming the head dims it takes."""
    import fa4_jax

    query = inputs.normal((1, 16, 2, 192))
    with pytest.raises(NotImplementedError, match=r"tangent kernels for compute capability 9.x take head dims up "
                                                  r"to 128 \(smaller ones zero-padded to one of \(64, 128\)\), not 192"):
        jax.jit(lambda q, t: jax.jvp(lambda x: fa4_jax.attention(x, x, x, implementation="cute"), (q,), (t,)))(
            query, query)


def test_residuals_keep_the_callers_head_dims(cuda_rules_on_cpu, inputs):
    """The padding lives inside the primitives' lowering: what the VJP saves (q, k, v, out, lse) is
    at the call's head dims, never a padded copy."""
    import fa4_jax

    query, key = inputs.normal((1, 16, 4, 192), jnp.bfloat16), inputs.normal((1, 16, 2, 192), jnp.bfloat16)
    value = inputs.normal((1, 16, 2, 128), jnp.bfloat16)
    (out, lse), residuals = jax.vjp(lambda q, k, v: fa4_jax.attention(
        q, k, v, causal=True, return_lse=True, implementation="cute"), query, key, value)
    saved = sorted(tuple(leaf.shape) for leaf in jax.tree_util.tree_leaves(residuals))
    assert saved == sorted(tuple(x.shape) for x in (query, key, value, out, lse))


# ------------------------------------------------------------------- the real kernels, lowered for sm_90a

_LOWER = r"""
import json, sys
import jax, jax.numpy as jnp
import fa4_jax
from fa4_jax.lowering import cuda
head_dim, v_head_dim, capability = json.loads(sys.argv[1])
cuda.compute_capability = lambda: tuple(capability)
query = jax.ShapeDtypeStruct((1, 200, 4, head_dim), jnp.bfloat16)
key = jax.ShapeDtypeStruct((1, 300, 2, head_dim), jnp.bfloat16)
value = jax.ShapeDtypeStruct((1, 300, 2, v_head_dim), jnp.bfloat16)
attention = lambda q, k, v: fa4_jax.attention(q, k, v, causal=True, implementation="cute")
loss = lambda q, k, v: attention(q, k, v).astype(jnp.float32).sum()
texts = [jax.jit(f).trace(query, key, value).lower(lowering_platforms=("cuda",)).as_text()
         for f in (attention, jax.grad(loss, argnums=(0, 1, 2)))]
print("LOWERED " + json.dumps([[line.split(" : ")[-1] for line in text.splitlines()
                                 if "stablehlo.custom_call" in line and "fa4_jax" in line] for text in texts]))
"""


# One case per architecture (each compiles a forward and a backward kernel, ~1 min on a CI core):
# 192/128 runs the sm90 forward and backward unpadded, 80 pads both passes to 96 on sm100. (head dim,
# value head dim, forward kernel's (D', Dv'), backward kernel's (D'', Dv'')).
LOWERED_CASES = {
    "sm90-d192-v128": (192, 128, MLA, MLA, (9, 0), "sm_90a"),
    "sm100-d80": (80, 80, (96, 96), (96, 96), (10, 0), "sm_100a"),
}


@pytest.mark.parametrize("head_dim, v_head_dim, forward_dims, backward_dims, capability, arch",
                         LOWERED_CASES.values(), ids=LOWERED_CASES.keys())
def test_padded_call_lowers_to_the_kernel_at_the_padded_dims(tmp_path, head_dim, v_head_dim, forward_dims,
                                                            backward_dims, capability, arch):
    """`fa4_jax.attention` and its gradient, lowered for CUDA on a pretended compute capability (the DSL
    compiles the real kernels for sm_90a / sm_100a on this CPU): one forward kernel call taking Q / K
    at the forward kernel's head dim and V at its value head dim, and in the gradient that call again
    and one backward call after it, taking Q / K at the backward kernel's head dim and V at its value
    head dim."""
    import json
    import os
    import subprocess

    pytest.importorskip("cutlass")
    from ptx_checks import REPO

    environment = dict(os.environ, CUTE_DSL_ARCH=arch, FA4_JAX_CACHE_DIR=str(tmp_path),
                       PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    process = subprocess.run([sys.executable, "-c", _LOWER, json.dumps([head_dim, v_head_dim, capability])],
                             env=environment, capture_output=True, text=True, timeout=900)
    assert process.returncode == 0, process.stderr[-4000:]
    line = next(line for line in process.stdout.splitlines() if line.startswith("LOWERED "))
    forward_calls, gradient_calls = json.loads(line[len("LOWERED "):])
    d, dv = forward_dims
    forward = (f"(tensor<1x200x4x{d}xbf16>, tensor<1x300x2x{d}xbf16>, tensor<1x300x2x{dv}xbf16>) -> "
               f"(tensor<1x200x4x{dv}xbf16>, tensor<1x4x200xf32>)")
    assert forward_calls == [forward], forward_calls
    d, dv = backward_dims
    backward = f"(tensor<1x200x4x{d}xbf16>, tensor<1x300x2x{d}xbf16>, tensor<1x300x2x{dv}xbf16>"
    assert len(gradient_calls) == 2 and gradient_calls[0] == forward, gradient_calls
    assert gradient_calls[1].startswith(backward), gradient_calls


_LOWER_JVP = r"""
import json
import jax, jax.numpy as jnp
import fa4_jax
from fa4_jax.lowering import cuda
cuda.compute_capability = lambda: (9, 0)
query = jax.ShapeDtypeStruct((1, 200, 4, 80), jnp.bfloat16)
key = jax.ShapeDtypeStruct((1, 300, 2, 80), jnp.bfloat16)
attention = lambda q, k, v: fa4_jax.attention(q, k, v, causal=True, return_lse=True, implementation="cute")
jvp = lambda q, k, v: jax.jvp(attention, (q, k, v), (q, k, v))
text = jax.jit(jvp).trace(query, key, key).lower(lowering_platforms=("cuda",)).as_text()
print("LOWERED " + json.dumps([line.split(" : ")[-1] for line in text.splitlines()
                               if "stablehlo.custom_call" in line and "fa4_jax" in line]))
"""


def test_padded_jvp_lowers_to_the_tangent_kernel_at_128(tmp_path):
    """jax.jvp of `fa4_jax.attention` at D = 80, lowered for CUDA on a pretended compute capability 9.0
    (the DSL compiles the real sm_90a kernels here): the forward kernel at its own 80, then the tangent
    kernel taking Q, K, V, O and the three tangents padded to 128."""
    import json
    import os
    import subprocess

    pytest.importorskip("cutlass")
    from ptx_checks import REPO

    environment = dict(os.environ, CUTE_DSL_ARCH="sm_90a", FA4_JAX_CACHE_DIR=str(tmp_path),
                       PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    process = subprocess.run([sys.executable, "-c", _LOWER_JVP], env=environment, capture_output=True, text=True,
                             timeout=900)
    assert process.returncode == 0, process.stderr[-4000:]
    line = next(line for line in process.stdout.splitlines() if line.startswith("LOWERED "))
    forward_call, tangent_call = json.loads(line[len("LOWERED "):])
    q80, k80 = "tensor<1x200x4x80xbf16>", "tensor<1x300x2x80xbf16>"
    assert forward_call == f"({q80}, {k80}, {k80}) -> ({q80}, tensor<1x4x200xf32>)", forward_call
    q, k = "tensor<1x200x4x128xbf16>", "tensor<1x300x2x128xbf16>"
    lse = "tensor<1x4x256xf32>"   # the LSE in the exp2 domain, padded to whole query tiles
    assert tangent_call == (f"({q}, {k}, {k}, {q}, {lse}, {q}, {k}, {k}) -> ({q}, tensor<1x4x200xf32>)"), tangent_call
