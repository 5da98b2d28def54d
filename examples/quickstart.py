"""fa4_jax in one page: forward and gradient under jit, both checked against float64, and timed.

    python examples/quickstart.py            # any platform; the CuTe kernels on Hopper/Blackwell GPUs

It prints each error next to jax.nn.dot_product_attention's on the same inputs (the baseline), PASS
or FAIL against a stated tolerance, and exits 1 on a failure. On a machine without a supported GPU
it runs the XLA reference path and says so. `--seed` replays a run (the seed is printed).
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import fa4_jax

# Max |error| against float64 (outputs and gradients are O(1) for these inputs; gradients are taken of
# <out, cotangent>). bf16 keeps 8 significant bits: a few ulps of 1 are ~1e-2.
TOLERANCE = {"bfloat16": 3e-2, "float16": 5e-3, "float32": 1e-4}


def float64_attention(q, k, v):
    """Dense float64 attention for [B, S, H, D] inputs (same heads), causal (Sq == Sk here)."""
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(q.shape[-1])
    visible = np.arange(k.shape[1])[None, :] <= np.arange(q.shape[1])[:, None]
    s = jnp.where(visible, s, -jnp.inf)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    device = jax.devices()[0]
    where = device.platform if device.device_kind == device.platform else f"{device.device_kind} ({device.platform})"
    print(f"jax {jax.__version__} on {where}, seed {args.seed}")
    if device.platform != "gpu":
        print("no GPU: fa4_jax runs its XLA reference path here (the CuTe kernels need sm_90 / sm_100)")

    keys = jax.random.split(jax.random.key(args.seed), 4)
    shape = (args.batch, args.seq, args.heads, args.head_dim)
    q, k, v = (jax.random.normal(key, shape, jnp.float32).astype(args.dtype) for key in keys[:3])
    cotangent = jax.random.normal(keys[3], shape, jnp.float32)

    def forward_and_gradient(attention):
        """jit of (q, k, v, cotangent) -> ((<out, cotangent>, out), (dq, dk, dv))."""
        def loss(q, k, v, cotangent):
            out = attention(q, k, v)
            return jnp.sum(out.astype(cotangent.dtype) * cotangent), out
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))

    ours = forward_and_gradient(lambda q, k, v: fa4_jax.attention(q, k, v, causal=True))
    baseline = forward_and_gradient(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True))
    with jax.enable_x64(True):
        exact = forward_and_gradient(float64_attention)
        (_, out64), grads64 = exact(*(jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, cotangent)))
        out64, grads64 = np.asarray(out64), [np.asarray(g) for g in grads64]

    errors = {}
    for name, function in (("fa4_jax", ours), ("jax.nn", baseline)):
        (_, out), grads = jax.block_until_ready(function(q, k, v, cotangent))
        errors[name] = [np.abs(np.asarray(x, np.float64) - y).max() for x, y in zip((out, *grads), (out64, *grads64))]
    tolerance = TOLERANCE[args.dtype]
    print(f"max |error| vs float64 ({args.dtype}, tolerance {tolerance:g}; jax.nn.dot_product_attention as baseline):")
    failed = False
    for index, name in enumerate(("out", "dq", "dk", "dv")):
        error, reference = errors["fa4_jax"][index], errors["jax.nn"][index]
        failed |= not error <= tolerance
        print(f"  {name}: fa4_jax {error:.2e}   jax.nn {reference:.2e}   {'PASS' if error <= tolerance else 'FAIL'}")

    for name, function in (("fa4_jax", ours), ("jax.nn", baseline)):
        start = time.perf_counter()
        for _ in range(args.iters):
            jax.block_until_ready(function(q, k, v, cotangent))
        elapsed = (time.perf_counter() - start) / args.iters
        print(f"forward+backward, {name}: {elapsed * 1e3:.2f} ms per call (wall clock, {args.iters} calls)")
    print("FAIL" if failed else "PASS")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
