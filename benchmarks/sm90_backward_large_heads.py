"""Time the sm90 large-head backward kernel (D = 192 / 256) against cuDNN's backward, same inputs.

Rows of the issue's grid (B*S = 16k tokens, H*D = 2048, bf16), CUPTI kernel time, median of
iterations, through benchmarks/attention_backward.py's helpers (residuals from the forward kernel,
cuDNN's VJP with its residuals precomputed, FLOPs = 2.5x forward). Until dispatch routes D = 192 / 256
here, attention_backward.py marks those rows "reference fallback"; this script times the kernel itself.

Usage: python benchmarks/sm90_backward_large_heads.py --out large_heads.json [--head-dims 256]
       [--seq-lens 1024 4096] [--iterations 10] [--deterministic]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import attention  # noqa: E402
import attention_backward  # noqa: E402


def time_row(shape, iterations, deterministic):
    import jax
    import jax.numpy as jnp
    from fa4_jax.kernels import sm90_backward_large_heads

    key = jax.random.key(0)
    keys = jax.random.split(key, 4)
    dims = attention_backward._dims(shape)
    query, key_, value, d_out = (jax.random.normal(k, dims, jnp.float32).astype(jnp.bfloat16)
                                 for k in keys)
    config = attention_backward._config(shape, deterministic)
    out, lse, source = attention_backward._forward_residuals(query, key_, value, config)
    row = dict(**shape, deterministic=deterministic, residuals=source)
    ours = jax.jit(lambda q, k, v, o, l, g: sm90_backward_large_heads.attention_backward(
        q, k, v, o, l, g, None, {}, config)[:3])
    _, cudnn_vjp = jax.vjp(lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=shape["causal"], implementation="cudnn"), query, key_, value)
    candidates = {"large_heads": (ours, (query, key_, value, out, lse, d_out)),
                  "cudnn": (jax.jit(lambda vjp, g: vjp(g)), (cudnn_vjp, d_out))}
    grads = {}
    for name, (function, arguments) in candidates.items():
        try:
            grads[name], row[f"{name}_ms"] = attention._median_ms(function, arguments, iterations)
            row[f"{name}_tflops"] = (attention_backward.backward_flops(shape)
                                     / (row[f"{name}_ms"] * 1e-3) / 1e12)
        except Exception as error:  # report and keep going
            row[f"{name}_error"] = f"{type(error).__name__}: {str(error)[:300]}"
    if "large_heads" in grads and "cudnn" in grads:
        row["ratio_vs_cudnn"] = row["cudnn_ms"] / row["large_heads_ms"]
        for label, a, b in zip(("dq", "dk", "dv"), grads["large_heads"], grads["cudnn"]):
            row[f"max_abs_diff_{label}"] = float(jnp.max(jnp.abs(a.astype(jnp.float32)
                                                                 - b.astype(jnp.float32))))
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="large_heads.json")
    parser.add_argument("--head-dims", nargs="+", type=int, default=[256])
    parser.add_argument("--seq-lens", nargs="+", type=int, default=[1024, 4096])
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--deterministic", action="store_true")
    args = parser.parse_args(argv)
    rows = []
    for shape in attention.shapes():
        if shape["head_dim"] not in args.head_dims or shape["seq_len"] not in args.seq_lens:
            continue
        row = time_row(shape, args.iterations, args.deterministic)
        rows.append(row)
        with open(args.out, "w") as handle:
            json.dump(dict(git_revision=attention_backward.git_revision(), rows=rows), handle,
                      indent=1)
        print(f"D={shape['head_dim']} causal={int(shape['causal'])} S={shape['seq_len']:5d} "
              f"ours {row.get('large_heads_ms', float('nan')):7.3f} ms "
              f"cudnn {row.get('cudnn_ms', float('nan')):7.3f} ms "
              f"ratio {row.get('ratio_vs_cudnn', float('nan')):.2f} "
              f"{row.get('large_heads_error', '')}", flush=True)


if __name__ == "__main__":
    main()
