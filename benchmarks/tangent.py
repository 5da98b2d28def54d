"""Forward-mode AD benchmark (issue 15 part 2): jax.jvp of fa4_jax.attention vs the peer's fused JVP.

Per row (bf16, B * S = 16k tokens, 16 query heads, GQA 16/4, D in {64, 128} or --head-dims, causal
and not; a D the tangent kernel lacks runs it zero-padded, as the CUDA lowering does: D = 80 at 128):
- fa4_jax_jvp_ms: jax.jvp of fa4_jax.attention (implementation="cute": our forward kernel, then the sm90
  tangent kernel);
- fa4peer_jvp_ms: jax.jvp of fa4peer.flash_attn (backend="cute": FA4's forward and its fused tangent
  kernel). The peer bundle is imported here only (benchmark only), and only when importable;
- fa4_jax_forward_ms: our forward alone, so the tangent's own share is visible;
- fa4_jax_tangent_kernel_ms / reference_tangent_ms: the tangent alone from the same saved O and LSE, on
  the sm90 tangent kernel (at tangent_kernel_head_dim, padding included) and on the blocked pure-JAX
  pass (`reference_tangent`, what ran before; what a padded D ran before too). The FLOPs and TFLOP/s
  count the call's D, not the padded one.
Times are CUPTI kernel times of one call (all its kernels summed), median over --iterations
(jax.experimental.mosaic.gpu.profiler.measure). max_abs_diff_vs_fa4peer compares the two t_out.

Usage: python benchmarks/tangent.py --out benchmarks/results/tangent_h200.json [--quick] [--max-seconds N]
       [--head-dims 80 96]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import platform
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks import attention  # noqa: E402  (CUPTI timing, versions, git revision)

TOKENS, Q_HEADS, KV_HEADS = 16384, 16, 4


def rows(quick: bool = False, head_dims=(64, 128)):
    seq_lens = (1024, 4096) if not quick else (1024,)
    return [dict(batch=TOKENS // s, seq_len=s, q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=d, causal=c)
            for d in head_dims for s in seq_lens for c in (False, True)]


def tangent_flops(row) -> float:
    """Five GEMMs of 2 Sq Sk D each per head (t_Q K^T, Q t_K^T, Q K^T, P t_V, (P o t_S) V), halved when causal."""
    flops = 5 * 2.0 * row["batch"] * row["q_heads"] * row["seq_len"] ** 2 * row["head_dim"]
    return flops / 2 if row["causal"] else flops


def _inputs(row):
    import jax
    import jax.numpy as jnp

    keys = jax.random.split(jax.random.key(0), 6)
    q_shape = (row["batch"], row["seq_len"], row["q_heads"], row["head_dim"])
    kv_shape = (row["batch"], row["seq_len"], row["kv_heads"], row["head_dim"])
    shapes = (q_shape, kv_shape, kv_shape) * 2
    return [jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16) for key, shape in zip(keys, shapes)]


def _error(error) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"


def measure(row, iterations, peer) -> dict:
    import jax
    import jax.numpy as jnp

    import fa4_jax
    from fa4_jax.config import AttentionConfig
    from fa4_jax.kernels import host
    from fa4_jax.kernels.sm90 import tangent as sm90_tangent
    from fa4_jax.lowering import head_padding
    from fa4_jax.reference import reference_tangent

    q, k, v, t_q, t_k, t_v = _inputs(row)
    causal = row["causal"]
    record = dict(row, tangent_flops=tangent_flops(row))
    ours = jax.jit(lambda *a: jax.jvp(lambda q, k, v: fa4_jax.attention(q, k, v, causal=causal,
                                                                        implementation="cute"), a[:3], a[3:]))
    our_t_out = None
    try:
        (_, our_t_out), record["fa4_jax_jvp_ms"] = attention._median_ms(ours, (q, k, v, t_q, t_k, t_v), iterations)
    except Exception as error:
        record["fa4_jax_error"] = _error(error)
    forward = jax.jit(lambda q, k, v: fa4_jax.attention(q, k, v, causal=causal, return_lse=True, implementation="cute"))
    try:
        (out, lse), record["fa4_jax_forward_ms"] = attention._median_ms(forward, (q, k, v), iterations)
        config = AttentionConfig(scale=row["head_dim"] ** -0.5, causal=causal)
        padding = head_padding.plan(row["head_dim"], row["head_dim"],
                                    [(d, d) for d in sm90_tangent.SUPPORTED_HEAD_DIMS])
        record["tangent_kernel_head_dim"] = padding.kernel_head_dim
        run_kernel = functools.partial(sm90_tangent.run,
                                       sm90_tangent.options(config, padding.kernel_problem(host.Problem.of(q, k, v))))
        kernel = jax.jit(lambda *a: padding.tangent(run_kernel, *a, None, {}))
        _, ms = attention._median_ms(kernel, (q, k, v, out, lse, t_q, t_k, t_v), iterations)
        record["fa4_jax_tangent_kernel_ms"] = ms
        record["fa4_jax_tangent_kernel_tflops"] = tangent_flops(row) / (ms * 1e-3) / 1e12
        blocked = jax.jit(lambda *a: reference_tangent(*a, None, {}, config))
        _, record["reference_tangent_ms"] = attention._median_ms(blocked, (q, k, v, out, lse, t_q, t_k, t_v),
                                                                 max(3, iterations // 4))
    except Exception as error:
        record["fa4_jax_tangent_error"] = _error(error)
    if peer is not None:
        theirs = jax.jit(lambda *a: jax.jvp(lambda q, k, v: peer.flash_attn(q, k, v, causal=causal, backend="cute"),
                                            a[:3], a[3:]))
        try:
            (_, peer_t_out), record["fa4peer_jvp_ms"] = attention._median_ms(theirs, (q, k, v, t_q, t_k, t_v),
                                                                              iterations)
            if our_t_out is not None:
                record["max_abs_diff_vs_fa4peer"] = float(jnp.max(jnp.abs(
                    our_t_out.astype(jnp.float32) - peer_t_out.astype(jnp.float32))))
        except Exception as error:
            record["fa4peer_error"] = _error(error)
    if "fa4peer_jvp_ms" in record and "fa4_jax_jvp_ms" in record:
        record["speedup_vs_fa4peer"] = record["fa4peer_jvp_ms"] / record["fa4_jax_jvp_ms"]
    return record


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/tangent_h200.json")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--max-seconds", type=float, default=0.0, help="stop starting rows after this long")
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128],
                        help="head dims of the rows (others than 64 / 128 run the tangent kernel zero-padded)")
    args = parser.parse_args(argv)

    import jax

    peer, peer_version = None, None
    if not args.no_peer:
        try:
            import fa4peer as peer
            peer_version = getattr(peer, "__version__", "unknown")
        except Exception as error:
            print(f"fa4peer not importable: {_error(error)}")
    versions = attention._versions()
    versions["fa4peer"] = peer_version
    report = dict(device=jax.devices()[0].device_kind, date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  versions=versions, git_revision=attention.git_revision(), host=platform.node(), dtype="bfloat16",
                  timing="CUPTI kernel time of one call, median (jax.experimental.mosaic.gpu.profiler.measure)",
                  rows=[])
    attention.measure_rows(report, rows(args.quick, tuple(args.head_dims)),
                           lambda row: measure(row, args.iterations, peer), args.out, args.max_seconds)


if __name__ == "__main__":
    main()
