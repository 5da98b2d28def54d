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


def test_variant_rows_get_the_candidates_of_their_head_dims(benchmark):
    """A candidate applies to the rows of its head dims only: D = 192 rows get the D = 192 candidate,
    MLA's 192/128 rows (other head dims) do not; causal rows of every head dim get the old tile order
    (all-pairs-order); each row's value is Dv wide."""
    pytest.importorskip("cutlass")
    shapes = {(benchmark.head_dims_of(shape), shape["causal"]): shape for shape in benchmark.variant_shapes()}
    assert benchmark.variants_for((192, 128), False) == ["default"]
    assert benchmark.variants_for((192, 128), True) == ["default", "all-pairs-order"]
    assert benchmark.variants_for((192, 192), False) == ["default", "d192-n112-pingpong"]
    assert benchmark.variants_for((128, 128), True) == ["default", "all-pairs-order"]
    assert benchmark.variants_for((64, 64), True)[-2:] == ["d64-causal-two-warpgroups", "d64-causal-three-warpgroups"]
    assert benchmark.variants_for((128, 128), False) == ["default"]
    assert benchmark.variants_for((256, 256), True) == ["default", "all-pairs-order"]
    assert benchmark.variants_for((256, 256), False) == ["default"]
    assert benchmark.variants_for((192, 128), True, excluded={"all-pairs-order": []}) == ["default"]
    mla = shapes[(192, 128), True]
    assert benchmark.input_shapes(mla) == ((mla["batch"], 2048, 10, 192),) * 2 + ((mla["batch"], 2048, 10, 128),)
    assert benchmark.forward_flops(mla) == 2 * mla["batch"] * 10 * 2048 ** 2 * (192 + 128) / 2


@pytest.mark.parametrize("flags, arch", [([], None), (["--variants"], "sm_90a"), (["--compile-only"], "sm_90a")])
def test_compile_target_is_pinned_only_for_the_sm90_variants(benchmark, monkeypatch, tmp_path, flags, arch):
    seen = []
    monkeypatch.setattr(benchmark, "run", lambda args: seen.append(benchmark.os.environ.get("CUTE_DSL_ARCH")))
    benchmark.main(["--out", str(tmp_path / "report.json"), *flags])
    assert seen == [arch]


def test_variant_rows_keep_their_timings_where_cudnn_cannot_run(benchmark, monkeypatch):
    """A row cuDNN refuses (MLA's Dv != D on a cuDNN without it) records why and still times and compares
    its variants, against the first default's output; the summary ranks them by time."""
    import jax.numpy as jnp

    def cudnn_attention(head_dim, v_head_dim, causal):
        raise NotImplementedError("no Dv != D here")
    times = iter([2.0, 1.5, 2.2])
    outputs = iter([jnp.zeros(3), jnp.full(3, 0.25), jnp.zeros(3)])
    monkeypatch.setattr(benchmark, "cudnn_attention", cudnn_attention)
    monkeypatch.setattr(benchmark, "variants_for", lambda head_dims, causal, excluded=(): ["default", "mla-n128"])
    monkeypatch.setattr(benchmark, "_variant_function", lambda shape, overrides: None)
    monkeypatch.setattr(benchmark, "_median_ms", lambda function, arguments, iterations: (next(outputs), next(times)))
    monkeypatch.setattr(benchmark, "sm90_forward_variants", lambda: {"default": ({}, None, None),
                                                                     "mla-n128": ({"key_block": 128}, None, None)})
    shape = dict(batch=2, seq_len=1024, heads=8, head_dim=192, v_head_dim=128, causal=False)
    args = type("Args", (), dict(iterations=3, excluded_variants=()))
    rows = benchmark.forward_variants_section(shape, None, args)
    assert [row["variant"] for row in rows] == ["default", "mla-n128", "default"]
    assert all(row["cudnn_error"].startswith("NotImplementedError") and "ratio_vs_cudnn" not in row for row in rows)
    assert [row["fa4_jax_ms"] for row in rows] == [2.0, 1.5, 2.2]
    assert rows[1]["max_abs_diff_vs_default"] == 0.25 and rows[2]["max_abs_diff_vs_default"] == 0.0
    summary = benchmark.variant_summary(rows)
    assert "best mla-n128 1.5000 ms" in summary and "default 2.0000 ms / 2.2000 ms" in summary
