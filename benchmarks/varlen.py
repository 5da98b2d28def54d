"""Packed variable-length forward benchmark: a batch of mixed-length sequences run packed (no padding)
against the same batch padded to its longest sequence.

Per row (bf16, self-attention per sequence: len_q = len_k, 16 query heads, GQA 16/4, D in {64, 128},
causal and not, one seeded draw of lengths per mix):
- packed_ms: fa4_jax.attention_varlen (implementation="cute": the sm90 forward kernel's packed scheduler)
  on the [T, H, D] packing;
- padded_ms: fa4_jax.attention on [N, max_len, H, D] with q_seq_lengths / kv_seq_lengths (our kernel,
  skipping the padding's key blocks but still walking its query tiles);
- cudnn_padded_ms: jax.nn.dot_product_attention(implementation="cudnn", query_seq_lengths=...,
  key_value_seq_lengths=...) on the same padded arrays (cuDNN's padded path).
Times are CUPTI kernel times of one call (all its kernels summed), median over --iterations
(jax.experimental.mosaic.gpu.profiler.measure). TFLOP/s count the useful work only (each sequence's
own L^2, halved when causal), so padding shows up as lost throughput. max_abs_diff_* compare the
packed output with each padded one on the real rows.

--backward times the gradient instead: each call's forward and backward (jax.vjp of q, k, v against one
fixed random output cotangent, padded with zeros for the padded calls), returning dq, which
max_abs_diff_* compare on the real rows; the useful FLOPs count the forward's two GEMMs and the
backward's five (3.5x the forward's).

Usage: python benchmarks/varlen.py --out benchmarks/results/varlen_h200.json [--quick] [--mixes NAME ...]
       [--backward]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks import attention  # noqa: E402  (CUPTI timing, versions, git revision)

Q_HEADS, KV_HEADS = 16, 4
# name -> (number of sequences, how their lengths are drawn): a seeded draw, so every run times the same batch.
MIXES = {
    # Pretraining-style documents: many lengths spread evenly up to 4k.
    "uniform-64-4096": (32, lambda rng, n: rng.integers(64, 4097, size=n)),
    # One long sequence among short ones: padding multiplies the short ones' work.
    "one-long-8192": (32, lambda rng, n: np.concatenate([[8192], rng.integers(64, 513, size=n - 1)])),
    # Chat / SFT-style: many short sequences, none a tile multiple.
    "short-16-1024": (128, lambda rng, n: rng.integers(16, 1025, size=n)),
}


def lengths_of(mix: str, seed: int = 0) -> np.ndarray:
    count, draw = MIXES[mix]
    return np.asarray(draw(np.random.default_rng(seed), count), dtype=np.int64)


def rows(quick: bool = False, mixes=None, backward: bool = False):
    head_dims = (128,) if quick else (64, 128)
    return [dict(mix=mix, q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=d, causal=c, backward=backward)
            for mix in (mixes or MIXES) for d in head_dims for c in (False, True)]


def useful_flops(lengths, q_heads: int, head_dim: int, causal: bool) -> float:
    """Q K^T and P V of each sequence against its own keys: 4 L^2 D per head, halved when causal."""
    flops = 4.0 * q_heads * head_dim * float(np.sum(np.asarray(lengths, dtype=np.float64) ** 2))
    return flops / 2 if causal else flops


def padding_index(lengths) -> tuple[np.ndarray, np.ndarray]:
    """(cu_seqlens int32 [N+1], index int64 [N, max_len]): packed token of each padded slot, -1 on padding."""
    lengths = np.asarray(lengths, dtype=np.int64)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    positions = np.arange(int(lengths.max()))
    index = np.where(positions[None, :] < lengths[:, None], cu[:-1, None] + positions[None, :], -1)
    return cu, index


def _inputs(lengths, row):
    import jax
    import jax.numpy as jnp

    total = int(np.sum(lengths))
    keys = jax.random.split(jax.random.key(0), 3)
    shapes = [(total, row["q_heads"], row["head_dim"])] + [(total, row["kv_heads"], row["head_dim"])] * 2
    return [jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16) for key, shape in zip(keys, shapes)]


def _gradient(function):
    """(q, k, v, extra, d_out) -> dq of `function(q, k, v, extra)` against the output cotangent d_out:
    its forward and backward passes, as training runs them."""
    import jax

    return lambda q, k, v, extra, d_out: jax.vjp(lambda q, k, v: function(q, k, v, extra), q, k, v)[1](d_out)[0]


def kernels_of(jitted, arguments) -> list:
    """The fa4_jax custom calls (`<arch>_<pass>`) that the jitted function lowers to on this device: a
    packed gradient that took the reference backward shows only the forward, so the report cannot pass a
    fallback off as the kernel."""
    text = jitted.trace(*arguments).lower().as_text()
    # Matched whole: the embedded kernel binary may hold other (mangled) strings starting with fa4_jax_.
    return sorted({match for line in text.splitlines() if "stablehlo.custom_call" in line
                   for match in re.findall(r"fa4_jax_(sm[0-9]+a?_[a-z]+)", line)})


def _error(error) -> str:
    return f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"


def measure(row, iterations) -> dict:
    import jax
    import jax.numpy as jnp

    import fa4_jax

    lengths = lengths_of(row["mix"])
    cu, index = padding_index(lengths)
    causal = row["causal"]
    backward = row.get("backward", False)
    record = dict(row, sequences=len(lengths), tokens=int(lengths.sum()), max_len=int(lengths.max()),
                  padded_tokens=int(index.size), useful_flops=useful_flops(lengths, row["q_heads"], row["head_dim"],
                                                                           causal) * (3.5 if backward else 1))
    q, k, v = _inputs(lengths, row)
    gather = jnp.asarray(np.maximum(index, 0))
    real = jnp.asarray(index >= 0)
    q_pad, k_pad, v_pad = (jnp.where(real[..., None, None], x[gather], 0).astype(x.dtype) for x in (q, k, v))
    seq_lengths = jnp.asarray(lengths, jnp.int32)
    cu = jnp.asarray(cu)
    outputs = {}
    functions = {
        "packed": (lambda q, k, v, cu: fa4_jax.attention_varlen(q, k, v, cu, cu, causal=causal, implementation="cute"),
                   (q, k, v, cu)),
        "padded": (lambda q, k, v, n: fa4_jax.attention(q, k, v, causal=causal, q_seq_lengths=n, kv_seq_lengths=n,
                                                        implementation="cute"), (q_pad, k_pad, v_pad, seq_lengths)),
        "cudnn_padded": (lambda q, k, v, n: jax.nn.dot_product_attention(
            q, k, v, is_causal=causal, query_seq_lengths=n, key_value_seq_lengths=n, implementation="cudnn"),
            (q_pad, k_pad, v_pad, seq_lengths)),
    }
    if backward:
        d_out = jax.random.normal(jax.random.key(1), q.shape, jnp.float32).astype(jnp.bfloat16)
        d_out_pad = jnp.where(real[..., None, None], d_out[gather], 0).astype(d_out.dtype)
        functions = {name: (_gradient(function), (*arguments, d_out if name == "packed" else d_out_pad))
                     for name, (function, arguments) in functions.items()}
    for name, (function, arguments) in functions.items():
        try:
            jitted = jax.jit(function)   # the function whose kernels are named is the one timed
            if name != "cudnn_padded":
                record[f"{name}_kernels"] = kernels_of(jitted, arguments)
            outputs[name], milliseconds = attention._median_ms(jitted, arguments, iterations)
        except Exception as error:  # one failing path must not hide the others
            record[f"{name}_error"] = _error(error)
            continue
        record[f"{name}_ms"] = milliseconds
        record[f"{name}_tflops"] = record["useful_flops"] / (milliseconds * 1e-3) / 1e12
    if "packed" in outputs:
        packed = outputs["packed"].astype(jnp.float32)
        for name in ("padded", "cudnn_padded"):
            if name in outputs:
                rows_of_padded = outputs[name].astype(jnp.float32)[real]   # [T, H, D] in packed order
                record[f"max_abs_diff_vs_{name}"] = float(jnp.max(jnp.abs(packed - rows_of_padded)))
                record[f"speedup_vs_{name}"] = record[f"{name}_ms"] / record["packed_ms"]
    return record


def parser() -> argparse.ArgumentParser:
    result = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    result.add_argument("--out", default="benchmarks/results/varlen_h200.json")
    result.add_argument("--iterations", type=int, default=20)
    result.add_argument("--quick", action="store_true", help="D = 128 only")
    result.add_argument("--mixes", nargs="+", choices=sorted(MIXES), default=None, help="length mixes (default: all)")
    result.add_argument("--max-seconds", type=float, default=0.0, help="stop starting rows after this long")
    result.add_argument("--backward", action="store_true", help="time forward + backward (the gradient)")
    return result


def main(argv=None):
    args = parser().parse_args(argv)

    import jax

    report = dict(device=jax.devices()[0].device_kind, date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
                  versions=attention._versions(), git_revision=attention.git_revision(), host=platform.node(),
                  dtype="bfloat16", mixes={mix: lengths_of(mix).tolist() for mix in (args.mixes or MIXES)},
                  timing="CUPTI kernel time of one call, median (jax.experimental.mosaic.gpu.profiler.measure)",
                  rows=[])
    attention.measure_rows(report, rows(args.quick, args.mixes, args.backward), lambda row: measure(row, args.iterations),
                           args.out, args.max_seconds)


if __name__ == "__main__":
    main()
