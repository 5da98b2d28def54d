"""CUDA lowering: the CuTe kernel for the GPU's compute capability, or the reference where none fits.

`implementation=None` falls back to the reference with a one-time warning that says why;
`implementation="cute"` raises instead, naming what the kernel cannot take.
"""

from __future__ import annotations

import importlib
import warnings

import jax
from jax.interpreters import mlir

from fa4_jax.config import AttentionConfig
from fa4_jax.lowering import reference
from fa4_jax.primitive import attention_bwd_inner_p, attention_fwd_inner_p, split_backward_operands

# Kernel modules by compute-capability major version. Each has `unsupported_reason(...)` and
# `attention_forward(...)` (forward) or `attention_backward(...)` (backward).
FORWARD_KERNELS = {9: "fa4_jax.kernels.sm90_forward", 10: "fa4_jax.kernels.sm100_forward"}
BACKWARD_KERNELS = {9: "fa4_jax.kernels.sm90_backward"}

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


def _kernel_for(kind: str, table: dict, config: AttentionConfig, query, key, value):
    """The kernel module to run, or None for the reference (after warning or raising as configured)."""
    if config.implementation == "reference":
        return None
    capability = compute_capability()
    major, minor = capability or (None, None)
    name = table.get(major)
    module, reason = None, None
    if capability is None:
        reason = "no GPU is visible while lowering for CUDA, so no kernel can be compiled for it"
    elif name is None:
        covered = ", ".join(f"{table_major}.x" for table_major in sorted(table))
        reason = (f"there is no CuTe {kind} kernel for compute capability {major}.{minor} ({kind} kernels exist "
                  f"for compute capability {covered} only)")
    else:
        try:
            module = importlib.import_module(name)
        except ImportError as error:
            reason = f"the {kind} kernel module {name} is not available ({error})"
    if module is not None:
        reason = module.unsupported_reason(config, query.shape, key.shape, value.shape, query.dtype)
        if reason is None:
            return module
    if config.implementation == "cute":
        raise NotImplementedError(
            f"implementation='cute' cannot run this attention {kind} pass: {reason}. Change that option, or use "
            "implementation=None to fall back to the (slower) reference path.")
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"fa4_jax: attention {kind} runs on the XLA reference path because {reason}.",
                      stacklevel=2)
    return None


def _forward_rule(ctx, *operands, config: AttentionConfig):
    query, key, value, _ = config.split_operands(ctx.avals_in)
    module = _kernel_for("forward", FORWARD_KERNELS, config, query, key, value)
    if module is None:
        return mlir.lower_fun(reference.forward, multiple_results=True)(ctx, *operands, config=config)

    def kernel(*arrays, config):
        q, k, v, optional = config.split_operands(arrays)
        return module.attention_forward(q, k, v, optional, config)
    return mlir.lower_fun(kernel, multiple_results=True)(ctx, *operands, config=config)


def _backward_rule(ctx, *operands, config: AttentionConfig, has_d_lse: bool):
    query, key, value, *_ = ctx.avals_in
    module = _kernel_for("backward", BACKWARD_KERNELS, config, query, key, value)
    if module is None:
        return mlir.lower_fun(reference.backward, multiple_results=True)(
            ctx, *operands, config=config, has_d_lse=has_d_lse)

    def kernel(*arrays, config, has_d_lse):
        (q, k, v, out, lse, d_out), d_lse, optional = split_backward_operands(config, has_d_lse, arrays)
        d_q, d_k, d_v, d_sinks = module.attention_backward(q, k, v, out, lse, d_out, d_lse, optional, config)
        return (d_q, d_k, d_v) + ((d_sinks,) if config.has_sinks else ())
    return mlir.lower_fun(kernel, multiple_results=True)(ctx, *operands, config=config, has_d_lse=has_d_lse)


mlir.register_lowering(attention_fwd_inner_p, _forward_rule, platform="cuda")
mlir.register_lowering(attention_bwd_inner_p, _backward_rule, platform="cuda")
