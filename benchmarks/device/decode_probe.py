"""Does the sm90 decode kernel (fa4_jax/kernels/sm90/decode.py) run? One small paged case under a few
option variants, each in its own process (a failed launch poisons the CUDA context of the process that
made it), all at once on one GPU; per variant: crashed or not (with the CUDA error), and the largest
error against `fa4_jax.paged_attention(implementation="reference")`.

The case is the one the first H200 runs were bisected on (tests/test_sm90_decode.py): batch 2, one new
token, 8 query / 2 key-value heads, D = 64, float16, pages of 64, 8 table entries, sinks, scale 0.3.

Variants:
  paged_attention   the public entry point, default options (what a user gets)
  splits1           decode.run, num_splits = 1
  stages2           decode.run, num_stages = 2
  tile64            decode.run, tile_n = 64 (16 keys per warp)
  no_keys           decode.run with every sequence length 0: no key block is loaded, so only the Q
                    cp.async and the partial O / LSE stores run (expected: out 0, lse = the sinks)
  d128_bf16         the benchmark's heads: batch 3, 32 / 8 heads, D = 128, bfloat16, pages of 16

Usage (device machine, repo root, `source .dev/cute/setup.sh` first):
  python benchmarks/device/decode_probe.py                  # all variants, < 90 s
  python benchmarks/device/decode_probe.py --only splits1,no_keys   # a subset
  python benchmarks/device/decode_probe.py --variant NAME   # one, in this process (what each child runs)
Output: one `VARIANT <name>: ...` line per variant, then `PROBE ok` when all ran and matched.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VARIANTS = ("paged_attention", "splits1", "stages2", "tile64", "no_keys", "d128_bf16")
OVERRIDES = {"splits1": {"num_splits": 1}, "stages2": {"num_stages": 2}, "tile64": {"tile_n": 64}}
# Rough bounds: the kernel and the reference round differently (the tests' tolerance is the oracle's).
OUT_TOLERANCE, LSE_TOLERANCE = 2e-2, 1e-3


def run_variant(name: str) -> dict:
    sys.path[:0] = [REPO, os.path.join(REPO, "tests")]
    import jax
    import jax.numpy as jnp
    import numpy as np

    import fa4_jax
    import paged_cases
    from fa4_jax import paged
    from fa4_jax.kernels.sm90 import decode

    if name == "d128_bf16":
        case = paged_cases.PagedCase(batch=3, q_len=1, q_heads=32, kv_heads=8, head_dim=128, block_size=16,
                                     max_blocks=40, dtype=jnp.bfloat16)
    else:
        case = paged_cases.PagedCase(batch=2, q_len=1, q_heads=8, kv_heads=2, head_dim=64, block_size=64,
                                     max_blocks=8, dtype=jnp.float16, sinks=True, scale=0.3)
    drawn = paged_cases.build(case, np.random.default_rng(0))
    query, key_cache, value_cache, tables, lengths = paged_cases.arguments(drawn)
    sinks = drawn["sinks"]
    scale = case.scale if case.scale is not None else case.head_dim ** -0.5
    no_keys = name == "no_keys"
    if no_keys:
        lengths = jnp.zeros_like(lengths)

    started = time.time()
    if name in ("paged_attention", "d128_bf16"):
        call = jax.jit(lambda *a: fa4_jax.paged_attention(*a[:5], sinks=a[5], scale=scale, implementation="cute",
                                                          return_lse=True))
        out, lse = call(query, key_cache, value_cache, tables, lengths, sinks)
    else:
        config = fa4_jax.AttentionConfig(scale=scale, causal=True, has_sinks=sinks is not None,
                                         has_kv_seq_lengths=True)
        options = decode.options(config, paged.paged_problem(query, key_cache, value_cache, tables),
                                 **OVERRIDES.get(name, {}))
        out, lse = jax.jit(lambda *a: decode.run(options, *a))(query, key_cache, value_cache, tables, lengths,
                                                                sinks)
    out = np.asarray(out.astype(jnp.float32))   # the sync: a kernel fault is raised here
    lse = np.asarray(lse)
    seconds = time.time() - started

    if no_keys:   # no key at all: the sinks hold all the mass
        expected_out = np.zeros_like(out)
        expected_lse = np.broadcast_to(np.asarray(sinks)[None, :, None], lse.shape)
    else:
        reference_out, reference_lse = fa4_jax.paged_attention(
            query, key_cache, value_cache, tables, lengths, sinks=sinks, scale=scale, implementation="reference",
            return_lse=True)
        expected_out = np.asarray(reference_out.astype(jnp.float32))
        expected_lse = np.asarray(reference_lse)
    finite = np.isfinite(expected_lse)
    return dict(
        nan=bool(np.isnan(out).any() or np.isnan(lse).any()),
        out_error=float(np.max(np.abs(out - expected_out))),
        lse_error=float(np.max(np.abs(np.where(finite, lse - expected_lse, 0.0)))),
        lse_infinities_match=bool(np.array_equal(np.isfinite(lse), finite)),
        seconds=round(seconds, 1))


def _verdict(result: dict) -> bool:
    return (not result["nan"] and result["out_error"] <= OUT_TOLERANCE and result["lse_error"] <= LSE_TOLERANCE
            and result["lse_infinities_match"])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", choices=VARIANTS, help="run one variant in this process")
    parser.add_argument("--only", help="comma-separated subset of the variants")
    parser.add_argument("--timeout", type=float, default=80.0, help="seconds per child")
    arguments = parser.parse_args()
    if arguments.variant:
        print("RESULT " + json.dumps(run_variant(arguments.variant)), flush=True)
        return

    environment = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", CUDA_LAUNCH_BLOCKING="1",
                       CUTE_DSL_ARCH=os.environ.get("CUTE_DSL_ARCH", "sm_90a"),
                       PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    children = {name: subprocess.Popen([sys.executable, os.path.abspath(__file__), "--variant", name],
                                       env=environment, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True)
                for name in (arguments.only.split(",") if arguments.only else VARIANTS)}
    deadline = time.time() + arguments.timeout
    all_ok = True
    for name, child in children.items():
        try:
            output, _ = child.communicate(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            child.kill()
            output, _ = child.communicate()
            print(f"VARIANT {name}: TIMEOUT after {arguments.timeout:.0f} s")
            all_ok = False
            continue
        lines = output.splitlines()
        result = next((json.loads(line[7:]) for line in lines if line.startswith("RESULT ")), None)
        if result is None:
            errors = [line for line in lines if "CUDA_ERROR" in line or "Error" in line or "error:" in line]
            print(f"VARIANT {name}: CRASH rc={child.returncode}: " + (errors[-1] if errors else "")[:400].strip())
            for line in lines[-15:]:
                print(f"    {name}| {line[:300]}")
            all_ok = False
            continue
        ok = _verdict(result)
        all_ok &= ok
        print(f"VARIANT {name}: {'ok' if ok else 'WRONG'} out_error={result['out_error']:.3g} "
              f"lse_error={result['lse_error']:.3g} nan={result['nan']} "
              f"lse_infinities_match={result['lse_infinities_match']} ({result['seconds']} s)")
    print("PROBE ok" if all_ok else "PROBE failed")
    sys.exit(0 if all_ok else 1)


if __name__ == "__main__":
    main()
