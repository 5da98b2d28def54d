"""Cold vs warm first-call time of fa4_jax.attention in a new process (the on-disk kernel cache).

Each measurement is a fresh Python process, so nothing of the previous one's memory survives:
  cold:     empty FA4_JAX_CACHE_DIR: the kernels are traced, compiled and written to disk
  warm:     the same directory again: the kernels are loaded from disk
  no-cache: FA4_JAX_CACHE_DIR="" (the cache turned off): what every new process paid without it
A process reports the wall time of its first jitted call (trace + lowering + kernel compile or load +
XLA compile + run) and of the second call, for the forward alone and for forward + gradient.

    python benchmarks/first_call.py --out first_call.json          # on the GPU
    python benchmarks/first_call.py --implementation reference     # the driver itself, on any machine
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

from attention import git_revision  # benchmarks/attention.py


def child(implementation: str, head_dim: int, causal: bool) -> dict:
    started = time.perf_counter()
    import jax
    import jax.numpy as jnp

    import fa4_jax

    imported = time.perf_counter()
    keys = jax.random.split(jax.random.key(int(time.time())), 3)
    shape = (2, 1024, 8, head_dim)
    query, key, value = (jax.random.normal(k, shape, jnp.bfloat16) for k in keys)

    def attention(q, k, v):
        return fa4_jax.attention(q, k, v, causal=causal, implementation=implementation)

    def loss(q, k, v):
        return jnp.sum(attention(q, k, v).astype(jnp.float32) ** 2)

    timings = {"import_s": imported - started}
    for name, function in (("forward", jax.jit(attention)), ("forward_and_grad", jax.jit(jax.grad(loss, (0, 1, 2))))):
        for call in ("first", "second"):
            begin = time.perf_counter()
            jax.block_until_ready(function(query, key, value))
            timings[f"{name}_{call}_call_s"] = time.perf_counter() - begin
    timings["device"] = jax.devices()[0].device_kind
    timings["jax_version"] = jax.__version__
    return timings


def run_child(arguments, cache_dir: str) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    environment = dict(os.environ, FA4_JAX_CACHE_DIR=cache_dir,
                       PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    command = [sys.executable, __file__, "--child", "--implementation", arguments.implementation,
               "--head-dim", str(arguments.head_dim)] + (["--causal"] if arguments.causal else [])
    completed = subprocess.run(command, env=environment, capture_output=True, text=True,
                               timeout=arguments.timeout)
    if completed.returncode != 0:
        raise RuntimeError(f"child failed ({completed.returncode}):\n{completed.stderr[-3000:]}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--implementation", default="cute", choices=("cute", "reference"))
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--out", default="first_call.json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    arguments = parser.parse_args()
    if arguments.child:
        print(json.dumps(child(arguments.implementation, arguments.head_dim, arguments.causal)))
        return

    runs = {}
    with tempfile.TemporaryDirectory(prefix="fa4_first_call_") as cache_dir:
        runs["cold"] = run_child(arguments, cache_dir)
        runs["cache_files_after_cold"] = len(os.listdir(cache_dir)) if os.path.isdir(cache_dir) else 0
        runs["warm"] = run_child(arguments, cache_dir)
    runs["no_cache"] = run_child(arguments, "")
    report = {
        "what": "wall time of the first and second jitted call in a new process (B=2, S=1024, H=8, bf16)",
        "implementation": arguments.implementation, "head_dim": arguments.head_dim, "causal": arguments.causal,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_revision": git_revision(),
        **runs,
    }
    with open(arguments.out, "w") as handle:
        json.dump(report, handle, indent=1)
    for mode in ("cold", "warm", "no_cache"):
        run = runs[mode]
        print(f"{mode:9s} forward first {run['forward_first_call_s']:6.2f} s second "
              f"{run['forward_second_call_s'] * 1e3:7.2f} ms | fwd+grad first {run['forward_and_grad_first_call_s']:6.2f} s "
              f"second {run['forward_and_grad_second_call_s'] * 1e3:7.2f} ms")


if __name__ == "__main__":
    main()
