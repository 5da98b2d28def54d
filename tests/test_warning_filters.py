"""The kernels compile whatever warning filters the caller has set (pytest's `filterwarnings = error`,
`python -W error`, `warnings.simplefilter("error")`).

The DSL warns (DSLOptimizationWarning) about every static loop of 64 or more iterations, from inside a
bare `try/except` that turns any exception there into "range_constexpr() requires all arguments to be
Python integers": under warnings-as-errors our kernels failed to compile with that message (seen on
the H200: the sm90 forward with a softcap at D = 128, tests/test_sm90_tangent.py). Many of our loops
are that long (the softcap and row loops over a 128-wide tile, the D = 256 epilogues, every sm100
kernel's rows of 128 scores). A DeprecationWarning (a deprecated DSL name in a kernel) fails the same
way under "error", so the kernels use none.

Each case lowers `fa4_jax.attention` for CUDA on a pretended compute capability (the DSL compiles the
real kernels for sm_90a / sm_100a on this CPU) under `warnings.simplefilter("error")`, set after the
DSL has started (as a test's filter is, after an earlier test's compile), with the disk cache on (the
kernel compiles in `compile_cache.prepare`) and off (it compiles in `cutlass_call`'s own lowering).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("cutlass")  # the kernel modules need nvidia-cutlass-dsl (Linux only)
from ptx_checks import REPO  # noqa: E402

_LOWER = r"""
import json, re, sys, warnings
import jax, jax.numpy as jnp
import fa4_jax
from cutlass.cutlass_dsl import CuTeDSL
from fa4_jax.lowering import cuda

spec = json.loads(sys.argv[1])
cuda.compute_capability = lambda: tuple(spec["capability"])
CuTeDSL._get_dsl()   # the DSL starts (and adds its own filters) before the caller's filter below
warnings.simplefilter("error")

B, Sq, Sk, Hq, Hkv, D = spec["shape"]
query = jax.ShapeDtypeStruct((B, Sq, Hq, D), jnp.bfloat16)
key = jax.ShapeDtypeStruct((B, Sk, Hkv, D), jnp.bfloat16)
options = dict(spec["options"], implementation="cute")
kv_lengths = options.pop("kv_lengths", False)
if kv_lengths:   # a short query against a cache with key lengths: the decode kernel
    options["kv_seq_lengths"] = jnp.full((B,), Sk - 7, jnp.int32)
attention = lambda q, k, v: fa4_jax.attention(q, k, v, return_lse=True, **options)
loss = lambda q, k, v: attention(q, k, v)[0].astype(jnp.float32).sum()
functions = {"forward": attention, "decode": attention, "backward": jax.grad(loss, argnums=(0, 1, 2)),
             "tangent": lambda q, k, v: jax.jvp(attention, (q, k, v), (q, k, v))}
calls = {}
for name in spec["passes"]:
    text = jax.jit(functions[name]).trace(query, key, key).lower(lowering_platforms=("cuda",)).as_text()
    # fa4_jax_<arch>_<pass>: matched whole, since the embedded kernel binary may hold other (mangled)
    # strings that start with fa4_jax_ too.
    calls[name] = sorted({match for line in text.splitlines() if "stablehlo.custom_call" in line
                          for match in re.findall(r"fa4_jax_sm[0-9]+a?_([a-z]+)", line)})
print("LOWERED " + json.dumps(calls))
"""

# name -> (capability, CUTE_DSL_ARCH, [B, Sq, Sk, Hq, Hkv, D], attention options (kv_lengths: pass key
# lengths), passes lowered)
CASES = {
    # The H200 failure: the softcap loop over a 128-wide tile of scores, in the forward, the tangent
    # and the backward's recomputation of P.
    "sm90-d128-softcap": ((9, 0), "sm_90a", [1, 200, 300, 4, 2, 128], {"softcap": 5.0},
                          ("forward", "tangent", "backward")),
    # D = 256: the output rescale and epilogue loops over 64 columns.
    "sm90-d256-causal": ((9, 0), "sm_90a", [1, 200, 300, 4, 2, 256], {"causal": True}, ("forward",)),
    "sm90-d256-decode": ((9, 0), "sm_90a", [2, 2, 300, 8, 2, 256], {"causal": True, "kv_lengths": True},
                         ("decode",)),
    # Every sm100 kernel: its rows of 128 scores per thread.
    "sm100-d128-softcap": ((10, 0), "sm_100a", [1, 200, 300, 4, 2, 128], {"softcap": 5.0},
                           ("forward", "backward")),
}

# The kernel names in the custom calls each pass lowers to (fa4_jax_<arch>_<pass>...).
EXPECTED = {"forward": ["forward"], "decode": ["decode"], "tangent": ["forward", "tangent"], "backward": ["backward", "forward"]}


# Every case through the disk cache; one also without it (cutlass_call's own compile).
RUNS = [(name, True) for name in sorted(CASES)] + [("sm90-d128-softcap", False)]


@pytest.mark.parametrize("name, disk_cache", RUNS,
                         ids=[f"{name}-{'disk-cache' if cache else 'no-disk-cache'}" for name, cache in RUNS])
def test_kernels_compile_under_warnings_as_errors(tmp_path, name, disk_cache):
    capability, arch, shape, options, passes = CASES[name]
    environment = dict(os.environ, CUTE_DSL_ARCH=arch, FA4_JAX_CACHE_DIR=str(tmp_path) if disk_cache else "",
                       PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    environment.pop("CUTE_DSL_ENABLE_OPTIMIZATION_WARNINGS", None)
    spec = {"capability": capability, "shape": shape, "options": options, "passes": passes}
    process = subprocess.run([sys.executable, "-c", _LOWER, json.dumps(spec)], env=environment,
                             capture_output=True, text=True, timeout=900)
    assert process.returncode == 0, process.stderr[-4000:]
    line = next(line for line in process.stdout.splitlines() if line.startswith("LOWERED "))
    calls = json.loads(line[len("LOWERED "):])
    assert calls == {name: EXPECTED[name] for name in passes}, calls


def test_the_scope_ignores_only_the_dsl_optimization_warning_and_restores_the_filters():
    """Inside `dsl_warning_filters`, under the caller's "error": the DSL's optimization warning is not
    raised, any other warning still is; afterwards the caller's filters are back as they were."""
    import warnings

    from cutlass.base_dsl.ast_helpers import DSLOptimizationWarning

    from fa4_jax.kernels import host

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        before = list(warnings.filters)
        with host.dsl_warning_filters():
            warnings.warn(DSLOptimizationWarning("This static loop has 64 iterations"))
            with pytest.raises(UserWarning, match="not the DSL's"):
                warnings.warn("not the DSL's", UserWarning)
        assert warnings.filters == before
        with pytest.raises(DSLOptimizationWarning):
            warnings.warn(DSLOptimizationWarning("outside the scope"))
