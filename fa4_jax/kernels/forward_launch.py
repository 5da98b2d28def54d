"""Host side shared by the forward kernels (sm90, sm100): the checks every kernel makes, the GPU's SM
count, and the `cutlass_call` launch with its compile key and on-disk cache."""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from cutlass.jax import cutlass_call

from fa4_jax.kernels import compile_cache

FORWARD_DTYPES = ("bfloat16", "float16")


def shape_unsupported_reason(kernel_name: str, query_shape, key_shape, value_shape, dtype,
                             head_dims) -> Optional[str]:
    """What a forward kernel cannot take about dtypes and shapes, or None."""
    dtype_name = getattr(dtype, "name", str(dtype))
    if dtype_name not in FORWARD_DTYPES:
        return f"the {kernel_name} kernel takes bfloat16 or float16 inputs, not {dtype_name}"
    batch, q_len, q_heads, head_dim = query_shape
    _, kv_len, kv_heads, _ = key_shape
    v_head_dim = value_shape[-1]
    if head_dim not in head_dims:
        return f"the {kernel_name} kernel takes head dims {head_dims}, not {head_dim}"
    if v_head_dim != head_dim:
        return (f"the {kernel_name} kernel needs the value head dim ({v_head_dim}) to equal the query/key head "
                f"dim ({head_dim})")
    if q_heads % kv_heads != 0:
        return f"query heads ({q_heads}) must be a multiple of key/value heads ({kv_heads})"
    if batch == 0 or q_len == 0 or kv_len == 0:
        return f"the {kernel_name} kernel needs non-empty batch and sequence axes"
    return None


def sm_count(default: int) -> int:
    """Streaming multiprocessors of the local GPU (sizes the persistent grid); `default` without one,
    e.g. when compiling on a CPU."""
    try:
        device = jax.local_devices(backend="gpu")[0]
        return int(getattr(device, "core_count", default))
    except (RuntimeError, IndexError):
        return default


def launch(kernel, kernel_name: str, kernel_version, options, query, key, value, optional: dict):
    """Run a forward kernel through `cutlass_call`: (out [B, Sq, Hq, Dv], lse [B, Hq, Sq] float32).

    The kernel's inputs after the stream are (query, key, value, sinks, q_segment_ids, kv_segment_ids,
    q_seq_lengths, kv_seq_lengths, q_start), absent ones None. `options` (hashable) selects the
    compiled variant, so (kernel_name, kernel_version, options) is the compile key.
    """
    batch, q_len, q_heads, _ = query.shape
    outputs = (jax.ShapeDtypeStruct((batch, q_len, q_heads, value.shape[-1]), query.dtype),
               jax.ShapeDtypeStruct((batch, q_heads, q_len), jnp.float32))
    arguments = (query, key, value) + tuple(optional.get(name) for name in (
        "sinks", "q_segment_ids", "kv_segment_ids", "q_seq_lengths", "kv_seq_lengths", "q_start"))
    compile_key = (kernel_name, kernel_version, options)
    compile_cache.prepare(kernel, arguments, outputs, compile_key)
    out, lse = cutlass_call(kernel, output_shape_dtype=outputs, compile_key=compile_key)(*arguments)
    return out, lse
