"""The CUDA dispatch: which kernel runs, and how a call no kernel can take falls back or fails.

The CPU part drives `fa4_jax.lowering.cuda` with a stand-in routing table and kernel module and a faked
compute capability; the GPU part checks the same promises end to end on a real device.
"""

import dataclasses
import importlib
import itertools
import sys
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from fa4_jax.config import AttentionConfig
from fa4_jax.kernels import host
from fa4_jax.lowering import cuda
from fa4_jax.primitive import attention_tangent_p

SHAPES = ((1, 8, 2, 64), (1, 8, 2, 64), (1, 8, 2, 64))
# The tests that consult the real routing table import the kernel modules, which need the CuTe DSL
# (installed on Linux only).
try:
    import cutlass  # noqa: F401
    _has_cutlass = True
except ImportError:
    _has_cutlass = False
needs_cutlass = pytest.mark.skipif(not _has_cutlass, reason="nvidia-cutlass-dsl is not installed")


@pytest.fixture
def fake_gpu(monkeypatch):
    """A GPU of compute capability 9.0 whose forward kernel takes only bfloat16."""
    module = types.ModuleType("fake_sm90_forward")
    module.unsupported_reason = lambda config, problem: (
        None if problem.dtype == "bfloat16" else f"dtype {problem.dtype} is not supported")
    monkeypatch.setitem(sys.modules, "fake_sm90_forward", module)
    monkeypatch.setattr(cuda, "ROUTES", (cuda.Route(9, "forward", (64,), "fake_sm90_forward"),))
    monkeypatch.setattr(cuda, "compute_capability", lambda: (9, 0))
    monkeypatch.setattr(cuda, "_warned", set())
    return module


def _avals(dtype):
    return [jax.ShapeDtypeStruct(shape, dtype) for shape in SHAPES]


def _choose(implementation, dtype):
    config = AttentionConfig(scale=0.125, implementation=implementation)
    return cuda.kernel_for("forward", config, *_avals(dtype))


def test_supported_call_gets_the_kernel(fake_gpu):
    assert _choose(None, jnp.bfloat16) is fake_gpu
    assert _choose("cute", jnp.bfloat16) is fake_gpu


def test_reference_is_chosen_when_asked(fake_gpu):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _choose("reference", jnp.bfloat16) is None


def test_unsupported_call_falls_back_with_one_warning(fake_gpu):
    with pytest.warns(UserWarning, match="reference path because dtype float16 is not supported"):
        assert _choose(None, jnp.float16) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same reason is not repeated
        assert _choose(None, jnp.float16) is None


def test_unsupported_call_with_cute_raises(fake_gpu):
    with pytest.raises(NotImplementedError, match="dtype float16 is not supported.*implementation=None"):
        _choose("cute", jnp.float16)


@needs_cutlass
@pytest.mark.parametrize("capability, module", [((9, 0), "sm90.forward"), ((10, 0), "sm100.forward")])
def test_compute_capability_selects_the_kernel(monkeypatch, capability, module):
    """The real table: Hopper gets the sm90 kernel, Blackwell the sm100 one."""
    monkeypatch.setattr(cuda, "compute_capability", lambda: capability)
    chosen = _choose("cute", jnp.bfloat16)
    assert chosen.__name__ == f"fa4_jax.kernels.{module}"


def test_head_dim_above_every_route_names_the_routes_head_dims(fake_gpu):
    """A head dim above every route for this GPU and pass gets the table's reason, before any kernel
    module is asked; a smaller one is zero-padded up to the route's."""
    config = AttentionConfig(scale=0.125, implementation="cute")
    avals = [jax.ShapeDtypeStruct((1, 8, 2, 80), jnp.bfloat16) for _ in range(3)]
    with pytest.raises(NotImplementedError, match=r"the forward kernels for compute capability 9\.x take "
                                                  r"head dims up to 64 \(smaller ones zero-padded to one of "
                                                  r"\(64,\)\), not 80"):
        cuda.kernel_for("forward", config, *avals)
    asked = []
    fake_gpu.unsupported_reason = lambda config, problem: asked.append(problem)
    assert cuda.kernel_for("forward", config, *[aval.update(shape=(1, 8, 2, 48)) for aval in avals]) is fake_gpu
    assert [(p.head_dim, p.v_head_dim) for p in asked] == [(64, 64)]   # the module sees the padded call


def test_backward_head_dim_no_route_takes_names_the_head_dims(monkeypatch):
    """The real table: on Blackwell the backward takes head dims up to 128 (padded to 64 / 96 / 128);
    the reason says so, naming a value head dim that differs (no kernel module is imported for it)."""
    monkeypatch.setattr(cuda, "compute_capability", lambda: (10, 0))
    config = AttentionConfig(scale=0.125, implementation="cute")
    query = jax.ShapeDtypeStruct((1, 8, 2, 160), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match=r"the backward kernels for compute capability 10\.x take "
                                                  r"head dims up to 128 \(smaller ones zero-padded to one of "
                                                  r"\(64, 96, 128\)\), not 160"):
        cuda.kernel_for("backward", config, query, query, query)
    value = jax.ShapeDtypeStruct((1, 8, 2, 192), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match=r"not 64 with value head dim 192"):
        cuda.kernel_for("backward", config, query.update(shape=(1, 8, 2, 64)), query.update(shape=(1, 8, 2, 64)),
                        value)


# The real routing table's backward rows for Hopper: (head dim, the module that takes it).
BACKWARD_ROUTES = {64: "sm90.backward", 96: "sm90.backward", 128: "sm90.backward",
                   192: "sm90.backward_large_heads", 256: "sm90.backward_large_heads"}


@needs_cutlass
@pytest.mark.parametrize("head_dim, module", BACKWARD_ROUTES.items(), ids=[str(d) for d in BACKWARD_ROUTES])
def test_backward_head_dim_selects_the_kernel(monkeypatch, head_dim, module):
    """The real table: on Hopper, head dims 64-128 get the small-head backward kernel and 192/256
    the large-head one."""
    monkeypatch.setattr(cuda, "compute_capability", lambda: (9, 0))
    config = AttentionConfig(scale=0.125, causal=True, implementation="cute")
    avals = [jax.ShapeDtypeStruct((1, 8, 2, head_dim), jnp.bfloat16) for _ in range(3)]
    assert cuda.kernel_for("backward", config, *avals).__name__ == f"fa4_jax.kernels.{module}"


@needs_cutlass
@pytest.mark.parametrize("route", cuda.ROUTES, ids=lambda route: f"{route.capability}-{route.pass_}-{route.module}")
def test_every_route_takes_its_modules_head_dims(route):
    """Each row of the routing table names exactly the head dims (and the extra (head dim, value head
    dim) pairs) its kernel module supports, so the table neither sends a head dim to a kernel that
    refuses it nor hides one the kernel takes."""
    module = importlib.import_module(route.module)
    assert tuple(route.head_dims) == tuple(module.SUPPORTED_HEAD_DIMS)
    assert tuple(route.extra_pairs) == tuple(getattr(module, "EXTRA_HEAD_DIM_PAIRS", ()))
    config = AttentionConfig(scale=0.125)
    for head_dim, v_head_dim in route.head_dim_pairs():
        problem = host.Problem((1, 8, 2, head_dim), (1, 8, 2, head_dim), (1, 8, 2, v_head_dim), "bfloat16")
        assert module.unsupported_reason(config, problem) is None, (head_dim, v_head_dim)


@needs_cutlass
def test_sm90_forward_names_the_value_head_dims_it_takes():
    """The sm90 forward takes MLA's 192/128 besides D = Dv; another value head dim is refused naming both."""
    from fa4_jax.kernels.sm90 import forward as sm90_forward

    config = AttentionConfig(scale=0.125)

    def problem(head_dim, v_head_dim):
        return host.Problem((1, 8, 2, head_dim), (1, 8, 2, head_dim), (1, 8, 2, v_head_dim), "bfloat16")
    assert sm90_forward.unsupported_reason(config, problem(192, 128)) is None
    assert sm90_forward.unsupported_reason(config, problem(192, 64)) == (
        "the sm90 kernel needs the value head dim (64) to equal the query/key head dim (192) (or (head dim, "
        "value head dim) in ((192, 128),))")


@needs_cutlass
@pytest.mark.parametrize("features", [
    dict(), dict(causal=True, deterministic=True), dict(has_segment_ids=True, has_kv_seq_lengths=True),
    dict(softcap=5.0, has_sinks=True, window_left=64, window_right=0), dict(has_q_start=True, q_total=64),
    dict(has_q_seq_lengths=True, has_kv_seq_lengths=True, causal=True)],
    ids=lambda features: "-".join(features) or "plain")
def test_mla_backward_runs_the_large_head_kernel_unpadded(monkeypatch, features):
    """On Hopper a 192/128 backward (GQA, Sq != Sk) picks the large-head kernel at its own dims, no
    padding, with every feature the padded 192/192 path took; the module refuses other value head dims,
    naming the pair it takes."""
    from fa4_jax.kernels.sm90 import backward_large_heads

    monkeypatch.setattr(cuda, "compute_capability", lambda: (9, 0))
    config = AttentionConfig(scale=192 ** -0.5, implementation="cute", **features)
    problem = host.Problem((2, 40, 8, 192), (2, 56, 2, 192), (2, 56, 2, 128), "bfloat16")
    module, padding = cuda.choose_kernel("backward", config, problem)
    assert module is backward_large_heads and padding.is_identity
    kernel = backward_large_heads.Sm90LargeHeadBackwardKernel(backward_large_heads.options(config, problem))
    assert (kernel.head_dim, kernel.v_head_dim) == (192, 128)
    # Three warp groups of which two hold dV, or with segment ids two that both do.
    assert (kernel.consumer_groups, kernel.dv_groups) == ((2, 2) if config.has_segment_ids else (3, 2))
    for dims in ((192, 64), (256, 128)):
        head_dim, v_head_dim = dims
        wrong = host.Problem((2, 40, 8, head_dim), (2, 56, 2, head_dim), (2, 56, 2, v_head_dim), "bfloat16")
        reason = backward_large_heads.unsupported_reason(config, wrong)
        assert reason.endswith("(or (head dim, value head dim) in ((192, 128),))"), reason


def test_gpu_without_kernel_names_its_capability(fake_gpu, monkeypatch):
    monkeypatch.setattr(cuda, "compute_capability", lambda: (8, 0))
    with pytest.raises(NotImplementedError, match=r"compute capability 8\.0 \(forward kernels exist for "
                                                  r"compute capability 9\.x only\)"):
        _choose("cute", jnp.bfloat16)


def test_backward_on_an_unknown_gpu_names_the_capabilities_it_has(monkeypatch):
    """The real backward table has no 12.x entry: the message says which capabilities it does cover."""
    monkeypatch.setattr(cuda, "compute_capability", lambda: (12, 0))
    config = AttentionConfig(scale=0.125, implementation="cute")
    with pytest.raises(NotImplementedError, match=r"no CuTe backward kernel for compute capability 12\.0 "
                                                  r"\(backward kernels exist for compute capability 9\.x, 10\.x only\)"):
        cuda.kernel_for("backward", config, *_avals(jnp.bfloat16))


def _head_dim_avals(dtype, head_dim):
    return [jax.ShapeDtypeStruct(shape[:-1] + (head_dim,), dtype) for shape in SHAPES]


@needs_cutlass
def test_backward_on_blackwell_selects_the_sm100_kernel_or_names_its_head_dims(monkeypatch):
    """The real table: on 10.x, head dims 64, 96 and 128 get the 2-CTA sm100 backward; larger ones say
    which head dims the Blackwell backward takes."""
    monkeypatch.setattr(cuda, "compute_capability", lambda: (10, 0))
    config = AttentionConfig(scale=0.125, causal=True, implementation="cute")
    for head_dim in (64, 96, 128):
        avals = [jax.ShapeDtypeStruct((1, 8, 2, head_dim), jnp.bfloat16) for _ in range(3)]
        assert cuda.kernel_for("backward", config, *avals).__name__ == "fa4_jax.kernels.sm100.backward"
    avals = [jax.ShapeDtypeStruct((1, 8, 2, 192), jnp.bfloat16) for _ in range(3)]
    with pytest.raises(NotImplementedError, match=r"the backward kernels for compute capability 10\.x take "
                                                  r"head dims up to 128 .*, not 192"):
        cuda.kernel_for("backward", config, *avals)


@needs_cutlass
@pytest.mark.parametrize("kind, head_dim", [("forward", 128), ("backward", 128), ("backward", 192),
                                            ("backward", 256)])
def test_sm90_kernels_take_a_sequence_sharded_query(monkeypatch, kind, head_dim):
    """The sm90 forward and both sm90 backward kernels (D <= 128 and the large-head one) take q_start
    (context parallelism's per-shard and ring-step calls; the backwards' shards against the oracle:
    tests/test_sm90_backward.py and tests/test_sm90_backward_large_heads.py, -k query_shard)."""
    monkeypatch.setattr(cuda, "compute_capability", lambda: (9, 0))
    config = AttentionConfig(scale=0.125, causal=True, has_q_start=True, q_total=16, implementation="cute")
    assert cuda.kernel_for(kind, config, *_head_dim_avals(jnp.bfloat16, head_dim)) is not None
    with_kv_lengths = config.replace(has_kv_seq_lengths=True)
    assert cuda.kernel_for(kind, with_kv_lengths, *_head_dim_avals(jnp.bfloat16, head_dim)) is not None


# (what refuses, capability, pass, head dim, config changes, message)
Q_START_REFUSALS = {
    "sm100-forward": ((10, 0), "forward", 128, {}, r"q_start\) is not yet verified on a GPU"),
    "sm100-backward": ((10, 0), "backward", 128, {}, r"sm100 backward does not yet take a sequence-sharded query"),
    "sm90-large-head-backward-with-q-lengths": ((9, 0), "backward", 256, dict(has_q_seq_lengths=True),
                                                r"large-head backward does not combine a sequence-sharded "
                                                r"query \(q_start\) with q_seq_lengths"),
    "sm90-forward-with-q-lengths": ((9, 0), "forward", 128, dict(has_q_seq_lengths=True),
                                    r"does not combine a sequence-sharded query \(q_start\) with q_seq_lengths"),
    "sm90-backward-with-key-offset": ((9, 0), "backward", 128, dict(has_kv_seq_lengths=True, has_kv_start=True,
                                                                    kv_total=32),
                                      r"does not take a key offset \(kv_start"),
}


@needs_cutlass
@pytest.mark.parametrize("capability, kind, head_dim, changes, message", Q_START_REFUSALS.values(),
                         ids=Q_START_REFUSALS.keys())
def test_sequence_sharded_query_refusals_name_the_reason(monkeypatch, capability, kind, head_dim, changes,
                                                         message):
    monkeypatch.setattr(cuda, "compute_capability", lambda: capability)
    config = AttentionConfig(scale=0.125, causal=True, has_q_start=True, q_total=16, implementation="cute",
                             **changes)
    with pytest.raises(NotImplementedError, match=message):
        cuda.kernel_for(kind, config, *_head_dim_avals(jnp.bfloat16, head_dim))


def test_missing_kernel_module_is_reported(fake_gpu, monkeypatch):
    monkeypatch.setattr(cuda, "ROUTES", (cuda.Route(9, "forward", (64,), "fa4_jax.kernels.no_such_kernel"),))
    with pytest.raises(NotImplementedError, match="no_such_kernel is not available"):
        _choose("cute", jnp.bfloat16)


# Every kernel the routing table reaches: (pass, compute capability, a head dim that selects it).
KERNELS = {
    "sm90-forward": ("forward", (9, 0), 128),
    "sm100-forward": ("forward", (10, 0), 128),
    "sm90-backward": ("backward", (9, 0), 128),
    "sm90-backward-large-heads": ("backward", (9, 0), 256),
    "sm100-backward": ("backward", (10, 0), 128),
}


@needs_cutlass
@pytest.mark.parametrize("kind, capability, head_dim", KERNELS.values(), ids=KERNELS.keys())
def test_zero_batch_falls_back_in_both_passes(monkeypatch, kind, capability, head_dim):
    """Batch 0 passes validation (the result is empty) but no kernel launches an empty grid: every
    kernel's unsupported_reason starts with host.kernel_unsupported_reason, the backward's too."""
    monkeypatch.setattr(cuda, "compute_capability", lambda: capability)
    monkeypatch.setattr(cuda, "_warned", set())
    config = AttentionConfig(scale=0.125, causal=True)

    def avals(batch):
        return [jax.ShapeDtypeStruct((batch, 8, 2, head_dim), jnp.bfloat16) for _ in range(3)]
    assert cuda.kernel_for(kind, config, *avals(1)) is not None  # the same call with one batch runs
    with pytest.warns(UserWarning, match="kernel needs non-empty batch and sequence axes"):
        assert cuda.kernel_for(kind, config, *avals(0)) is None


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="needs a host without a GPU")
def test_export_for_cuda_without_a_gpu_uses_the_reference(monkeypatch):
    """Exporting for CUDA on a CPU host cannot compile a kernel: None falls back, "cute" says why."""
    monkeypatch.setattr(cuda, "_warned", set())
    spec = jax.ShapeDtypeStruct((1, 8, 2, 64), jnp.bfloat16)
    with pytest.warns(UserWarning, match="no GPU is visible"):
        exported = jax.export.export(jax.jit(lambda q: fa4_jax.attention(q, q, q, causal=True)),
                                     platforms=["cpu", "cuda"])(spec)
    assert exported.platforms == ("cpu", "cuda")
    with pytest.raises(NotImplementedError, match="no GPU is visible"):
        jax.export.export(jax.jit(lambda q: fa4_jax.attention(q, q, q, implementation="cute")),
                          platforms=["cuda"])(spec)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="needs a host without a GPU")
def test_forward_mode_tangent_on_cuda_warns_or_refuses(monkeypatch):
    """The tangent primitive alone, lowered for CUDA with no GPU visible: no kernel can be compiled, so
    it takes the reference with the usual one-time warning, and implementation="cute" says why."""
    monkeypatch.setattr(cuda, "_warned", set())
    spec = jax.ShapeDtypeStruct((1, 8, 2, 64), jnp.bfloat16)
    lse = jax.ShapeDtypeStruct((1, 2, 8), jnp.float32)

    def tangent(implementation):
        config = AttentionConfig(scale=0.125, causal=True, implementation=implementation)
        return jax.jit(lambda q, out, lse, t: attention_tangent_p.bind(q, q, q, out, lse, t, t, t, config=config))

    with pytest.warns(UserWarning, match="attention tangent runs on the XLA reference path because no GPU is visible"):
        jax.export.export(tangent(None), platforms=["cuda"])(spec, spec, lse, spec)
    with pytest.raises(NotImplementedError, match="cannot run this attention tangent pass: no GPU is visible"):
        jax.export.export(tangent("cute"), platforms=["cuda"])(spec, spec, lse, spec)


@needs_cutlass
def test_tangent_routes_to_the_sm90_kernel_or_names_why_not(monkeypatch):
    """The real table for the forward-mode tangent: the sm90 tangent kernel for D <= 128 on Hopper (64
    and 128 as they are, the rest zero-padded to them); larger head dims, float32 and Blackwell fall
    back naming the reason (refused under "cute")."""
    monkeypatch.setattr(cuda, "_warned", set())
    config = AttentionConfig(scale=0.125, causal=True, has_sinks=True, implementation="cute")
    shapes = lambda d: [jax.ShapeDtypeStruct((1, 8, 2, d), jnp.bfloat16) for _ in range(3)]
    monkeypatch.setattr(cuda, "compute_capability", lambda: (9, 0))
    for head_dim in (64, 128, 96, 80, 40):
        assert cuda.kernel_for("tangent", config, *shapes(head_dim)).__name__ == "fa4_jax.kernels.sm90.tangent"
    with pytest.raises(NotImplementedError, match=r"tangent kernels for compute capability 9\.x take head dims "
                                                  r"up to 128 \(smaller ones zero-padded to one of \(64, 128\)\), "
                                                  r"not 192"):
        cuda.kernel_for("tangent", config, *shapes(192))
    float32 = [aval.update(dtype=jnp.float32) for aval in shapes(64)]
    with pytest.raises(NotImplementedError, match="takes bfloat16 or float16 inputs"):
        cuda.kernel_for("tangent", config, *float32)
    with pytest.warns(UserWarning, match="attention tangent runs on the XLA reference path because the tangent"):
        assert cuda.kernel_for("tangent", config.replace(implementation=None), *shapes(192)) is None
    monkeypatch.setattr(cuda, "compute_capability", lambda: (10, 0))
    with pytest.raises(NotImplementedError, match=r"no CuTe tangent kernel for compute capability 10\.0"):
        cuda.kernel_for("tangent", config, *shapes(64))


def test_cute_on_cpu_raises():
    q = jax.device_put(jnp.ones((1, 8, 2, 64), jnp.bfloat16), jax.local_devices(backend="cpu")[0])
    with pytest.raises(NotImplementedError, match="needs an NVIDIA GPU.*implementation=None"):
        jax.jit(lambda q: fa4_jax.attention(q, q, q, implementation="cute"))(q)


@pytest.mark.gpu
def test_gpu_float32_falls_back_to_reference_or_raises(inputs):
    """float32 has no kernel: None warns and matches the reference; "cute" says what to change."""
    q, k, v = (inputs.normal((2, 100, 4, 64)) for _ in range(3))
    with pytest.raises(NotImplementedError, match="implementation=None"):
        jax.jit(lambda q, k, v: fa4_jax.attention(q, k, v, implementation="cute"))(q, k, v)
    already_warned = set(cuda._warned)
    cuda._warned.clear()
    try:
        with pytest.warns(UserWarning, match="reference path"):
            out = jax.jit(lambda q, k, v: fa4_jax.attention(q, k, v, causal=True))(q, k, v)
    finally:
        cuda._warned.update(already_warned)
    expected = fa4_jax.attention(q, k, v, causal=True, implementation="reference")
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), atol=1e-6, rtol=1e-6)


BACKWARD_KERNELS = {name: (capability, head_dim) for name, (kind, capability, head_dim) in KERNELS.items()
                    if kind == "backward"}


@needs_cutlass
@pytest.mark.parametrize("capability, head_dim", BACKWARD_KERNELS.values(), ids=BACKWARD_KERNELS.keys())
@pytest.mark.parametrize("axis, batch, heads", [("z", 65536, 2), ("y", 1, 65536)], ids=["batch", "kv-heads"])
def test_backward_grid_limit_falls_back(monkeypatch, capability, head_dim, axis, batch, heads):
    """The backward kernels launch a (key blocks, KV heads, batch) grid, and CUDA caps gridDim.y and .z at
    65535: one more KV head or batch element would fail to launch, so the call takes the reference and
    the warning names the limit. 65535 of each still gets the kernel."""
    monkeypatch.setattr(cuda, "compute_capability", lambda: capability)
    monkeypatch.setattr(cuda, "_warned", set())
    config = AttentionConfig(scale=0.125, causal=True)

    def avals(batch, heads):
        return [jax.ShapeDtypeStruct((batch, 8, heads, head_dim), jnp.bfloat16) for _ in range(3)]
    fitting = (batch - 1, heads) if axis == "z" else (batch, heads - 1)
    assert cuda.kernel_for("backward", config, *avals(*fitting)) is not None
    with pytest.warns(UserWarning, match=rf"65536 [a-z/ ]+ exceed CUDA's grid limit of 65535 \(gridDim\.{axis}\)"):
        assert cuda.kernel_for("backward", config, *avals(batch, heads)) is None
    # The forward kernel's persistent grid is one-dimensional: the same shapes run it.
    assert cuda.kernel_for("forward", config, *avals(batch, heads)) is not None


@needs_cutlass
@pytest.mark.parametrize("kind, capability, head_dim", KERNELS.values(), ids=KERNELS.keys())
@pytest.mark.parametrize("scale", [-0.125, 0.0])
def test_non_positive_scale_without_softcap_falls_back(monkeypatch, kind, capability, head_dim, scale):
    """The kernels' online softmax keeps the maximum of the unscaled logits and the backward rescales
    masked (-inf) logits: with scale < 0 the maximum never leaves -inf (LSE comes out -inf, P unbounded)
    and masked logits give +inf, with scale 0 they give NaN. So scale <= 0 takes the reference unless a
    softcap is set, which scales the logits before the softmax (whose scale is then log2 e)."""
    monkeypatch.setattr(cuda, "compute_capability", lambda: capability)
    monkeypatch.setattr(cuda, "_warned", set())
    avals = [jax.ShapeDtypeStruct((1, 8, 2, head_dim), jnp.bfloat16) for _ in range(3)]
    with pytest.warns(UserWarning, match=rf"kernel needs a positive scale unless a softcap is set \(got {scale}\)"):
        assert cuda.kernel_for(kind, AttentionConfig(scale=scale, causal=True), *avals) is None
    softcapped = AttentionConfig(scale=scale, causal=True, softcap=5.0)
    assert cuda.kernel_for(kind, softcapped, *avals) is not None


# Packed variable-length sequences (attention_varlen's config): which kernel runs each pass, or why
# none does. (capability, pass, head dim) -> the refusal, None where the sm90 kernel of that pass takes it.
PACKED_ROUTES = {
    "sm90-forward": ((9, 0), "forward", 128, None),
    "sm90-forward-d80": ((9, 0), "forward", 80, None),
    "sm90-forward-zero-padded-head-dim": ((9, 0), "forward", 72, None),
    "sm90-forward-d64": ((9, 0), "forward", 64, None),
    "sm90-backward": ((9, 0), "backward", 128, None),
    "sm90-backward-zero-padded-head-dim": ((9, 0), "backward", 80, None),   # 80 -> 96
    "sm90-backward-d64": ((9, 0), "backward", 64, None),
    "sm90-backward-d192": ((9, 0), "backward", 192, "sm90 large-head backward has no scheduler for packed"),
    "sm90-backward-large-heads": ((9, 0), "backward", 256, "has no scheduler for packed"),
    "sm90-tangent": ((9, 0), "tangent", 128, "sm90 tangent has no scheduler for packed"),
    "sm90-decode": ((9, 0), "decode", 128, "sm90 decode has no scheduler for packed"),
    "sm100-forward": ((10, 0), "forward", 128, "sm100 has no scheduler for packed"),
    "sm100-backward": ((10, 0), "backward", 128, "sm100 backward has no scheduler for packed"),
}


@needs_cutlass
@pytest.mark.parametrize("capability, kind, head_dim, refusal", PACKED_ROUTES.values(), ids=PACKED_ROUTES.keys())
def test_packed_sequences_run_the_sm90_forward_and_backward_kernels_and_nothing_else(monkeypatch, capability, kind,
                                                                                    head_dim, refusal):
    """The sm90 forward and the sm90 backward for head dims up to 128 schedule packed sequences
    (tests/test_sm90_varlen.py checks both against the oracle); every other kernel (the large-head
    backward for 192 / 256 included) refuses them, naming the packing, so attention_varlen's pass runs
    on the reference there (with the usual one-time warning) and implementation="cute" raises."""
    monkeypatch.setattr(cuda, "compute_capability", lambda: capability)
    monkeypatch.setattr(cuda, "_warned", set())
    config = AttentionConfig(scale=0.125, causal=True, has_sinks=True, has_cu_seqlens=True, implementation="cute")
    avals = [jax.ShapeDtypeStruct((1, 300, 4, head_dim), jnp.bfloat16),
             *[jax.ShapeDtypeStruct((1, 200, 2, head_dim), jnp.bfloat16)] * 2]
    if refusal is None:
        module, padding = cuda.choose_kernel(kind, config, host.Problem.of(*avals))
        assert module.__name__ == f"fa4_jax.kernels.sm90.{kind}"
        problem = host.Problem.of(*avals, {"cu_seqlens_q": jnp.zeros((8,), jnp.int32)})
        options = module.options(config, padding.kernel_problem(problem))
        assert options.packed and options.num_sequences == 7
        return
    with pytest.raises(NotImplementedError, match=refusal):
        cuda.kernel_for(kind, config, *avals)
    with pytest.warns(UserWarning, match="packed variable-length sequences"):
        assert cuda.kernel_for(kind, config.replace(implementation=None), *avals) is None


@needs_cutlass
@pytest.mark.skipif(jax.default_backend() == "gpu", reason="needs a host without a GPU")
def test_packed_backward_lowering_gives_the_kernel_the_sequence_count(monkeypatch):
    """The backward's CUDA lowering builds its `Problem` with the optional operands, so the sm90
    backward's options learn N from cu_seqlens (they refuse a packed call without it); exported for
    CUDA on this CPU host with the choice recorded and the reference lowered in its place."""
    from fa4_jax.kernels.sm90 import backward as sm90_backward

    chosen = []

    def record(pass_, config, problem):
        chosen.append((pass_, config, problem))

    monkeypatch.setattr(cuda, "choose_kernel", record)
    query = jax.ShapeDtypeStruct((300, 4, 128), jnp.bfloat16)
    key = jax.ShapeDtypeStruct((200, 2, 128), jnp.bfloat16)
    offsets = jax.ShapeDtypeStruct((6,), jnp.int32)

    def loss(q, k, v, cu_q, cu_k):
        return fa4_jax.attention_varlen(q, k, v, cu_q, cu_k, causal=True).astype(jnp.float32).sum()
    jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2))), platforms=["cuda"])(
        query, key, key, offsets, offsets)
    (_, config, problem), = [entry for entry in chosen if entry[0] == "backward"]
    assert problem.sequences == 5 and config.has_cu_seqlens
    options = sm90_backward.options(config, problem)
    assert options.packed and options.num_sequences == 5 and options.head_splits == 1
    assert not options.tuning.flat_dq and options.tuning.query_rows == 64
    with pytest.raises(ValueError, match="sequence count"):
        sm90_backward.options(config, dataclasses.replace(problem, sequences=None))
    for tuning, match in ((sm90_backward.Tuning(head_splits=2), "head_splits=1"),
                          (sm90_backward.Tuning(query_rows=128), "64 query rows")):
        with pytest.raises(ValueError, match=match):
            sm90_backward.options(config, problem, tuning)
    with pytest.raises(ValueError, match="flat_dq=False"):
        sm90_backward.Sm90BackwardKernel(dataclasses.replace(
            options, tuning=dataclasses.replace(options.tuning, flat_dq=True)))
    assert "does not combine packed sequences" in sm90_backward.unsupported_reason(
        config.replace(has_kv_seq_lengths=True), problem)


@needs_cutlass
def test_packed_forward_options_keep_rows_inside_their_sequence():
    """Packed sequences never take the TMA-store epilogue (it clips at the array's end, not the
    sequence's) nor the three-warpgroup set measured only with it; options that ask for it are
    refused, and so are packed sequences combined with per-batch lengths or segment ids."""
    from fa4_jax.kernels.sm90 import forward as sm90_forward

    packed = AttentionConfig(scale=0.125, has_cu_seqlens=True)
    for head_dim, causal in itertools.product((64, 128, 256), (False, True)):
        shape = (1, 4096, 2, head_dim)
        options = sm90_forward.options(packed.replace(causal=causal),
                                       host.Problem(shape, shape, shape, "bfloat16", sequences=9), sm_count=132)
        assert options.packed and not options.tma_store and options.consumer_warpgroups == 2
        options.check()
    with pytest.raises(ValueError, match="per-row predicated stores"):
        dataclasses.replace(options, tma_store=True).check()
    with pytest.raises(ValueError, match="sequence count"):
        sm90_forward.options(packed, host.Problem(shape, shape, shape, "bfloat16"))
    problem = host.Problem(shape, shape, shape, "bfloat16", sequences=9)
    for changes in (dict(has_kv_seq_lengths=True), dict(has_segment_ids=True)):
        assert "does not combine packed sequences" in sm90_forward.unsupported_reason(packed.replace(**changes), problem)


@needs_cutlass
def test_forward_tile_order_and_mla_blocks_by_call():
    """The causal forward walks mirrored units (no zigzag beside them); packed causal and non-causal calls
    keep their orders. MLA's 192/128 takes 128-key blocks with the store in two chunks, except packed
    (its GPU tests ran with D = 192's 96-key blocks only)."""
    from fa4_jax.kernels.sm90 import forward as sm90_forward

    query = (2, 2048, 8, 192)
    value = (2, 2048, 8, 128)
    for causal in (False, True):
        config = AttentionConfig(scale=0.125, causal=causal)
        options = sm90_forward.options(config, host.Problem(query, query, value, "bfloat16"), sm_count=132)
        assert options.mirrored_tiles == causal and not options.zigzag_tiles
        assert (options.tile_n, options.store_chunks) == (128, 2)
        plain = sm90_forward.options(config, host.Problem(query, query, query, "bfloat16"), sm_count=132)
        assert plain.tile_n == 96 and plain.mirrored_tiles == causal
        old_order = sm90_forward.options(config, host.Problem(query, query, query, "bfloat16"), sm_count=132,
                                         mirrored_tiles=False)
        assert not old_order.mirrored_tiles and old_order.zigzag_tiles == causal
    packed_query, packed_value = (1, 4096, 8, 192), (1, 4096, 8, 128)
    packed = sm90_forward.options(AttentionConfig(scale=0.125, causal=True, has_cu_seqlens=True),
                                  host.Problem(packed_query, packed_query, packed_value, "bfloat16", sequences=5),
                                  sm_count=132)
    assert not packed.mirrored_tiles and packed.tile_n == 96
    with pytest.raises(ValueError, match="mirrored_tiles"):
        dataclasses.replace(packed, mirrored_tiles=True).check()


@needs_cutlass
def test_sm100_forward_takes_mirrored_units_where_the_query_blocks_pair_up():
    """The sm100 forward walks mirrored units when causal with an even query-block count (256 rows a CTA
    at D = 128: 1024 rows pair up, 1000 -> 4 blocks too, 1300 -> 6, 1100 -> 5 does not), so no role has an
    empty tile to skip; otherwise the longest-first order."""
    from fa4_jax.kernels.sm100 import forward as sm100_forward

    for q_len, causal, mirrored in ((1024, True, True), (1000, True, True), (1300, True, True), (1100, True, False),
                                    (1024, False, False)):
        shape = (2, q_len, 8, 128)
        options = sm100_forward.options(AttentionConfig(scale=0.125, causal=causal),
                                        host.Problem(shape, shape, shape, "bfloat16"), sm_count=148)
        assert options.mirrored_tiles == mirrored, (q_len, causal)


@needs_cutlass
def test_tangent_kernel_takes_mirrored_units_where_the_query_blocks_pair_up():
    """The sm90 tangent (jvp) kernel, 128 rows a block: mirrored units when causal with an even block
    count (1024 -> 8, 1000 -> 8), the longest-first order otherwise (1100 -> 9) and never when not causal."""
    from fa4_jax.kernels.sm90 import tangent

    for q_len, causal, mirrored in ((1024, True, True), (1000, True, True), (1100, True, False), (1024, False, False)):
        shape = (2, q_len, 8, 128)
        options = tangent.options(AttentionConfig(scale=0.125, causal=causal),
                                  host.Problem(shape, shape, shape, "bfloat16"), sm_count=132)
        assert options.mirrored_tiles == mirrored, (q_len, causal)
