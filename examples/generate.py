"""Generate tokens from the small GPT of examples/train_gpt.py with the Flax layer's KV cache.

Trains the GPT for a few steps on train_gpt's synthetic graph walks (so its predictions mean
something), then decodes: the prompt goes through the model in one call that fills every layer's
cache (`fa4_jax.flax_layer.MultiHeadAttention(decode=True)`), and each new token is one call with
Sq = 1. The cached attention is `fa4_jax.attention(..., kv_seq_lengths=...)` with a short query (or,
with --page-size, `fa4_jax.paged_attention` over the layer's paged cache), which on a GPU runs the
split-KV decode kernel (fa4_jax/kernels/sm90/decode.py; head dims 64 / 128 / 256,
bf16 / fp16) and elsewhere the reference. Prints decode tokens/s (batch · new tokens / time, the
first step, which compiles, left out) and the fraction of generated tokens that are a successor of
the previous one in the walk graph (about 1 / SUCCESSORS_PER_TOKEN ... 1 once the model has learned
it; random tokens give ~SUCCESSORS_PER_TOKEN / vocab).

    python examples/generate.py                    # CPU: reference path, about a minute
    python examples/generate.py --dtype bfloat16 --batch 64 --new-tokens 256 [--page-size 16]   # one GPU
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_gpt  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train-steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=8, help="sequences decoded at once")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--fa4-implementation", choices=("auto", "cute", "reference"), default="auto")
    parser.add_argument("--page-size", type=int, default=0,
                        help="decode from a paged KV cache with pages of this many tokens (0: contiguous)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def train(args):
    """(GPT args, trained parameters): train_gpt's model and loop, sequences as long as a generation."""
    seq_len = args.prompt_len + args.new_tokens
    gpt_args = train_gpt.parse_args([
        "--steps", str(args.train_steps), "--batch", "16", "--seq-len", str(seq_len), "--layers", str(args.layers),
        "--d-model", str(args.d_model), "--heads", str(args.heads), "--kv-heads", str(args.kv_heads),
        "--vocab", str(args.vocab), "--dtype", args.dtype, "--fa4-implementation", args.fa4_implementation,
        "--seed", str(args.seed), "--mesh", "data=1,model=1", "--quiet"])
    mesh = train_gpt.make_mesh(train_gpt.parse_mesh(gpt_args.mesh, jax.device_count()))
    compiled, params, opt_state, data_fn, _, _ = train_gpt.build_training(gpt_args, mesh)
    for step in range(gpt_args.steps):
        params, opt_state, loss = compiled(params, opt_state, data_fn(step))
    print(f"trained {gpt_args.steps} steps, loss {float(loss):.3f}")
    return gpt_args, mesh, params


def generate(args, gpt_args, mesh, params):
    model = train_gpt.GPT(gpt_args, mesh, nnx.Rngs(0))
    nnx.update(model, params)
    seq_len = args.prompt_len + args.new_tokens
    for block in model.blocks:
        block.attention.decode = True
        if args.page_size:
            block.attention.init_paged_cache(args.batch, seq_len, args.page_size, jnp.dtype(args.dtype))
        else:
            block.attention.init_cache((args.batch, seq_len, args.d_model), jnp.dtype(args.dtype))

    @nnx.jit
    def step(model, tokens, positions):
        return jnp.argmax(model(tokens, positions=positions)[:, -1], axis=-1).astype(jnp.int32)

    walks = train_gpt.synthetic_batch(args.seed, 10_000, args.batch, seq_len, args.vocab)
    prompt = walks[:, :args.prompt_len]
    token = step(model, prompt, jnp.arange(args.prompt_len))
    generated = [token]
    step(model, token[:, None], jnp.full((1,), args.prompt_len)).block_until_ready()   # compiles
    # That call wrote position prompt_len; rewind the caches so the timed loop rewrites it.
    for block in model.blocks:
        block.attention.cache_index[...] = jnp.array(args.prompt_len, jnp.int32)
    start = time.perf_counter()
    for position in range(args.prompt_len, seq_len - 1):
        token = step(model, token[:, None], jnp.full((1,), position))
        generated.append(token)
    jax.block_until_ready(token)
    seconds = time.perf_counter() - start
    tokens = np.stack([np.asarray(t) for t in generated], axis=1)
    graph = np.asarray(jax.random.randint(jax.random.key(args.seed), (args.vocab, train_gpt.SUCCESSORS_PER_TOKEN),
                                          0, args.vocab))
    previous = np.concatenate([np.asarray(prompt[:, -1:]), tokens[:, :-1]], axis=1)
    follows = np.mean([[tokens[b, i] in graph[previous[b, i]] for i in range(tokens.shape[1])]
                       for b in range(args.batch)])
    decoded = args.batch * (len(generated) - 1)
    print(f"decoded {decoded} tokens in {seconds * 1e3:.1f} ms: {decoded / seconds:,.0f} tokens/s "
          f"(batch {args.batch}, {jax.devices()[0].device_kind}); {follows:.0%} of generated tokens follow the graph")
    return dict(tokens_per_second=decoded / seconds, follows_graph=float(follows), tokens=tokens)


def main(argv=None):
    args = parse_args(argv)
    gpt_args, mesh, params = train(args)
    return generate(args, gpt_args, mesh, params)


if __name__ == "__main__":
    main()
