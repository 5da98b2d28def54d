"""The on-disk kernel cache: a second process lowers the sm90 kernels from disk, not by compiling, and
a file is named after the kernel sources and the target architecture.

Lowering for the CUDA platform works on a CPU-only machine (the kernel compiles for sm_90a with the
DSL's own tools), so this runs in CI. Each process lowers one jitted call and prints the time and a
hash of the StableHLO (which embeds the kernel's object code).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types
import warnings

import pytest

pytest.importorskip("cutlass")  # the kernel modules need nvidia-cutlass-dsl (Linux only)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_LOWER = r"""
import hashlib, json, time
import jax, jax.numpy as jnp
from fa4_jax.config import AttentionConfig
from fa4_jax.kernels import host
from fa4_jax.kernels.sm90 import forward as sm90_forward
query = jax.ShapeDtypeStruct((1, 200, 2, 64), jnp.bfloat16)
config = AttentionConfig(scale=0.125, causal=True)
start = time.perf_counter()
options = sm90_forward.options(config, host.Problem.of(query, query, query))
lowered = jax.jit(lambda q, k, v: sm90_forward.run(options, q, k, v, {})).trace(
    query, query, query).lower(lowering_platforms=("cuda",))
print("LOWERED " + json.dumps({"seconds": time.perf_counter() - start,
                               "hlo": hashlib.sha256(lowered.as_text().encode()).hexdigest()}))
"""


def _lower_in_new_process(cache_directory, script=_LOWER):
    environment = dict(os.environ, FA4_JAX_CACHE_DIR=str(cache_directory), CUTE_DSL_ARCH="sm_90a",
                       PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    process = subprocess.run([sys.executable, "-c", script], env=environment, capture_output=True, text=True,
                             timeout=600)
    assert process.returncode == 0, process.stderr[-4000:]
    line = next(line for line in process.stdout.splitlines() if line.startswith("LOWERED "))
    return json.loads(line[len("LOWERED "):])


def test_second_process_loads_the_kernel_from_disk(tmp_path):
    cold = _lower_in_new_process(tmp_path)
    files = sorted(os.listdir(tmp_path))
    assert len(files) == 1 and files[0].endswith(".o")
    warm = _lower_in_new_process(tmp_path)
    assert sorted(os.listdir(tmp_path)) == files, "the warm process compiled again"
    assert warm["hlo"] == cold["hlo"], "the cached kernel differs from the compiled one"
    assert warm["seconds"] < cold["seconds"]


_LOWER_BACKWARD = r"""
import hashlib, json, time
import jax, jax.numpy as jnp
from fa4_jax.config import AttentionConfig
from fa4_jax.kernels import host
from fa4_jax.kernels.sm90 import backward as sm90_backward
query = jax.ShapeDtypeStruct((1, 200, 2, 64), jnp.bfloat16)
lse = jax.ShapeDtypeStruct((1, 2, 200), jnp.float32)
config = AttentionConfig(scale=0.125, causal=True, deterministic=True)
start = time.perf_counter()
options = sm90_backward.options(config, host.Problem.of(query, query, query))
lowered = jax.jit(lambda q, k, v, o, l, g: sm90_backward.run(options, q, k, v, o, l, g, None, {})).trace(
    query, query, query, query, lse, query).lower(lowering_platforms=("cuda",))
print("LOWERED " + json.dumps({"seconds": time.perf_counter() - start,
                               "hlo": hashlib.sha256(lowered.as_text().encode()).hexdigest()}))
"""


def test_aliased_outputs_load_from_disk(tmp_path):
    """The backward updates its dQ accumulator and dQ-order counters in place (input-output aliases):
    the cache keys and rebuilds those aliases, so a second process loads that kernel from disk too."""
    cold = _lower_in_new_process(tmp_path, _LOWER_BACKWARD)
    files = sorted(os.listdir(tmp_path))
    assert len(files) == 1 and files[0].endswith(".o")
    warm = _lower_in_new_process(tmp_path, _LOWER_BACKWARD)
    assert sorted(os.listdir(tmp_path)) == files, "the warm process compiled again"
    assert warm["hlo"] == cold["hlo"], "the cached kernel differs from the compiled one"
    assert warm["seconds"] < cold["seconds"]


def _name_with_sources(monkeypatch, directory):
    from fa4_jax.kernels import compile_cache

    spec = types.SimpleNamespace(in_args=("query",), out_args=("out",), input_tree="(*,)", output_tree="(*,)",
                                 input_output_aliases={})
    monkeypatch.setattr(compile_cache, "KERNEL_SOURCES", str(directory))
    return compile_cache._file_name(("fa4_jax_sm90_forward", "options"), spec)


def test_file_name_follows_the_kernel_sources(tmp_path, monkeypatch):
    """The same sources (another copy) give the same file; an edit to any of them, such as a shared
    building block, gives a new one."""
    from fa4_jax.kernels import compile_cache

    copy, edited = tmp_path / "copy", tmp_path / "edited"
    for directory in (copy, edited):
        shutil.copytree(compile_cache.KERNEL_SOURCES, directory, ignore=shutil.ignore_patterns("__pycache__"))
    with open(edited / "common" / "masking.py", "a") as handle:
        handle.write("# an edit\n")
    installed = _name_with_sources(monkeypatch, compile_cache.KERNEL_SOURCES)
    assert _name_with_sources(monkeypatch, copy) == installed
    assert _name_with_sources(monkeypatch, edited) != installed


def test_file_name_follows_the_target_arch(monkeypatch):
    from fa4_jax.kernels import compile_cache

    names = set()
    for arch in ("sm_90a", "sm_100a"):
        monkeypatch.setattr(compile_cache, "_target_arch", lambda: arch)
        names.add(_name_with_sources(monkeypatch, compile_cache.KERNEL_SOURCES))
    assert len(names) == 2


@pytest.fixture
def stub_compile(monkeypatch):
    """prepare() with the spec and file name stubbed and `get_or_compile_kernel` replaced by the
    fixture's `compile` attribute, so no kernel is traced."""
    from cutlass.jax import compile as cutlass_compile
    from fa4_jax.kernels import compile_cache

    monkeypatch.setattr(compile_cache, "_function_spec", lambda *arguments: "spec")
    monkeypatch.setattr(compile_cache, "_file_name", lambda compile_key, spec: "kernel.o")
    monkeypatch.setattr(compile_cache, "_reported", set())
    stub = types.SimpleNamespace(compile=None)
    monkeypatch.setattr(cutlass_compile, "get_or_compile_kernel",
                        lambda function, spec, compile_key: stub.compile())
    return stub


def test_a_kernel_compile_error_is_raised_not_reported_as_a_cache_problem(stub_compile, tmp_path, monkeypatch):
    from fa4_jax.kernels import compile_cache

    def fail():
        raise RuntimeError("the kernel does not compile")

    stub_compile.compile = fail
    monkeypatch.setenv("FA4_JAX_CACHE_DIR", str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError, match="does not compile"):
            compile_cache.prepare(None, (), (), ("test", "compile error"))
    assert os.listdir(tmp_path) == []


def test_an_unwritable_cache_warns_once_and_says_how_to_turn_it_off(stub_compile, tmp_path, monkeypatch):
    from fa4_jax.kernels import compile_cache

    stub_compile.compile = lambda: types.SimpleNamespace(module=b"object code")
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("FA4_JAX_CACHE_DIR", str(tmp_path / "file" / "kernels"))   # below a file
    with pytest.warns(UserWarning, match='skipped while saving the kernel.*FA4_JAX_CACHE_DIR="" turns'):
        compile_cache.prepare(None, (), (), ("test", "unwritable"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # the same failure again is not repeated
        compile_cache.prepare(None, (), (), ("test", "unwritable"))
