"""benchmarks/attention_backward.py on the CPU: which variants a pytest log lets it time, which head
dims each variant runs at, and which kernel module (with which Tuning) a row and the report name. A
candidate whose GPU tests failed, or did not finish, must not be timed: a turn order that deadlocks
would hang the device call, a wrong one would be measured."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import pathlib
import sys

import pytest

pytest.importorskip("cutlass")  # the benchmark reads the kernel modules' tuning tables
from fa4_jax.kernels import host  # noqa: E402

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "attention_backward.py"
SHIPPED = ["default", "deterministic"]
# The kernel before head splits, forced: shipped code, timed without a test log's say.
UNSPLIT = ["head_splits_1", "deterministic_head_splits_1"]


@pytest.fixture(scope="module")
def benchmark():
    # The script puts benchmarks/ on sys.path and defaults CUTE_DSL_ARCH at import; both are put
    # back afterwards for the rest of the session (benchmarks/attention.py is imported by then).
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "path", list(sys.path))
        patch.setenv("CUTE_DSL_ARCH", "")   # records the variable's state (maybe unset) for the undo
        patch.delenv("CUTE_DSL_ARCH")
        spec = importlib.util.spec_from_file_location("attention_backward", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        patch.setitem(sys.modules, spec.name, module)   # @dataclass looks its module up there
        spec.loader.exec_module(module)
    return module


def _kept(benchmark, tmp_path, log):
    path = tmp_path / "gpu_tests.log"
    path.write_text(log)
    return benchmark.variants_passing(str(path))


SMALL = "tests/test_sm90_backward.py::test_backward_matches_oracle"
LARGE = "tests/test_sm90_backward_large_heads.py::test_backward_matches_oracle"


def test_finished_rA_log_keeps_candidates_whose_tests_all_passed(benchmark, tmp_path):
    log = f"""....F.
=========================== short test summary info ============================
PASSED {SMALL}[poly_exp2_6-plain]
PASSED {SMALL}[default-plain]
PASSED {LARGE}[no_stagger-plain-d256]
PASSED {LARGE}[no_stagger-causal-cross-d192]
PASSED {LARGE}[lowest_first-plain-d256]
FAILED {LARGE}[lowest_first-causal-d256] - AssertionError: dq off
1 failed, 5 passed in 12.34s
"""
    assert _kept(benchmark, tmp_path, log) == [*SHIPPED, "poly_exp2_6", "no_stagger", *UNSPLIT]


def test_verbose_xdist_log(benchmark, tmp_path):
    log = f"""[gw0] [ 33%] PASSED {LARGE}[lowest_first-plain-d256]
[gw1] [ 66%] PASSED {LARGE}[no_stagger-plain-d256]
[gw0] [100%] ERROR {LARGE}[no_stagger-gqa-long-d256]
=================== 2 passed, 1 error in 30.10s (0:00:30) ====================
pytest rc=1
"""
    assert _kept(benchmark, tmp_path, log) == [*SHIPPED, "deterministic_lowest_first", *UNSPLIT]


def test_run_cut_short_keeps_only_the_shipped_variants(benchmark, tmp_path):
    log = f"""PASSED {SMALL}[poly_exp2_6-plain]
[gw0] [ 50%] PASSED {LARGE}[no_stagger-plain-d256]
pytest rc=124
"""
    assert _kept(benchmark, tmp_path, log) == [*SHIPPED, *UNSPLIT]


def test_an_id_counts_only_in_its_own_test_file(benchmark, tmp_path):
    log = f"""PASSED {SMALL}[no_stagger-plain]
PASSED {LARGE}[poly_exp2_6-plain-d256]
2 passed in 1.00s
"""
    assert _kept(benchmark, tmp_path, log) == [*SHIPPED, *UNSPLIT]


def test_a_candidate_may_be_named_by_its_test_function(benchmark, tmp_path):
    """deterministic_one_dq_writer is tested by test_two_dq_writers_match_one_bit_for_bit, whose
    parameter ids name shapes, not the variant."""
    test = "tests/test_sm90_backward.py::test_two_dq_writers_match_one_bit_for_bit"
    log = f"""[gw0] [ 50%] PASSED {test}[plain-d64-tiled-dq]
[gw1] [100%] PASSED {test}[causal-cross-one-split]
2 passed in 5.00s
"""
    assert _kept(benchmark, tmp_path, log) == [*SHIPPED, *UNSPLIT[:1], "deterministic_one_dq_writer", *UNSPLIT[1:]]
    failed = log.replace("PASSED", "FAILED", 1).replace("2 passed", "1 failed, 1 passed")
    assert _kept(benchmark, tmp_path, failed) == [*SHIPPED, *UNSPLIT]


@pytest.mark.parametrize("head_dim", [64, 96, 128, 192, 256])
def test_each_variant_runs_at_its_kernels_head_dims(benchmark, head_dim):
    shape = dict(batch=1, seq_len=1024, heads=8, head_dim=head_dim, causal=False)
    runs = [name for name, variant in benchmark._variants().items() if variant.skip_reason(shape) is None]
    if head_dim in (64, 96, 128):
        # MHA: no split divides a group of 1; 64 query rows forced at D = 64 only.
        wide = ["query_rows_64", "deterministic_query_rows_64", "dq_column_split", "deterministic_dq_column_split"] \
            if head_dim == 64 else []
        # 80 query rows (dQ^T) forced at D = 128 only; 64 forced at D = 128 too (80 its default without a mask).
        if head_dim == 128:
            wide = ["query_rows_80", "query_rows_64", "deterministic_query_rows_64"]
        # Every 4th exp2 on the FMA pipe spills at D = 64's 128 rows: every 6th only there.
        poly = ["poly_exp2_6"] if head_dim == 64 else ["poly_exp2_4", "poly_exp2_6"]
        rotated = ["deterministic_plain_turns", "deterministic_one_dq_writer"]   # a full mask, 8 key blocks
        assert runs == [*SHIPPED, "ds_store_first", "deterministic_ds_store_first", "row_stats_early",
                        "deterministic_row_stats_early", "dq_publish_after_dk", "deterministic_dq_publish_after_dk",
                        *poly, *UNSPLIT[:1], "tiled_dq", "deterministic_tiled_dq", "ds_plain_store",
                        "deterministic_ds_plain_store", *rotated, *wide, *UNSPLIT[1:], "key_blocks_outer",
                        "key_blocks_outer_head_splits_1"]
    else:
        # D = 192's former two-warp-group layout, for comparison, and its candidates.
        candidates = ["prefetch_query", "deterministic_prefetch_query", "one_query_stage",
                      "deterministic_one_query_stage"]
        three = ["two_warpgroups", "deterministic_two_warpgroups", *candidates] if head_dim == 192 else []
        assert runs == [*SHIPPED, "large_dq_publish_after_dk", "deterministic_large_dq_publish_after_dk", "no_stagger", "deterministic_lowest_first", "deterministic_large_plain_turns", *three]
    dims = (1, 1024, 8, head_dim)
    assert all(benchmark._variants()[name].kernel_at(head_dim)[0].unsupported_reason(
        benchmark._config(shape), host.Problem(dims, dims, dims, "bfloat16")) is None for name in runs)


def test_shipped_variants_name_the_kernel_that_runs_at_each_head_dim(benchmark):
    """The routing table sends D 192 / 256 to the large-head kernel, which runs with its own default
    Tuning: the rows and the report's `variants` must say so, not label them sm90_backward."""
    from fa4_jax.kernels.sm90 import backward as sm90_backward
    from fa4_jax.kernels.sm90 import backward_large_heads as sm90_backward_large_heads

    for name in SHIPPED:
        variant = benchmark._variants()[name]
        assert {head_dim: variant.kernel_at(head_dim) for head_dim in (64, 96, 128, 192, 256)} == {
            **{head_dim: (sm90_backward, sm90_backward.DEFAULT_TUNING) for head_dim in (64, 96, 128)},
            **{head_dim: (sm90_backward_large_heads, sm90_backward_large_heads.DEFAULT_TUNING)
               for head_dim in (192, 256)}}
        assert json.loads(json.dumps(variant.kernels())) == {
            "sm90_backward": dict(head_dims=[64, 96, 128], **dataclasses.asdict(sm90_backward.DEFAULT_TUNING)),
            "sm90_backward_large_heads": dict(head_dims=[192, 256],
                                              **dataclasses.asdict(sm90_backward_large_heads.DEFAULT_TUNING))}


def test_a_candidate_reaches_only_its_own_kernel(benchmark):
    variants = benchmark._variants()
    assert list(variants["poly_exp2_6"].kernels()) == ["sm90_backward"]
    assert variants["poly_exp2_6"].kernels()["sm90_backward"]["poly_exp2_every"] == 6
    assert list(variants["deterministic_lowest_first"].kernels()) == ["sm90_backward_large_heads"]
    assert variants["deterministic_lowest_first"].kernels()["sm90_backward_large_heads"]["diagonal_first"] is False


def test_head_split_variants_run_where_they_divide_the_group(benchmark):
    """--shapes gqa: each forced split times the rows whose group it divides and records the others
    skipped; the head-split variants count as tested only by their own split's GPU tests."""
    variants = benchmark._variants()
    groups = {(shape["heads"] // shape["kv_heads"]) for shape in benchmark.GQA_SHAPES}
    assert groups == {4, 8, 16}
    for shape in benchmark.GQA_SHAPES:
        group = shape["heads"] // shape["kv_heads"]
        assert benchmark._fallback_reason(shape) is None
        for splits in benchmark.HEAD_SPLITS:
            reason = variants[f"head_splits_{splits}"].skip_reason(shape)
            assert (reason is None) == (group % splits == 0), (shape, splits, reason)
    assert variants["head_splits_4"].tested_by == ("test_sm90_backward.py", "split4")
    assert variants["head_splits_1"].tested_by is None


def test_a_head_split_log_keeps_its_split(benchmark, tmp_path):
    log = f"""PASSED {SMALL.replace("backward_matches", "head_splits_match")}[split4-gqa4-causal]
PASSED tests/test_sm90_backward.py::test_deterministic_head_splits_match_oracle[split2-gqa4-causal]
FAILED tests/test_sm90_backward.py::test_head_splits_match_oracle[split8-mqa8-d64] - AssertionError
2 passed, 1 failed in 9.00s
"""
    kept = _kept(benchmark, tmp_path, log)
    assert "head_splits_4" in kept and "head_splits_2" in kept
    assert "head_splits_8" not in kept and "head_splits_16" not in kept


@pytest.mark.parametrize("name, head_dim, fits, too_long", [
    ("deterministic_plain_turns", 128, 8192, 16384),
    # The large-head kernel: 64 keys a CTA at D = 256, 96 at D = 192 (three warp groups), so up to 4k / 6k.
    ("deterministic_large_plain_turns", 256, 4096, 8192), ("deterministic_large_plain_turns", 192, 6144, 8192)])
def test_rotated_turn_variants_skip_the_rows_where_they_resolve_off(benchmark, name, head_dim, fits, too_long):
    """A row where `options` resolves `rotated_turns` off (a causal mask; more key blocks than half the SMs)
    runs the shipped kernel: a variant that differs from it in that choice alone skips the row with the
    reason, rather than time the shipped kernel under its name."""
    variant = benchmark._variants()[name]
    shape = dict(batch=1, seq_len=fits, heads=8, head_dim=head_dim, causal=False)
    assert variant.skip_reason(shape) is None
    assert "full" in variant.skip_reason(dict(shape, causal=True))
    assert "resident" in variant.skip_reason(dict(shape, seq_len=too_long))


def test_mla_rows_take_value_dims_of_their_own(benchmark):
    """--shapes mla: D192_SHAPES at Dv = 128; V, O and dO are 128 wide, the large-head kernel takes the rows
    unpadded, and the FLOPs count P V at Dv."""
    assert [dict(shape, v_head_dim=None) for shape in benchmark.MLA_SHAPES] == [
        dict(shape, v_head_dim=None) for shape in benchmark.D192_SHAPES]
    for shape in benchmark.MLA_SHAPES:
        batch, length, heads = shape["batch"], shape["seq_len"], shape["heads"]
        assert benchmark._value_dims(shape) == (batch, length, heads, 128)
        assert benchmark._out_dims(shape) == (batch, length, heads, 128)
        assert benchmark._key_dims(shape) == (batch, length, heads, 192)
        assert benchmark._fallback_reason(shape) is None
        assert benchmark.backward_flops(shape) == benchmark.backward_flops(dict(shape, v_head_dim=None)) * 320 / 384
    row = dict(benchmark.MLA_SHAPES[0], section="backward", fa4_jax_backward="sm90_backward_large_heads")
    assert benchmark._summary(row, ["default"]).startswith("D=192/128 causal=1")
    assert benchmark._variants()["prefetch_query"].skip_reason(benchmark.MLA_SHAPES[0]) is None
