"""Swap the attention of a stock Flax NNX model for fa4_jax and check that nothing else changes.

Two ways, both keeping the trained parameters:
1. in place: point every `flax.nnx.MultiHeadAttention`'s `attention_fn` at
   `fa4_jax.flax_layer.dot_product_attention`;
2. by replacement: build the model with `fa4_jax.flax_layer.MultiHeadAttention` and load the stock
   model's parameters into it (same names and shapes), which also gives the cache-length decode path.

    python examples/flax_swap.py
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fa4_jax import flax_layer


class Encoder(nnx.Module):
    """A small pre-norm transformer of stock Flax layers; `attention_cls` picks the attention layer."""

    def __init__(self, features=64, heads=4, kv_heads=2, layers=2, *, attention_cls=nnx.MultiHeadAttention,
                 rngs: nnx.Rngs):
        self.norms = nnx.List([nnx.LayerNorm(features, rngs=rngs) for _ in range(layers)])
        self.attentions = nnx.List([
            attention_cls(num_heads=heads, in_features=features, num_kv_heads=kv_heads, decode=False,
                          rngs=rngs)
            for _ in range(layers)])
        self.mlps = nnx.List([nnx.Linear(features, features, rngs=rngs) for _ in range(layers)])

    def __call__(self, x, mask=None):
        for norm, attention, mlp in zip(self.norms, self.attentions, self.mlps):
            x = x + attention(norm(x), mask=mask, is_causal=True)
            x = x + jax.nn.gelu(mlp(x))
        return x


def swap_attention_in_place(model: nnx.Module) -> int:
    """Makes every flax.nnx.MultiHeadAttention in `model` attend with fa4_jax; returns how many."""
    swapped = 0
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.MultiHeadAttention) and not isinstance(node, flax_layer.MultiHeadAttention):
            node.attention_fn = flax_layer.dot_product_attention
            swapped += 1
    return swapped


def main():
    batch, length, features = 3, 16, 64
    x = jax.random.normal(jax.random.key(1), (batch, length, features))
    # Key padding: the last sequence keeps only its first 11 tokens.
    kv_valid = jnp.arange(length)[None, :] < jnp.array([[16], [16], [11]])
    mask = kv_valid[:, None, None, :]

    stock = Encoder(rngs=nnx.Rngs(0))
    expected = stock(x, mask=mask)
    stock_gradients = nnx.grad(lambda model: jnp.sum(model(x, mask=mask) ** 2))(stock)

    replaced = Encoder(attention_cls=flax_layer.MultiHeadAttention, rngs=nnx.Rngs(123))
    nnx.update(replaced, nnx.state(stock, nnx.Param))

    swapped = nnx.clone(stock)
    print(f"swapped {swap_attention_in_place(swapped)} attention layers in place")

    for name, model in (("swapped in place", swapped), ("replaced layer", replaced)):
        out = model(x, mask=mask)
        gradients = nnx.grad(lambda model: jnp.sum(model(x, mask=mask) ** 2))(model)
        output_error = float(jnp.max(jnp.abs(out - expected)))
        pairs = list(zip(jax.tree.leaves(nnx.state(gradients, nnx.Param)),
                         jax.tree.leaves(nnx.state(stock_gradients, nnx.Param)), strict=True))
        # Relative to the largest gradient anywhere: some (the key bias's) are zero up to rounding.
        gradient_scale = max(float(jnp.max(jnp.abs(theirs))) for _, theirs in pairs)
        gradient_error = max(float(jnp.max(jnp.abs(mine - theirs))) for mine, theirs in pairs) / gradient_scale
        print(f"{name:>17}: max |output - stock| = {output_error:.2e}, "
              f"max relative gradient difference = {gradient_error:.2e}")
        np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-4, atol=1e-4)
        assert gradient_error < 1e-4
    print("outputs and gradients equal the stock model's")


if __name__ == "__main__":
    # No options: --help describes the example instead of running it.
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
