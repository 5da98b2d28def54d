"""CUDA lowering: the one routing table from (compute capability, pass, head dim) to a CuTe kernel
module, whose `unsupported_reason` decides the rest, or the reference where none fits.

Head dims: the forward, backward and tangent take any head dim <= 256 and any value head dim <= 256
whose (D, Dv) some route's kernel holds once zero-padded (`fa4_jax/lowering/head_padding.py`: the
padding is exact, costs (D' + Dv') / (D + Dv) more FLOPs and a padded copy of each operand, and stays
inside this lowering, so residuals keep the call's dims). Each pass is planned on its own routes: e.g.
on sm_90, D = 80 runs its own forward kernel, the D = 96 backward and the D = 128 tangent (72 the same
three, its forward padded to 80), 112 the 128 ones, 160 the 192 ones; MLA's 192/128 runs the forward
and the backward unpadded (the sm90 forward's and large-head backward's extra pair) and the tangent not
at all; on sm_100 D = 80 runs the 96 forward and backward. Decode is not padded.

`implementation=None` falls back to the reference with a one-time warning that says why;
`implementation="cute"` raises instead, naming what the kernel cannot take.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import warnings

import jax
import jax.numpy as jnp
from jax.interpreters import mlir

from fa4_jax.config import AttentionConfig
from fa4_jax.kernels import host
from fa4_jax.lowering import head_padding, reference
from fa4_jax.primitive import (attention_bwd_inner_p, attention_fwd_inner_p, attention_tangent_inner_p,
                               split_backward_operands, split_tangent_operands)


@dataclasses.dataclass(frozen=True)
class Route:
    """One row of the routing table: the kernel module that runs `pass_` ("forward", "backward",
    "tangent", "decode") for head dims `head_dims` on GPUs of compute capability `capability`.x. The module answers the rest
    (dtypes, features, grid limits) through its `unsupported_reason(config, problem)`. Its kernels
    take the value head dim equal to the head dim, and the (head dim, value head dim) pairs in
    `extra_pairs` (the module's EXTRA_HEAD_DIM_PAIRS); other calls reach them zero-padded."""

    capability: int
    pass_: str
    head_dims: tuple
    module: str
    extra_pairs: tuple = ()

    def head_dim_pairs(self) -> tuple:
        """The (head dim, value head dim) pairs its kernel takes."""
        return tuple((head_dim, head_dim) for head_dim in self.head_dims) + tuple(self.extra_pairs)


# Every kernel there is, and what selects it. A call no row matches runs the reference (with the reason).
ROUTES = (
    # DeepSeek MLA's 192/128 unpadded, forward and backward; the tangent has no such pair. D = 80 has
    # a forward of its own on sm_90 only (its backward pads to 96).
    Route(9, "forward", (64, 80, 96, 128, 192, 256), "fa4_jax.kernels.sm90.forward", extra_pairs=((192, 128),)),
    Route(9, "backward", (64, 96, 128), "fa4_jax.kernels.sm90.backward"),
    Route(9, "backward", (192, 256), "fa4_jax.kernels.sm90.backward_large_heads", extra_pairs=((192, 128),)),
    # Forward-mode AD's tangent (jax.jvp / linearize / jacfwd), from the forward's saved O and LSE.
    Route(9, "tangent", (64, 128), "fa4_jax.kernels.sm90.tangent"),
    Route(10, "forward", (64, 96, 128, 192, 256), "fa4_jax.kernels.sm100.forward"),
    Route(10, "backward", (64, 96, 128), "fa4_jax.kernels.sm100.backward"),
    # Paged / short-query decode: mma.sync + cp.async only, the same code on sm_90 and sm_100.
    Route(9, "decode", (64, 128, 256), "fa4_jax.kernels.sm90.decode"),
    Route(10, "decode", (64, 128, 256), "fa4_jax.kernels.sm90.decode"),
)

_warned: set[str] = set()


def compute_capability() -> tuple[int, int] | None:
    """The local GPU's compute capability, or None when lowering for CUDA on a host without one
    (e.g. `jax.export` for platforms=["cuda"] on a CPU machine): no kernel can be chosen then."""
    try:
        device = jax.local_devices(backend="gpu")[0]
    except RuntimeError:
        return None
    major, minor = device.compute_capability.split(".")
    return int(major), int(minor)


def _describe_head_dims(problem: host.Problem) -> str:
    if problem.v_head_dim == problem.head_dim:
        return str(problem.head_dim)
    return f"{problem.head_dim} with value head dim {problem.v_head_dim}"


def route_for(pass_: str, capability, problem: host.Problem):
    """(the route for this call on a GPU of `capability` (major, minor), its HeadPadding, None) or
    (None, None, why no route takes it): the table alone, before any kernel module is asked."""
    if capability is None:
        return None, None, "no GPU is visible while lowering for CUDA, so no kernel can be compiled for it"
    major, minor = capability
    for_pass = [route for route in ROUTES if route.pass_ == pass_]
    for_gpu = [route for route in for_pass if route.capability == major]
    if not for_gpu:
        covered = ", ".join(f"{c}.x" for c in sorted({route.capability for route in for_pass}))
        return None, None, (f"there is no CuTe {pass_} kernel for compute capability {major}.{minor} ({pass_} "
                            f"kernels exist for compute capability {covered} only)")
    head_dims = tuple(sorted({d for route in for_gpu for d in route.head_dims}))
    if pass_ in head_padding.PADDED_PASSES:
        pairs = [pair for route in for_gpu for pair in route.head_dim_pairs()]
        padding = head_padding.plan(problem.head_dim, problem.v_head_dim, pairs)
        if padding is not None:
            kernel_pair = (padding.kernel_head_dim, padding.kernel_v_head_dim)
            route = next(route for route in for_gpu if kernel_pair in route.head_dim_pairs())
            return route, padding, None
        return None, None, (f"the {pass_} kernels for compute capability {major}.x take head dims up to "
                            f"{head_dims[-1]} (smaller ones zero-padded to one of {head_dims}), not "
                            f"{_describe_head_dims(problem)}")
    for route in for_gpu:
        if problem.head_dim in route.head_dims:
            return route, head_padding.identity(problem), None
    return None, None, (f"the {pass_} kernels for compute capability {major}.x take head dims {head_dims}, "
                        f"not {problem.head_dim}")


def _module_or_reason(pass_: str, config: AttentionConfig, problem: host.Problem):
    """(the kernel module that takes this call, its HeadPadding, None) or (None, None, why none does)."""
    route, padding, reason = route_for(pass_, compute_capability(), problem)
    if route is None:
        return None, None, reason
    try:
        module = importlib.import_module(route.module)
    except ImportError as error:
        return None, None, f"the {pass_} kernel module {route.module} is not available ({error})"
    reason = module.unsupported_reason(config, padding.kernel_problem(problem))
    return (module, padding, None) if reason is None else (None, None, reason)


def kernel_for(pass_: str, config: AttentionConfig, query, key, value):
    """The kernel module to run, or None for the reference (after warning or raising as configured)."""
    return kernel_for_problem(pass_, config, host.Problem.of(query, key, value))


def kernel_for_problem(pass_: str, config: AttentionConfig, problem: host.Problem):
    """`kernel_for` of a `Problem` (the paged decode describes its cache by one)."""
    chosen = choose_kernel(pass_, config, problem)
    return None if chosen is None else chosen[0]


def choose_kernel(pass_: str, config: AttentionConfig, problem: host.Problem):
    """(kernel module, HeadPadding to its head dims) for this call, or None for the reference (after
    warning or raising as configured)."""
    if config.implementation == "reference":
        return None
    module, padding, reason = _module_or_reason(pass_, config, problem)
    if module is not None:
        return module, padding
    if config.implementation == "cute":
        raise NotImplementedError(
            f"implementation='cute' cannot run this attention {pass_} pass: {reason}. Change that option, or use "
            "implementation=None to fall back to the (slower) reference path.")
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"fa4_jax: attention {pass_} runs on the XLA reference path because {reason}.",
                      stacklevel=2)
    return None


def decode_module_for_attention(config: AttentionConfig, problem: host.Problem):
    """The decode kernel module when it takes this `attention` forward (a short query against a cache
    with key lengths: the contiguous form of `paged_attention`, one page per sequence), else None."""
    if config.implementation == "reference" or not config.has_kv_seq_lengths:
        return None
    module, _, _ = _module_or_reason("decode", config, problem)
    return module


def _forward_rule(ctx, *operands, config: AttentionConfig):
    query, key, value, optional = config.split_operands(ctx.avals_in)
    problem = host.Problem.of(query, key, value, optional)
    decode = decode_module_for_attention(config, problem)
    if decode is not None:
        decode_options = decode.options(config, problem)

        def decode_kernel(*arrays, config):
            q, k, v, optional = config.split_operands(arrays)
            tables = jnp.arange(q.shape[0], dtype=jnp.int32)[:, None]
            return decode.run(decode_options, q, k, v, tables, optional["kv_seq_lengths"], optional.get("sinks"))
        return mlir.lower_fun(decode_kernel, multiple_results=True)(ctx, *operands, config=config)
    chosen = choose_kernel("forward", config, problem)
    if chosen is None:
        return mlir.lower_fun(reference.forward, multiple_results=True)(ctx, *operands, config=config)
    module, padding = chosen
    run_kernel = functools.partial(module.run, module.options(config, padding.kernel_problem(problem)))

    def kernel(*arrays, config):
        q, k, v, optional = config.split_operands(arrays)
        return padding.forward(run_kernel, q, k, v, optional)
    return mlir.lower_fun(kernel, multiple_results=True)(ctx, *operands, config=config)


def _backward_rule(ctx, *operands, config: AttentionConfig, has_d_lse: bool):
    (query, key, value, *_), _, optional = split_backward_operands(config, has_d_lse, ctx.avals_in)
    problem = host.Problem.of(query, key, value, optional)
    chosen = choose_kernel("backward", config, problem)
    if chosen is None:
        return mlir.lower_fun(reference.backward, multiple_results=True)(
            ctx, *operands, config=config, has_d_lse=has_d_lse)
    module, padding = chosen
    run_kernel = functools.partial(module.run, module.options(config, padding.kernel_problem(problem)))

    def kernel(*arrays, config, has_d_lse):
        (q, k, v, out, lse, d_out), d_lse, optional = split_backward_operands(config, has_d_lse, arrays)
        d_q, d_k, d_v, d_sinks = padding.backward(run_kernel, q, k, v, out, lse, d_out, d_lse, optional)
        return (d_q, d_k, d_v) + ((d_sinks,) if config.has_sinks else ())
    return mlir.lower_fun(kernel, multiple_results=True)(ctx, *operands, config=config, has_d_lse=has_d_lse)


mlir.register_lowering(attention_fwd_inner_p, _forward_rule, platform="cuda")
mlir.register_lowering(attention_bwd_inner_p, _backward_rule, platform="cuda")


def _tangent_rule(ctx, *operands, config: AttentionConfig):
    """The forward-mode tangent: the sm90 tangent kernel where it takes the call, else the blocked
    reference (after the usual warning, or the refusal under "cute")."""
    query, key, value, *_ = ctx.avals_in
    problem = host.Problem.of(query, key, value)
    chosen = choose_kernel("tangent", config, problem)
    if chosen is None:
        return mlir.lower_fun(reference.tangent, multiple_results=True)(ctx, *operands, config=config)
    module, padding = chosen
    run_kernel = functools.partial(module.run, module.options(config, padding.kernel_problem(problem)))

    def kernel(*arrays, config):
        (q, k, v, out, lse), (t_q, t_k, t_v, t_sinks), optional = split_tangent_operands(config, arrays)
        return padding.tangent(run_kernel, q, k, v, out, lse, t_q, t_k, t_v, t_sinks, optional)
    return mlir.lower_fun(kernel, multiple_results=True)(ctx, *operands, config=config)


mlir.register_lowering(attention_tangent_inner_p, _tangent_rule, platform="cuda")
