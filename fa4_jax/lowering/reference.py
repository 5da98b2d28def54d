"""Lowering of the inner primitives to the pure-JAX reference: the rule for every platform without a
kernel (CPU, TPU, ...), and the path the CUDA rule falls back to (the forward-mode tangent's kernel
is sm90 only: elsewhere its inner primitive lowers to `reference_tangent`)."""

from __future__ import annotations

from jax.interpreters import mlir

from fa4_jax.config import AttentionConfig
from fa4_jax.reference import reference_backward, reference_forward, reference_tangent
from fa4_jax.primitive import (attention_bwd_inner_p, attention_fwd_inner_p, attention_tangent_inner_p,
                               split_backward_operands, split_tangent_operands)


def forward(*operands, config: AttentionConfig):
    query, key, value, optional = config.split_operands(operands)
    return reference_forward(query, key, value, optional, config)


def backward(*operands, config: AttentionConfig, has_d_lse: bool):
    (query, key, value, out, lse, d_out), d_lse, optional = split_backward_operands(config, has_d_lse, operands)
    d_query, d_key, d_value, d_sinks = reference_backward(
        query, key, value, out, lse, d_out, d_lse, optional, config)
    return (d_query, d_key, d_value) + ((d_sinks,) if config.has_sinks else ())


def tangent(*operands, config: AttentionConfig):
    (query, key, value, out, lse), (t_query, t_key, t_value, t_sinks), optional = split_tangent_operands(
        config, operands)
    return reference_tangent(query, key, value, out, lse, t_query, t_key, t_value, t_sinks, optional, config)


def _refuse_cute(platform_rule):
    """implementation="cute" asks for our GPU kernels: on a platform without them, say so."""
    def rule(ctx, *operands, config, **params):
        if config.implementation == "cute":
            platforms = ", ".join(ctx.module_context.platforms)
            raise NotImplementedError(
                f"implementation='cute' needs an NVIDIA GPU (sm_90 Hopper or sm_100 Blackwell), but this "
                f"computation is lowered for {platforms}. Use implementation=None (the fastest available path) "
                "or implementation='reference'.")
        return platform_rule(ctx, *operands, config=config, **params)
    return rule


mlir.register_lowering(attention_fwd_inner_p, _refuse_cute(mlir.lower_fun(forward, multiple_results=True)))
mlir.register_lowering(attention_bwd_inner_p, _refuse_cute(mlir.lower_fun(backward, multiple_results=True)))
mlir.register_lowering(attention_tangent_inner_p, _refuse_cute(mlir.lower_fun(tangent, multiple_results=True)))
