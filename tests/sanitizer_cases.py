"""Small calls of the CuTe kernels for compute-sanitizer (tests/test_sanitizer.py runs this file under it).

    compute-sanitizer --tool racecheck python tests/sanitizer_cases.py all      (or forward, backward)

Each case runs `fa4_jax.attention(implementation="cute")` once (forward, or forward and gradient) on
shapes small enough for the sanitizer, chosen to reach every code path that synchronises differently:
the default configuration of each head dim (three consumer warp groups at D = 64, the Q double buffer
and TMA-store epilogue at D = 128, ping-pong at D = 256; the backward's 80 query rows at D = 128 without a
mask), ragged tiles, GQA, masks that skip blocks,
the deterministic backward, and the large-head backward (D = 192, 256).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import fa4_jax  # noqa: E402

# (name, batch, q_len, kv_len, q_heads, kv_heads, head_dim, options)
FORWARD_CASES = [
    ("d64", 1, 200, 200, 2, 2, 64, {}),
    ("d64-causal-gqa", 1, 333, 257, 4, 2, 64, {"causal": True}),
    ("d128-causal", 2, 300, 300, 2, 1, 128, {"causal": True}),
    ("d128-window-lengths", 2, 257, 300, 2, 2, 128,
     {"window": (64, 0), "kv_seq_lengths": jnp.array([300, 130], jnp.int32)}),
    ("d96", 1, 200, 150, 2, 2, 96, {}),
    ("d192-causal", 1, 200, 200, 2, 2, 192, {"causal": True}),
    ("d256-causal", 1, 300, 300, 2, 2, 256, {"causal": True}),
    ("d256", 1, 150, 200, 2, 1, 256, {"softcap": 20.0}),
]
BACKWARD_CASES = [
    ("d64", 1, 200, 200, 2, 2, 64, {}),
    ("d64-causal-gqa", 1, 333, 257, 4, 2, 64, {"causal": True}),
    ("d128-causal", 1, 300, 300, 2, 1, 128, {"causal": True}),
    ("d128-gqa", 1, 300, 333, 4, 2, 128, {}),      # 80 query rows, dQ^T (full mask, unsplit)
    ("d128-deterministic", 1, 300, 300, 2, 2, 128, {"deterministic": True}),
    ("d128-causal-deterministic", 1, 257, 300, 2, 2, 128, {"causal": True, "deterministic": True}),
    ("d96-window", 1, 200, 200, 2, 2, 96, {"window": (64, 0)}),
    ("d192", 1, 200, 150, 2, 1, 192, {}),
    ("d256-causal-deterministic", 1, 257, 300, 2, 2, 256, {"causal": True, "deterministic": True}),
    # Rotated turns (the large-head deterministic default without a mask): the arrival-order dQ adds.
    ("d192-deterministic", 1, 200, 300, 2, 2, 192, {"deterministic": True}),
    ("d256-deterministic-gqa", 1, 130, 333, 4, 2, 256, {"deterministic": True}),
]


def cases_of(kind: str) -> list:
    """(kind, case) pairs: "forward", "backward", or "all" (every case, forward first, in one process:
    state one kernel leaves in shared memory or in the allocator meets the next)."""
    kinds = ("forward", "backward") if kind == "all" else (kind,)
    return [(each, case) for each in kinds for case in (FORWARD_CASES if each == "forward" else BACKWARD_CASES)]


def run(kind: str, names=None) -> None:
    cases = cases_of(kind)
    keys = iter(jax.random.split(jax.random.key(0), 4 * len(cases)))
    for side, (name, batch, q_len, kv_len, q_heads, kv_heads, head_dim, options) in cases:
        if names and name not in names:
            continue
        query = jax.random.normal(next(keys), (batch, q_len, q_heads, head_dim), jnp.bfloat16)
        key = jax.random.normal(next(keys), (batch, kv_len, kv_heads, head_dim), jnp.bfloat16)
        value = jax.random.normal(next(keys), (batch, kv_len, kv_heads, head_dim), jnp.bfloat16)

        def attention(q, k, v):
            return fa4_jax.attention(q, k, v, implementation="cute", **options)

        if side == "forward":
            result = jax.jit(attention)(query, key, value)
        else:
            loss = lambda q, k, v: jnp.sum(attention(q, k, v).astype(jnp.float32) ** 2)  # noqa: E731
            result = jax.jit(jax.grad(loss, (0, 1, 2)))(query, key, value)
        jax.block_until_ready(result)
        print(f"{side} {name}: ran", flush=True)


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2:])
