"""What every CuTe kernel (forward or backward, sm90 or sm100) cannot take, whatever its design: the
dtype, shape and scale checks behind each kernel module's `unsupported_reason`. Plain Python, so the
dispatch can ask without compiling anything."""

from __future__ import annotations

from typing import Optional

KERNEL_DTYPES = ("bfloat16", "float16")


def shape_unsupported_reason(kernel_name: str, query_shape, key_shape, value_shape, dtype,
                             head_dims) -> Optional[str]:
    """What a kernel (forward or backward, with its own head dims) cannot take about dtypes and shapes,
    or None: the one shape check behind every kernel's `unsupported_reason`."""
    dtype_name = getattr(dtype, "name", str(dtype))
    if dtype_name not in KERNEL_DTYPES:
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


def scale_unsupported_reason(kernel_name: str, config) -> Optional[str]:
    """Why a kernel (forward or backward) cannot take `config.scale`, or None.

    Without a softcap the kernels fold the scale into the exp2 of the raw logits: the online softmax
    keeps the row maximum of the unscaled logits (its rescale test (new - old) * scale_log2 > threshold
    never passes from -inf when scale < 0, so the maximum stays -inf and LSE comes out -inf), and masked
    logits (-inf) times the scale give +inf for scale < 0 and NaN for scale 0. A softcap scales the
    logits before the softmax, whose own scale is then log2 e, so any scale works with one."""
    if config.softcap is None and not config.scale > 0:
        return f"the {kernel_name} kernel needs a positive scale unless a softcap is set (got {config.scale})"
    return None
