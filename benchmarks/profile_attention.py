"""One library's attention forward or backward on one shape, for Nsight Compute (`ncu`) to profile.

Runs the jitted forward, or the jitted pullback, of fa4_jax (`implementation="cute"`), FA4's kernels
(`fa4peer`, the peer bundle; benchmark use only) or cuDNN a few times on fixed bf16 inputs, so that
`ncu --kernel-name regex:... --launch-skip N --launch-count 1` can pick one steady-state launch of the
main kernel. For the backward, the forward and its residuals run once before the profiled calls; a line
is printed when the profiled calls start, so a profile's launch numbering is easy to read.

Usage (device, after the bundles are set up; see benchmarks/device/profile_attention.sh):
    python3 benchmarks/profile_attention.py --pass backward --library fa4_jax --batch 4 --seq 4096 \
        --heads 16/16 --head-dim 128 [--causal] [--deterministic] [--calls 3]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp


def attention_function(library: str, causal: bool, deterministic: bool = False):
    if library == "fa4_jax":
        import fa4_jax
        return lambda q, k, v: fa4_jax.attention(q, k, v, causal=causal, deterministic=deterministic,
                                                 implementation="cute")
    if deterministic:
        raise ValueError("--deterministic profiles fa4_jax's deterministic backward only")
    if library == "fa4peer":
        import fa4peer
        return lambda q, k, v: fa4peer.flash_attn(q, k, v, causal=causal, return_lse=True)[0]
    if library == "cudnn":
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                            implementation="cudnn")
    raise ValueError(f"unknown library {library!r}: fa4_jax, fa4peer or cudnn")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pass", dest="pass_name", choices=["forward", "backward"], default="backward")
    parser.add_argument("--library", required=True, choices=["fa4_jax", "fa4peer", "cudnn"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--heads", default="16/16", help="query heads / key-value heads")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--deterministic", action="store_true", help="fa4_jax's bitwise-reproducible backward")
    parser.add_argument("--calls", type=int, default=3)
    args = parser.parse_args(argv)

    q_heads, kv_heads = (int(part) for part in args.heads.split("/"))
    keys = jax.random.split(jax.random.key(0), 4)
    query = jax.random.normal(keys[0], (args.batch, args.seq, q_heads, args.head_dim), jnp.bfloat16)
    key = jax.random.normal(keys[1], (args.batch, args.seq, kv_heads, args.head_dim), jnp.bfloat16)
    value = jax.random.normal(keys[2], (args.batch, args.seq, kv_heads, args.head_dim), jnp.bfloat16)
    d_out = jax.random.normal(keys[3], query.shape, jnp.bfloat16)

    attention = attention_function(args.library, args.causal, args.deterministic)
    if args.pass_name == "forward":
        forward = jax.jit(attention)
        jax.block_until_ready(forward(query, key, value))
        print(f"profiled calls start: {args.calls} forward calls of {args.library}", flush=True)
        for _ in range(args.calls):
            out = forward(query, key, value)
        jax.block_until_ready(out)
        return
    _, pullback = jax.jit(lambda q, k, v: jax.vjp(attention, q, k, v))(query, key, value)
    backward = jax.jit(lambda pullback, d_out: pullback(d_out))
    jax.block_until_ready(backward(pullback, d_out))
    print(f"profiled calls start: {args.calls} backward calls of {args.library}", flush=True)
    for _ in range(args.calls):
        gradients = backward(pullback, d_out)
    jax.block_until_ready(gradients)


if __name__ == "__main__":
    main()
