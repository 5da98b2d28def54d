"""benchmarks/attention.py on the CPU: its FLOP count, and the compile target it sets (only the sm90
variant sweep may pin it; the plain forward run must compile for the GPU it finds)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "attention.py"


@pytest.fixture
def benchmark(monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))   # main() puts the repository root on it
    monkeypatch.setenv("CUTE_DSL_ARCH", "")   # records the variable's state (maybe unset) for the undo
    monkeypatch.delenv("CUTE_DSL_ARCH")
    spec = importlib.util.spec_from_file_location("attention_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_forward_flops(benchmark):
    shape = dict(batch=4, seq_len=4096, heads=16, head_dim=128, causal=False)
    assert benchmark.forward_flops(shape) == 4 * 4 * 16 * 4096 * 4096 * 128
    assert benchmark.forward_flops(dict(shape, causal=True)) == 2 * 4 * 16 * 4096 * 4096 * 128


@pytest.mark.parametrize("flags, arch", [([], None), (["--variants"], "sm_90a"), (["--compile-only"], "sm_90a")])
def test_compile_target_is_pinned_only_for_the_sm90_variants(benchmark, monkeypatch, tmp_path, flags, arch):
    seen = []
    monkeypatch.setattr(benchmark, "run", lambda args: seen.append(benchmark.os.environ.get("CUTE_DSL_ARCH")))
    benchmark.main(["--out", str(tmp_path / "report.json"), *flags])
    assert seen == [arch]
