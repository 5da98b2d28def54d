"""fa4_jax: FlashAttention-4-style attention for JAX.

`fa4_jax.attention(query, key, value, ...)` is a JAX primitive with JVP and transpose rules, batching
and sharding rules, lowered to CuTe-DSL kernels on NVIDIA Hopper/Blackwell and to a pure-JAX reference elsewhere.
`fa4_jax.attention_varlen` takes packed variable-length sequences (cu_seqlens).
`fa4_jax.dot_product_attention` takes `jax.nn.dot_product_attention`'s arguments, with its semantics.
"""

from fa4_jax import lowering as _lowering  # noqa: F401  (registers the per-platform lowerings)
from fa4_jax import sharding as _sharding  # noqa: F401  (registers the partitioned lowering)
from fa4_jax.api import attention
from fa4_jax.config import AttentionConfig
from fa4_jax.context_parallel import unzigzag, zigzag
from fa4_jax.nn import dot_product_attention
from fa4_jax.paged import paged_attention
from fa4_jax.primitive import RESIDUAL_NAMES
from fa4_jax.varlen import attention_varlen

__all__ = ["attention", "attention_varlen", "dot_product_attention", "paged_attention", "AttentionConfig", "RESIDUAL_NAMES", "zigzag",
           "unzigzag"]
__version__ = "0.1.0"
