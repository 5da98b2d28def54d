"""The attention primitives: abstract evaluation, batching, and the autodiff rules that tie them together.

Two layers, as in TransformerEngine's JAX extension:
- outer primitives (`attention_fwd_p`, `attention_bwd_p`, `attention_tangent_p`) carry the logical
  operation. They validate in abstract evaluation and have batching rules, so `vmap`, `grad`,
  `jvp` and `jacobian` never see sharding. `fa4_jax/sharding.py` lowers them through
  `custom_partitioning`, or inside shard_map with `context_parallel_axis` through the sequence split
  of `fa4_jax/context_parallel.py`.
- autodiff is JAX's own, as for its primitives: the forward has a JVP rule whose tangent is
  `attention_tangent_p`, linear in the tangents of query, key, value and sinks, and that primitive's
  transpose rule is the backward primitive. So forward mode (`jvp`, `linearize`, `jacfwd`) and reverse
  mode (`grad`, `vjp`, which JAX derives by transposing the linearized tangent) share one definition.
- inner primitives (`attention_fwd_inner_p`, `attention_bwd_inner_p`, `attention_tangent_inner_p`) are
  what each device runs on its shard; `fa4_jax/lowering/` lowers them per platform (CuTe kernels on
  CUDA, the reference elsewhere; the tangent's kernel is sm90 only, D in {64, 128}).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.extend.core import Primitive
from jax.interpreters import ad, batching
from jax.sharding import NamedSharding, PartitionSpec

from fa4_jax import context_parallel
from fa4_jax.config import AttentionConfig
from fa4_jax.reference import reference_backward, reference_forward, reference_tangent
from fa4_jax.validation import validate_operands

attention_fwd_p = Primitive("fa4_attention_fwd")
attention_bwd_p = Primitive("fa4_attention_bwd")
attention_tangent_p = Primitive("fa4_attention_tangent")
attention_fwd_inner_p = Primitive("fa4_attention_fwd_inner")
attention_bwd_inner_p = Primitive("fa4_attention_bwd_inner")
attention_tangent_inner_p = Primitive("fa4_attention_tangent_inner")
_ALL = (attention_fwd_p, attention_bwd_p, attention_tangent_p, attention_fwd_inner_p, attention_bwd_inner_p,
        attention_tangent_inner_p)
for _p in _ALL:
    _p.multiple_results = True

# Residual names, for remat policies such as jax.checkpoint_policies.save_only_these_names(...).
RESIDUAL_NAMES = ("fa4_query", "fa4_key", "fa4_value", "fa4_out", "fa4_lse")


# Each primitive's operands (and the backward's results) by name, in order: the one place the batching
# and sharding rules read them from.

def forward_operand_names(config: AttentionConfig) -> tuple[str, ...]:
    return ("query", "key", "value") + config.present_operands()


def gradient_names(config: AttentionConfig) -> tuple[str, ...]:
    """The backward's results, each named by the operand it is the gradient of."""
    return ("query", "key", "value") + (("sinks",) if config.has_sinks else ())


def backward_operand_names(config: AttentionConfig, has_d_lse: bool) -> tuple[str, ...]:
    base = ("query", "key", "value", "out", "lse", "d_out") + (("d_lse",) if has_d_lse else ())
    return base + config.present_operands()


def split_backward_operands(config: AttentionConfig, has_d_lse: bool, operands):
    named = dict(zip(backward_operand_names(config, has_d_lse), operands))
    tensors = [named.pop(n) for n in ("query", "key", "value", "out", "lse", "d_out")]
    d_lse = named.pop("d_lse", None)
    return tensors, d_lse, named


_TANGENTS = ("t_query", "t_key", "t_value")


def tangent_operand_names(config: AttentionConfig) -> tuple[str, ...]:
    """The tangent primitive's operands: the forward's residuals, the (linear) tangents, the rest."""
    tangents = _TANGENTS + (("t_sinks",) if config.has_sinks else ())
    return ("query", "key", "value", "out", "lse") + tangents + config.present_operands()


def split_tangent_operands(config: AttentionConfig, operands):
    """-> ([query, key, value, out, lse], [t_query, t_key, t_value, t_sinks or None], optional)."""
    named = dict(zip(tangent_operand_names(config), operands))
    residuals = [named.pop(n) for n in ("query", "key", "value", "out", "lse")]
    tangents = [named.pop(n) for n in _TANGENTS] + [named.pop("t_sinks", None)]
    return residuals, tangents, named


# ----------------------------------------------------------------------------------------- abstract eval

def _derived_aval(like, shape, dtype, spec_from):
    """An aval of `shape`/`dtype` that keeps `like`'s mesh and varying manual axes (so autodiff works
    inside shard_map); spec_from[i] names the axis of `like` whose sharding result axis i takes."""
    sharding = getattr(like, "sharding", None)
    if not isinstance(sharding, NamedSharding):
        return jax.core.ShapedArray(shape, dtype)
    spec = tuple(sharding.spec) + (None,) * (like.ndim - len(sharding.spec))
    new_spec = PartitionSpec(*(None if axis is None else spec[axis] for axis in spec_from))
    return like.update(shape=shape, dtype=dtype, sharding=sharding.update(spec=new_spec))


def _forward_abstract_eval(*operands, config: AttentionConfig):
    query, key, value, optional = config.split_operands(operands)
    validate_operands(config, query, key, value, optional)
    batch, q_len, q_heads, _ = query.shape
    v_head_dim = value.shape[-1]
    out = _derived_aval(query, (batch, q_len, q_heads, v_head_dim), query.dtype, (0, 1, 2, None))
    lse = _derived_aval(query, (batch, q_heads, q_len), jnp.float32, (0, 2, 1))
    return out, lse


def _backward_abstract_eval(*operands, config: AttentionConfig, has_d_lse: bool):
    (query, key, value, *_), _, optional = split_backward_operands(config, has_d_lse, operands)
    grads = [_derived_aval(x, x.shape, x.dtype, range(x.ndim)) for x in (query, key, value)]
    if config.has_sinks:
        sinks = optional["sinks"]
        grads.append(_derived_aval(sinks, sinks.shape, sinks.dtype, (0,)))
    return tuple(grads)


def _tangent_abstract_eval(*operands, config: AttentionConfig):
    (query, key, value, *_), _, optional = split_tangent_operands(config, operands)
    return _forward_abstract_eval(*config.join_operands(query, key, value, optional), config=config)


for _p in (attention_tangent_p, attention_tangent_inner_p):
    _p.def_abstract_eval(_tangent_abstract_eval)
for _p in (attention_fwd_p, attention_fwd_inner_p):
    _p.def_abstract_eval(_forward_abstract_eval)
for _p in (attention_bwd_p, attention_bwd_inner_p):
    _p.def_abstract_eval(_backward_abstract_eval)


@functools.lru_cache(maxsize=None)
def _jitted_bind(primitive, params: tuple):
    return jax.jit(functools.partial(primitive.bind, **dict(params)))


def eager_impl(primitive):
    """The impl rule of a primitive without an op-by-op implementation (ours, and fa4_jax.paged's):
    eager calls run it under jit, one jitted function per parameter set so that repeated calls reuse
    the compiled computation. That holds under jax.disable_jit() too, where the jitted function would
    otherwise call this again, forever."""
    def impl(*operands, **params):
        with jax.disable_jit(False):
            return _jitted_bind(primitive, tuple(sorted(params.items())))(*operands)
    return impl


for _p in _ALL:
    _p.def_impl(eager_impl(_p))


# ---------------------------------------------------------------------------------------------- batching
# A vmapped axis is folded into the batch axis or, when a per-head operand is vmapped or a per-head
# result comes out (the sinks' gradient, summed over the batch), into the head axis; both keep each
# element independent (unvmapped sinks are shared by every batch element anyway). When a per-batch
# operand is vmapped as well, neither fold is exact and the elements run one after another (lax.map).

_NOT_MAPPED = None  # how JAX marks an operand without a vmapped axis

_BATCH_AXIS = {"query": 0, "key": 0, "value": 0, "out": 0, "lse": 0, "d_out": 0, "d_lse": 0,
               "t_query": 0, "t_key": 0, "t_value": 0,
               "q_segment_ids": 0, "kv_segment_ids": 0, "q_seq_lengths": 0, "kv_seq_lengths": 0,
               "sinks": None, "t_sinks": None, "q_start": None, "kv_start": None}
_HEAD_AXIS = {"query": 2, "key": 2, "value": 2, "out": 2, "d_out": 2, "lse": 1, "d_lse": 1, "sinks": 0,
              "t_query": 2, "t_key": 2, "t_value": 2, "t_sinks": 0}
# Operands whose head axis holds query heads, grouped per KV head (the others hold the KV heads).
_QUERY_HEADS = {"query", "out", "d_out", "lse", "d_lse", "sinks", "t_query", "t_sinks"}


def _type_shards(x, batch_dim, axis) -> bool:
    """Whether x's type shards its (unbatched) axis `axis`; only Explicit mesh axes are in the type."""
    if batch_dim is not _NOT_MAPPED and batch_dim <= axis:
        axis += 1
    spec = jax.typeof(x).sharding.spec
    return axis < len(spec) and spec[axis] is not None


def _fold(x, batch_dim, axis, size, group, vmapped_major):
    """Merge the vmapped axis (broadcast when x has none) into the unbatched axis `axis` of length A.

    vmapped_major: element e's index a becomes e * A + a. Otherwise, writing a = g * group + i, it
    becomes (g * size + e) * group + i: a device's block of `axis` stays in one piece, the only reshape
    Explicit sharding allows there. `group` is the query heads per KV head on query-head axes (so query
    head (g, e, i) still reads KV head (g, e)), 1 elsewhere.
    """
    x = jnp.expand_dims(x, 0) if batch_dim is _NOT_MAPPED else jnp.moveaxis(x, batch_dim, 0)
    before, length, after = x.shape[1:axis + 1], x.shape[axis + 1], x.shape[axis + 2:]
    if vmapped_major:
        x = jnp.broadcast_to(jnp.moveaxis(x, 0, axis), before + (size, length) + after)
    else:
        x = x.reshape(x.shape[:1] + before + (length // group, group) + after)
        x = jnp.broadcast_to(jnp.moveaxis(x, 0, axis + 1), before + (length // group, size, group) + after)
    return x.reshape(before + (size * length,) + after)


def _unfold(x, axis, size, group, vmapped_major):
    """Inverse of `_fold`: (array, the axis that now holds the vmapped elements)."""
    before, length, after = x.shape[:axis], x.shape[axis] // size, x.shape[axis + 1:]
    if vmapped_major:
        return x.reshape(before + (size, length) + after), axis
    x = jnp.moveaxis(x.reshape(before + (length // group, size, group) + after), axis + 1, 0)
    return x.reshape((size,) + before + (length,) + after), 0


def _batch_rule(primitive, operand_names, result_names, operands, batch_dims, **params):
    size = next(x.shape[d] for x, d in zip(operands, batch_dims) if d is not _NOT_MAPPED)
    mapped = {n for n, d in zip(operand_names, batch_dims) if d is not _NOT_MAPPED}
    per_head = {n for n in mapped | set(result_names) if _BATCH_AXIS.get(n, 0) is None}
    per_batch_only = {n for n in operand_names if n not in _HEAD_AXIS}
    if not per_head:
        axes = _BATCH_AXIS
    elif not (mapped & per_batch_only):
        axes = _HEAD_AXIS
    else:
        def one(mapped_slices):
            slices = iter(mapped_slices)
            return primitive.bind(*[x if d is _NOT_MAPPED else next(slices)
                                    for x, d in zip(operands, batch_dims)], **params)
        results = jax.lax.map(one, [jnp.moveaxis(x, d, 0) for x, d in zip(operands, batch_dims)
                                    if d is not _NOT_MAPPED])
        return results, (0,) * len(results)
    shapes = {n: tuple(dim for i, dim in enumerate(x.shape) if i != d)
              for x, d, n in zip(operands, batch_dims, operand_names)}
    query_group = shapes["query"][2] // shapes["key"][2] if axes is _HEAD_AXIS else 1
    group = lambda name: query_group if name in _QUERY_HEADS else 1
    # Fold the vmapped index major (as it comes) unless an Explicit sharding splits the folded axis.
    vmapped_major = not any(axes.get(n) is not None and _type_shards(x, d, axes[n])
                            for x, d, n in zip(operands, batch_dims, operand_names))
    folded = [x if axes.get(n) is None and d is _NOT_MAPPED
              else _fold(x, d, axes[n], size, group(n), vmapped_major)
              for x, d, n in zip(operands, batch_dims, operand_names)]
    results = primitive.bind(*folded, **params)
    unfolded = [_unfold(r, axes[n], size, group(n), vmapped_major) for r, n in zip(results, result_names)]
    return [r for r, _ in unfolded], tuple(d for _, d in unfolded)


def _forward_batch_rule(operands, batch_dims, *, config):
    return _batch_rule(attention_fwd_p, forward_operand_names(config), ("out", "lse"), operands, batch_dims,
                       config=config)


def _backward_batch_rule(operands, batch_dims, *, config, has_d_lse):
    return _batch_rule(attention_bwd_p, backward_operand_names(config, has_d_lse), gradient_names(config),
                       operands, batch_dims, config=config, has_d_lse=has_d_lse)


def _tangent_batch_rule(operands, batch_dims, *, config):
    return _batch_rule(attention_tangent_p, tangent_operand_names(config), ("out", "lse"), operands, batch_dims,
                       config=config)


# ------------------------------------------------------------------ the sequence split over named axes
# With context_parallel_axis the operands are a shard's slices of the sequence, split over named axes:
# shard_map's mesh axes (or pmap's), where the outer primitives' lowering runs the split
# (fa4_jax/sharding.py), or a vmap's axis name standing in for a mesh axis, where the batching rule must
# run it, since the named axis is gone by the time anything lowers. Each piece binds an outer primitive
# again, with a config that has no split left.

def _named_split(config: AttentionConfig, operands) -> context_parallel.SequenceSplit:
    return context_parallel.manual_split(config, operands[0], operands[1], forward_p=attention_fwd_p,
                                         backward_p=attention_bwd_p, tangent_p=attention_tangent_p)


def split_forward(operands, *, config: AttentionConfig):
    return list(context_parallel.forward(config, operands, _named_split(config, operands)))


def split_backward(operands, *, config: AttentionConfig, has_d_lse: bool):
    return list(context_parallel.backward(config, has_d_lse, operands, _named_split(config, operands),
                                          split_backward_operands))


def split_tangent(operands, *, config: AttentionConfig):
    return list(context_parallel.tangent(config, operands, _named_split(config, operands), split_tangent_operands))


def _batcher(primitive, batch_rule, split_function):
    """The batching rule, except for a vmap whose axis name is in context_parallel_axis: the split runs
    there, under a vmap of that name and size, so that its collectives move data between the vmapped
    shards (each piece's outer primitive then batches by `batch_rule`)."""
    def rule(axis_data, operands, batch_dims, **params):
        if params["config"].has_cu_seqlens and any(d is not _NOT_MAPPED for d in batch_dims):
            raise ValueError(
                "fa4_jax.attention_varlen cannot be vmapped (nor used under jax.jacrev / jax.jacobian, which "
                "vmap it): its batch is already the packing. Concatenate the batches' tokens into one packing "
                "and offset their cu_seqlens instead, or call fa4_jax.attention with batched arrays.")
        axes = params["config"].context_parallel_axis
        if axes and axis_data.name in axes:
            results = jax.vmap(functools.partial(split_function, **params), in_axes=(list(batch_dims),),
                               axis_name=axis_data.name, axis_size=axis_data.size,
                               spmd_axis_name=axis_data.spmd_name)(list(operands))
            return results, [0] * len(results)
        if all(d is _NOT_MAPPED for d in batch_dims):
            results = primitive.bind(*operands, **params)
            return results, [_NOT_MAPPED] * len(results)
        return batch_rule(operands, batch_dims, **params)
    return rule


batching.fancy_primitive_batchers[attention_fwd_p] = _batcher(attention_fwd_p, _forward_batch_rule, split_forward)
batching.fancy_primitive_batchers[attention_bwd_p] = _batcher(attention_bwd_p, _backward_batch_rule, split_backward)
batching.fancy_primitive_batchers[attention_tangent_p] = _batcher(attention_tangent_p, _tangent_batch_rule,
                                                                  split_tangent)


# ------------------------------------------------------------------------------------- JVP and transpose

def attention_differentiable(config: AttentionConfig, return_lse: bool, query, key, value, optional: dict):
    """Attention over the primitives, differentiable in both modes; returns out, or (out, lse)."""
    out, lse = attention_fwd_p.bind(*config.join_operands(query, key, value, optional), config=config)
    return (out, lse) if return_lse else out


def _forward_jvp(primals, tangents, *, config: AttentionConfig):
    query, key, value, optional = config.split_operands(primals)
    out, lse = attention_fwd_p.bind(*primals, config=config)
    t_query, t_key, t_value, t_optional = config.split_operands(tangents)
    differentiable = [t_query, t_key, t_value] + ([t_optional["sinks"]] if config.has_sinks else [])
    if all(type(t) is ad.Zero for t in differentiable):
        return (out, lse), (ad.Zero.from_primal_value(out), ad.Zero.from_primal_value(lse))
    # The residuals of the linearized (and so of the transposed, reverse-mode) computation, by name.
    residuals = [checkpoint_name(x, name) for x, name in zip((query, key, value, out, lse), RESIDUAL_NAMES)]
    tangent_operands = [ad.instantiate_zeros(t) for t in differentiable]
    t_out, t_lse = attention_tangent_p.bind(
        *residuals, *tangent_operands, *(optional[name] for name in config.present_operands()), config=config)
    return (out, lse), (t_out, t_lse)


def _tangent_transpose(cotangents, *operands, config: AttentionConfig):
    """The tangent's transpose is the backward pass: (d_out, d_lse) -> (dq, dk, dv, d_sinks)."""
    (query, key, value, out, lse), tangents, optional = split_tangent_operands(config, operands)
    d_out, d_lse = cotangents
    if type(d_out) is ad.Zero and type(d_lse) is ad.Zero:
        return [None] * len(operands)
    d_out = ad.instantiate_zeros(d_out)
    has_d_lse = type(d_lse) is not ad.Zero
    backward_operands = (query, key, value, out, lse, d_out) + ((d_lse,) if has_d_lse else ())
    grads = attention_bwd_p.bind(*backward_operands, *(optional[name] for name in config.present_operands()),
                                 config=config, has_d_lse=has_d_lse)
    names = tangent_operand_names(config)
    result = [None] * len(operands)
    for name, grad, tangent in zip(_TANGENTS + ("t_sinks",), grads, tangents):
        if ad.is_undefined_primal(tangent):
            result[names.index(name)] = grad
    return result


def _reference_forward(*operands, config: AttentionConfig):
    query, key, value, optional = config.split_operands(operands)
    return list(reference_forward(query, key, value, optional, config))


def _reference_backward(*operands, config: AttentionConfig, has_d_lse: bool):
    (query, key, value, out, lse, d_out), d_lse, optional = split_backward_operands(config, has_d_lse, operands)
    grads = reference_backward(query, key, value, out, lse, d_out, d_lse, optional, config)
    return list(grads[:3]) + ([grads[3]] if config.has_sinks else [])


def _reference_tangent(*operands, config: AttentionConfig):
    (query, key, value, out, lse), tangents, optional = split_tangent_operands(config, operands)
    return list(reference_tangent(query, key, value, out, lse, *tangents, optional, config))


class _Reference:
    """Stands in for a primitive in context_parallel's per-shard calls: binds the pure-JAX reference."""

    def __init__(self, function):
        self.bind = function


_REFERENCE_CALLS = dict(forward_p=_Reference(_reference_forward), backward_p=_Reference(_reference_backward),
                        tangent_p=_Reference(_reference_tangent))


def _reference_split(config: AttentionConfig, query, key):
    """The sequence split for the reference of an outer primitive's call, or None when the operands
    are the whole sequence in its order (under jit XLA partitions the reference like any JAX code)."""
    if config.context_parallel_axis:
        return context_parallel.manual_split(config, query, key, **_REFERENCE_CALLS)
    if config.zigzag_shards is not None:
        return context_parallel.SequenceSplit(axes=(), num_shards=1, strategy="all_gather", kv_whole=True,
                                              **_REFERENCE_CALLS)
    return None


def _backward_function(operands, *, config: AttentionConfig, has_d_lse: bool):
    split = _reference_split(config, operands[0], operands[1])
    if split is None:
        return functools.partial(_reference_backward, config=config, has_d_lse=has_d_lse)
    return lambda *operands: list(context_parallel.backward(config, has_d_lse, operands, split,
                                                            split_backward_operands))


def _tangent_function(operands, *, config: AttentionConfig):
    split = _reference_split(config, operands[0], operands[1])
    if split is None:
        return functools.partial(_reference_tangent, config=config)
    return lambda *operands: list(context_parallel.tangent(config, operands, split, split_tangent_operands))


def _second_order_jvp(function_of):
    """JVP of the backward or tangent primitive (second order: Hessian-vector products, jvp of grad,
    grad of jvp), by JAX's own differentiation of the pure-JAX reference (with the primitive's sequence
    split, collectives included); the result is pure JAX, so JAX transposes it as well. Forward over
    reverse stays linear in memory; transposing the reference's scan over key blocks (grad of jvp)
    keeps every block's score tiles, O(Sq·Sk). No kernel runs in such a program's second-order part."""
    def rule(primals, tangents, **params):
        function = function_of(primals, **params)
        return jax.jvp(function, list(primals), [ad.instantiate_zeros(t) for t in tangents])
    return rule


ad.primitive_jvps[attention_fwd_p] = _forward_jvp
ad.primitive_transposes[attention_tangent_p] = _tangent_transpose
ad.primitive_jvps[attention_bwd_p] = _second_order_jvp(_backward_function)
ad.primitive_jvps[attention_tangent_p] = _second_order_jvp(_tangent_function)
