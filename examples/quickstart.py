"""fa4_jax in one page: forward and gradient under jit, checked against float64, and timed.

    python examples/quickstart.py            # any platform; the CuTe kernels on Hopper/Blackwell GPUs

On a machine without a supported GPU it runs the XLA reference path and says so.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import fa4_jax


def float64_attention(q, k, v, causal):
    """Dense float64 NumPy attention for [B, S, H, D] inputs (same heads), bottom-right causal."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    if causal:
        q_len, kv_len = q.shape[1], k.shape[1]
        visible = np.arange(kv_len)[None, :] <= np.arange(q_len)[:, None] + (kv_len - q_len)
        s = np.where(visible, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", p, v)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--iters", type=int, default=5)
    args = parser.parse_args()

    platform = jax.devices()[0].platform
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind} ({platform})")
    if platform != "gpu":
        print("no GPU: fa4_jax runs its XLA reference path here (the CuTe kernels need sm_90 / sm_100)")

    keys = jax.random.split(jax.random.key(int.from_bytes(os.urandom(4), "little")), 3)
    shape = (args.batch, args.seq, args.heads, args.head_dim)
    q, k, v = (jax.random.normal(key, shape, jnp.float32).astype(args.dtype) for key in keys)

    forward = jax.jit(lambda q, k, v: fa4_jax.attention(q, k, v, causal=True))
    loss = lambda q, k, v: jnp.sum(fa4_jax.attention(q, k, v, causal=True).astype(jnp.float32) ** 2)
    gradient = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    out = forward(q, k, v).block_until_ready()
    grads = jax.block_until_ready(gradient(q, k, v))
    expected = float64_attention(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), True)
    error = np.abs(np.asarray(out, np.float64) - expected).max()
    print(f"forward: out {out.shape} {out.dtype}, max |error| vs float64 = {error:.2e}")
    print(f"gradient: |dq|max={float(jnp.abs(grads[0]).max()):.3f} finite={all(bool(jnp.isfinite(g).all()) for g in grads)}")

    for name, fn in (("forward", forward), ("forward+backward", gradient)):
        start = time.perf_counter()
        for _ in range(args.iters):
            jax.block_until_ready(fn(q, k, v))
        elapsed = (time.perf_counter() - start) / args.iters
        print(f"{name}: {elapsed * 1e3:.2f} ms per call (wall clock, {args.iters} calls)")


if __name__ == "__main__":
    main()
