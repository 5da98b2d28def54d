"""Host side shared by the forward kernels (sm90, sm100): the GPU's SM count, and the `cutlass_call`
launch with its compile key and on-disk cache."""

from __future__ import annotations

import cutlass
import jax
import jax.numpy as jnp
from cutlass.cute.runtime import make_fake_compact_tensor
from cutlass.jax import cutlass_call

from fa4_jax.kernels import compile_cache

def sm_count(default: int) -> int:
    """Streaming multiprocessors of the local GPU (sizes the persistent grid); `default` without one,
    e.g. when compiling on a CPU."""
    try:
        device = jax.local_devices(backend="gpu")[0]
        return int(getattr(device, "core_count", default))
    except (RuntimeError, IndexError):
        return default


def launch(kernel, kernel_name: str, options, query, key, value, optional: dict):
    """Run a forward kernel through `cutlass_call`: (out [B, Sq, Hq, Dv], lse [B, Hq, Sq] float32).

    The kernel's inputs after the stream are (query, key, value, sinks, q_segment_ids, kv_segment_ids,
    q_seq_lengths, kv_seq_lengths, q_start), absent ones None. `options` (hashable) selects the
    compiled variant, so (kernel_name, options) is the compile key.
    """
    batch, q_len, q_heads, _ = query.shape
    outputs = (jax.ShapeDtypeStruct((batch, q_len, q_heads, value.shape[-1]), query.dtype),
               jax.ShapeDtypeStruct((batch, q_heads, q_len), jnp.float32))
    arguments = (query, key, value) + tuple(optional.get(name) for name in (
        "sinks", "q_segment_ids", "kv_segment_ids", "q_seq_lengths", "kv_seq_lengths", "q_start"))
    compile_key = (kernel_name, options)
    compile_cache.prepare(kernel, arguments, outputs, compile_key)
    out, lse = cutlass_call(kernel, output_shape_dtype=outputs, compile_key=compile_key)(*arguments)
    return out, lse


def fake_arguments(config, shape, dtype_name: str) -> list:
    """Fake tensors in a forward kernel's argument order (inputs as in `launch`, then out and lse), for
    compiling without a GPU. shape = (B, Sq, Sk, Hq, Hkv, D)."""
    batch, q_len, kv_len, q_heads, kv_heads, head_dim = shape
    element = {"bfloat16": cutlass.BFloat16, "float16": cutlass.Float16}[dtype_name]
    i32, f32 = cutlass.Int32, cutlass.Float32

    def fake(dtype, dims):
        return make_fake_compact_tensor(dtype, dims, stride_order=tuple(range(len(dims)))[::-1], assumed_align=16)

    return [
        fake(element, (batch, q_len, q_heads, head_dim)), fake(element, (batch, kv_len, kv_heads, head_dim)),
        fake(element, (batch, kv_len, kv_heads, head_dim)),
        fake(f32, (q_heads,)) if config.has_sinks else None,
        fake(i32, (batch, q_len)) if config.has_segment_ids else None,
        fake(i32, (batch, kv_len)) if config.has_segment_ids else None,
        fake(i32, (batch,)) if config.has_q_seq_lengths else None,
        fake(i32, (batch,)) if config.has_kv_seq_lengths else None,
        fake(i32, (1,)) if config.has_q_start else None,
        fake(element, (batch, q_len, q_heads, head_dim)), fake(f32, (batch, q_heads, q_len)),
    ]
