"""fa4_jax: FlashAttention-4-style attention for JAX."""
