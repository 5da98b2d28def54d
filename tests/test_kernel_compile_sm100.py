"""CPU-only: compile the Blackwell forward kernel for sm_100a with fake tensors and inspect its PTX.

No Blackwell GPU is reachable, so this is what proves the FA4 design is real: the PTX must allocate
and free tensor memory (`tcgen05.alloc` / `tcgen05.dealloc`), issue 5th-generation MMAs from one
elected thread (`tcgen05.mma`), read S and O from TMEM and write P back into it (`tcgen05.ld`,
`tcgen05.st`), signal MMA completion on mbarriers (`tcgen05.commit ... mbarrier::arrive`), move tiles
with TMA (`cp.async.bulk.tensor`), exponentiate both on MUFU (`ex2.approx`) and with the shared
polynomial on the FMA pipe, split registers per role (`setmaxnreg`), and use no local memory; ptxas,
where installed, must report no spills (a few bytes are tolerated with a sliding window, see
`spill_allowance`). The numerics of the shared blocks are tested on the H200 through
the sm90 kernel (docs/blackwell.md lists which tests cover which block). Every kernel the selected
tests check compiles in one subprocess (the `compiled` fixture); each test checks its own.
"""

from __future__ import annotations

import json
import os
import re

import pytest

import ptx_checks
from fa4_jax.config import AttentionConfig
pytest.importorskip("cutlass")  # the kernel modules need nvidia-cutlass-dsl (Linux only)
from fa4_jax.kernels import host  # noqa: E402
from fa4_jax.kernels.sm100 import forward as sm100_forward  # noqa: E402
from tools import sm100_inspect  # noqa: E402


# Representative configurations, compiled in CI: every head dim, causal, GQA, fp16 and each feature.
CASES = {
    # (These two are also GRID rows, which the batch then compiles once for both.)
    "d64-causal-gqa-fp16": dict(config=dict(scale=0.125, causal=True), shape=[2, 1000, 1200, 8, 2, 64],
                                dtype="float16"),
    "d96-gqa": sm100_inspect.REPORT_SPECS["d96"],
    "d192-causal-softcap-sinks": dict(
        config=dict(scale=192 ** -0.5, causal=True, softcap=30.0, has_sinks=True),
        shape=[1, 777, 900, 4, 4, 192]),
    "d256-segments-lengths": dict(
        config=dict(scale=256 ** -0.5, has_segment_ids=True, has_q_seq_lengths=True,
                    has_kv_seq_lengths=True),
        shape=[2, 300, 500, 4, 1, 256]),
    "d128-window-sharded-query": dict(
        config=dict(scale=128 ** -0.5, causal=True, window_left=256, has_q_start=True, q_total=2048),
        shape=[1, 512, 2048, 4, 4, 128]),
}


def spill_allowance(spec: dict) -> int:
    """ptxas spill-store bytes tolerated: 0, except with a sliding window at 128-key blocks (head dim
    <= 128), where ptxas 13.0 spills 4-24 bytes of loop state around the softmax's masked path."""
    config = spec["config"]
    windowed = config.get("window_left") is not None or config.get("window_right") is not None
    return 32 if windowed and spec["shape"][-1] <= 128 else 0


SMEM_CAPACITY = 227 * 1024


def check_kernel(name: str, spec: dict, compiled: dict):
    ptx = compiled["ptx"]
    config = spec["config"]
    assert ".target sm_100a" in ptx
    counts = sm100_inspect.instruction_counts(ptx)
    assert counts["tcgen05.alloc"] == 1 and counts["tcgen05.dealloc"] == 1, counts
    assert re.search(r"tcgen05\.relinquish_alloc_permit", ptx), "TMEM allocation permit never given back"
    assert counts["tcgen05.mma"] >= 2, "no tensor-core tcgen05.mma (QK^T and PV)"
    assert re.search(r"tcgen05\.mma\.[^\n]*\[%r\d+\], %rd\d+, %rd\d+", ptx), "no Q K^T MMA from smem"
    assert re.search(r"tcgen05\.mma\.[^\n]*\[%r\d+\], \[%r\d+\], %rd\d+", ptx), "no PV MMA with P from TMEM"
    assert sm100_inspect.issued_by_one_thread(ptx), "tcgen05.mma/commit or TMA not issued by one thread"
    assert counts["tcgen05.ld"] > 0, "S / O never read from TMEM"
    assert counts["tcgen05.st"] > 0, "P never written into TMEM"
    assert counts["tcgen05.commit.mbarrier"] > 0, "MMA completion never signalled on an mbarrier"
    assert re.search(r"cp\.async\.bulk\.tensor\.[^\n]*shared::(cta|cluster)\.global", ptx), "no TMA loads"
    assert re.search(r"cp\.async\.bulk\.tensor\.[^\n]*global\.shared::cta", ptx), "no TMA store of O"
    assert counts["ex2.approx"] > 0, "no MUFU exp2"
    if not config.get("has_segment_ids"):
        # Segments make every block partial, and partial blocks exponentiate on MUFU only.
        assert counts["exp2 polynomial"] > 0, "no FMA-pipe polynomial exp2 next to ex2.approx"
    assert re.search(r"setmaxnreg\.inc", ptx) and re.search(r"setmaxnreg\.dec", ptx)
    assert not sm100_inspect.uses_local_memory(ptx), "local memory in the PTX"

    layout = compiled["layout"]
    head_dim = spec["shape"][-1]
    assert layout["tmem_columns_used"] <= layout["tmem_columns_allocated"] <= 512
    assert layout["query_tiles_per_cta"] == (2 if head_dim <= 192 else 1)
    assert layout["kv_stages"] >= 2
    assert layout["shared_memory_bytes"] <= SMEM_CAPACITY

    resources = sm100_inspect.ptxas_resources(compiled["ptx_path"])
    if resources is not None:
        assert resources["spill_store_bytes"] <= spill_allowance(spec), (name, resources)


@pytest.mark.parametrize("name", sorted(CASES))
def test_compiles_to_the_fa4_design(compiled, name):
    check_kernel(name, CASES[name], compiled.record(f"CASES.{name}"))


# Exhaustive: head dims x causal x GQA in bf16, fp16 once per head dim (causal GQA: the dtype changes the
# element type alone, and CI's time is better spent on the paths), plus each head dim with the feature paths.
# Lengths off the tiles (1000 x 1200) everywhere but the bf16 GQA rows, which are the compile report's
# configurations (REPORT_SPECS, 2048 x 2048), so a batch with both compiles them once.
FEATURES = {
    "window-softcap-sinks": dict(window_left=300, window_right=20, softcap=30.0, has_sinks=True),
    "segments-lengths-causal": dict(causal=True, has_segment_ids=True, has_q_seq_lengths=True,
                                    has_kv_seq_lengths=True),
    "sharded-query-causal": dict(causal=True, has_q_start=True, q_total=4000),
}
GRID = {
    head_dim: {
        **{f"d{head_dim}-{'causal' if causal else 'full'}-{'gqa' if group > 1 else 'mha'}-{dtype}":
           sm100_inspect.REPORT_SPECS[f"d{head_dim}{'-causal' if causal else ''}"]
           if group > 1 and dtype == "bfloat16" else
           dict(config=dict(scale=head_dim ** -0.5, causal=causal),
                shape=[2, 1000, 1200, 8, 8 // group, head_dim], dtype=dtype)
           for causal in (False, True) for group in (1, 4) for dtype in ("bfloat16", "float16")
           if dtype == "bfloat16" or (causal and group > 1)},
        **{f"d{head_dim}-{feature}": dict(config=dict(scale=head_dim ** -0.5, **config),
                                          shape=[2, 1000, 4000, 8, 2, head_dim])
           for feature, config in FEATURES.items()},
    }
    for head_dim in sm100_forward.SUPPORTED_HEAD_DIMS
}


# The report's configuration the quick test compares (the slow one compares them all).
QUICK_REPORT = ["d128-causal"]


@pytest.fixture(scope="module")
def compiled(request, tmp_path_factory):
    """What the selected tests check, compiled in one subprocess: "CASES.<name>", "GRID.<name>" (every
    head dim a selected grid test takes) and "REPORT.<name>" (REPORT_SPECS)."""
    specs = {f"CASES.{name}": CASES[name] for name in ptx_checks.selected(request, "name")}
    for head_dim in ptx_checks.selected(request, "head_dim"):
        specs.update({f"GRID.{name}": spec for name, spec in GRID[head_dim].items()})
    tests = ptx_checks.selected_tests(request)
    report = sm100_inspect.REPORT_SPECS if "test_whole_report_is_current" in tests else \
        QUICK_REPORT if "test_report_is_current" in tests else []
    specs.update({f"REPORT.{name}": sm100_inspect.REPORT_SPECS[name] for name in report})
    return ptx_checks.CompiledBatch(sm100_inspect.compile_kernels(
        dict(sorted(specs.items())), str(tmp_path_factory.mktemp("sm100_forward_ptx")), keep_going=True))


@pytest.mark.slow
@pytest.mark.parametrize("head_dim", sm100_forward.SUPPORTED_HEAD_DIMS)
def test_grid_compiles(compiled, head_dim):
    for name, spec in GRID[head_dim].items():
        check_kernel(name, spec, compiled.record(f"GRID.{name}"))


def _committed_report():
    with open(sm100_inspect.REPORT_PATH) as handle:
        return json.load(handle)


def _report(compiled, names) -> dict:
    return sm100_inspect.report_of({name: compiled.record(f"REPORT.{name}") for name in names})


def _assert_matches(fresh: dict, committed: dict):
    for name, record in fresh["configs"].items():
        expected = committed["configs"][name]
        if "registers_at_launch" not in record:  # no ptxas here: compare what the DSL reports
            expected = {key: value for key, value in expected.items() if key in record}
        assert record == expected, (
            f"{name}: the committed sm100 compile report is stale; run "
            "`python benchmarks/sm100_report.py` and commit the JSON")


def test_report_is_current(compiled):
    """benchmarks/results/sm100_compile_report.json matches what the sources compile to now (one
    configuration here; all of them in the slow test)."""
    committed = _committed_report()
    assert sorted(committed["configs"]) == sorted(sm100_inspect.REPORT_SPECS)
    for name, record in committed["configs"].items():
        assert record["spec"] == sm100_inspect.REPORT_SPECS[name]
        assert record["tmem_columns_used"] <= 512 and record["shared_memory_bytes"] <= SMEM_CAPACITY
        assert record["tcgen05_and_tma_issued_by_one_thread"] and not record["local_memory"]
    _assert_matches(_report(compiled, QUICK_REPORT), committed)


@pytest.mark.slow
def test_whole_report_is_current(compiled):
    _assert_matches(_report(compiled, sm100_inspect.REPORT_SPECS), _committed_report())


@pytest.mark.parametrize("shapes, dtype, config, fragment", [
    (((1, 128, 4, 64), (1, 128, 4, 64), (1, 128, 4, 64)), "float32", {}, "bfloat16 or float16"),
    (((1, 128, 4, 80), (1, 128, 4, 80), (1, 128, 4, 80)), "bfloat16", {}, "head dims"),
    (((1, 128, 4, 128), (1, 128, 4, 128), (1, 128, 4, 64)), "bfloat16", {}, "value head dim"),
    (((1, 128, 6, 128), (1, 128, 4, 128), (1, 128, 4, 128)), "bfloat16", {}, "multiple"),
    (((1, 0, 4, 128), (1, 128, 4, 128), (1, 128, 4, 128)), "bfloat16", {}, "non-empty"),
    (((1, 128, 4, 128), (1, 128, 4, 128), (1, 128, 4, 128)), "bfloat16",
     dict(has_q_start=True, q_total=256, has_segment_ids=True), "q_start"),
    (((1, 128, 4, 128), (1, 256, 4, 128), (1, 256, 4, 128)), "bfloat16",
     dict(causal=True, has_q_start=True, q_total=256), "q_start) is not yet verified"),
])
def test_unsupported_reason_names_the_problem(shapes, dtype, config, fragment):
    reason = sm100_forward.unsupported_reason(AttentionConfig(scale=0.1, **config), host.Problem(*shapes, dtype))
    assert reason is not None and fragment in reason


def test_supported_configs_build_kernel_options():
    shapes = ((2, 1000, 16, 128), (2, 1200, 4, 128), (2, 1200, 4, 128))
    config = AttentionConfig(scale=0.1, causal=True, window_left=64, softcap=5.0, has_sinks=True,
                             has_segment_ids=True, has_q_seq_lengths=True, has_kv_seq_lengths=True)
    problem = host.Problem(*shapes, "bfloat16")
    assert sm100_forward.unsupported_reason(config, problem) is None
    options = sm100_forward.options(config, problem, sm_count=148)
    assert options.group == 4 and options.mask.causal and options.mask.has_segments
    kernel = sm100_forward.Sm100ForwardKernel(options)
    assert kernel.tmem_columns_used <= 512 and kernel.q_stage == 2
    assert hash(options) == hash(sm100_forward.options(config, problem, sm_count=148))


_LOWER = r"""
import json
import jax, jax.numpy as jnp
from fa4_jax.config import AttentionConfig
from fa4_jax.kernels import host
from fa4_jax.kernels.sm100 import forward as sm100_forward
query = jax.ShapeDtypeStruct((1, 200, 4, 128), jnp.bfloat16)
key = jax.ShapeDtypeStruct((1, 300, 2, 128), jnp.bfloat16)
sinks = jax.ShapeDtypeStruct((4,), jnp.float32)
lengths = jax.ShapeDtypeStruct((1,), jnp.int32)
config = AttentionConfig(scale=0.125, causal=True, has_sinks=True, has_kv_seq_lengths=True)
options = sm100_forward.options(config, host.Problem.of(query, key, key))
lowered = jax.jit(lambda q, k, v, s, l: sm100_forward.run(
    options, q, k, v, {"sinks": s, "kv_seq_lengths": l})).trace(
    query, key, key, sinks, lengths).lower(lowering_platforms=("cuda",))
calls = [line for line in lowered.as_text().splitlines() if "stablehlo.custom_call" in line]
print("LOWERED " + json.dumps({"calls": len(calls), "sm100": sum("sm100_forward" in c for c in calls),
                               "types": [c.split(" : ")[-1] for c in calls]}))
"""


def test_attention_forward_lowers_for_cuda(tmp_path):
    """The kernel module's `run`, which the CUDA dispatch calls on 10.x, traces and lowers to one kernel call
    (the DSL compiles for sm_100a on this CPU), operands and results as the contract says."""
    import subprocess
    import sys

    environment = dict(os.environ, CUTE_DSL_ARCH=sm100_inspect.TARGET, FA4_JAX_CACHE_DIR=str(tmp_path),
                       PYTHONPATH=sm100_inspect.REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    process = subprocess.run([sys.executable, "-c", _LOWER], env=environment, capture_output=True,
                             text=True, timeout=600)
    assert process.returncode == 0, process.stderr[-4000:]
    line = next(line for line in process.stdout.splitlines() if line.startswith("LOWERED "))
    lowered = json.loads(line[len("LOWERED "):])
    assert lowered["calls"] == 1 and lowered["sm100"] == 1, lowered
    assert lowered["types"] == ["(tensor<1x200x4x128xbf16>, tensor<1x300x2x128xbf16>, "
                                "tensor<1x300x2x128xbf16>, tensor<4xf32>, tensor<1xi32>) -> "
                                "(tensor<1x200x4x128xbf16>, tensor<1x4x200xf32>)"], lowered
