"""CPU-only: compile the Blackwell backward kernel for sm_100a with fake tensors and inspect its PTX.

No Blackwell GPU is reachable, so this is what shows the 2-CTA design is real: every tensor-core MMA is
`tcgen05.mma.cta_group::2` (one MMA over the CTA pair; the PTX may not mix in any cta_group::1
instruction), tensor memory is allocated and freed for the pair (`tcgen05.alloc` / `dealloc`
cta_group::2), S^T / dP^T / dQ / dK / dV are read from TMEM and P^T / dS^T written into it
(`tcgen05.ld` / `tcgen05.st`), MMA completion is multicast to both CTAs' mbarriers, the pair
synchronises (`barrier.cluster`) and exchanges dS through distributed shared memory
(`st.shared::cluster` after `fence.proxy.async.shared::cluster`), the operand tiles arrive by 2-CTA
TMA (`cp.async.bulk.tensor ... cta_group::2`), dQ is added with fp32 atomics, and ptxas reports no
spills. Its numerics are the sm90 backward's (docs/blackwell.md). Every compile here also checks the
kernel's barrier protocol against its schedule (sm100/backward_schedule.py) while the kernel is traced;
tests/test_sm100_protocol.py replays the schedule. Every kernel the selected tests check compiles in one
subprocess (the `compiled` fixture); each test checks its own.
"""

from __future__ import annotations

import re

import pytest

import ptx_checks
from fa4_jax.config import AttentionConfig
pytest.importorskip("cutlass")  # the kernel modules need nvidia-cutlass-dsl (Linux only)
from fa4_jax.kernels import host  # noqa: E402
from fa4_jax.kernels.sm100 import backward as sm100_backward  # noqa: E402
from tools import sm100_inspect  # noqa: E402


SMEM_CAPACITY = 227 * 1024

# Compiled in CI: head dims 128, 96 and 64, causal, GQA, fp16, deterministic, and every feature path.
CASES = {
    "d128": dict(config=dict(scale=128 ** -0.5), shape=[1, 512, 512, 4, 4, 128]),
    # (This one and d96-causal-gqa are also GRID rows, which the batch then compiles once for both.)
    "d64-causal-gqa-fp16": dict(config=dict(scale=0.125, causal=True), shape=[2, 1000, 1200, 8, 2, 64],
                                dtype="float16"),
    "d128-window-softcap-sinks-segments-lengths": dict(
        config=dict(scale=1.0, softcap=5.0, window_left=100, window_right=20, has_sinks=True,
                    has_segment_ids=True, has_q_seq_lengths=True, has_kv_seq_lengths=True),
        shape=[2, 333, 555, 4, 4, 128]),
    "d96-causal-gqa": sm100_inspect.BACKWARD_REPORT_SPECS["d96-causal"],
    "d128-causal-gqa-deterministic": dict(config=dict(scale=128 ** -0.5, causal=True, deterministic=True),
                                          shape=[2, 1000, 1000, 8, 2, 128]),
}

# Exhaustive: head dims x causal x GQA in bf16, fp16 once per head dim (causal GQA: the dtype changes the
# element type alone, and CI's time is better spent on the paths), plus the feature paths per head dim.
# Lengths off the tiles (1000 x 1200) everywhere but the bf16 GQA rows, which are the compile report's
# configurations (BACKWARD_REPORT_SPECS, 2048 x 2048), so a batch with both compiles them once.
FEATURES = {
    "window-softcap-sinks": dict(window_left=300, window_right=20, softcap=30.0, has_sinks=True),
    "deterministic-causal": dict(causal=True, deterministic=True),
    "segments-lengths-causal": dict(causal=True, has_segment_ids=True, has_q_seq_lengths=True,
                                    has_kv_seq_lengths=True),
}
GRID = {
    **{f"d{d}-{'causal' if causal else 'full'}-{'gqa' if group > 1 else 'mha'}-{dtype}":
       sm100_inspect.BACKWARD_REPORT_SPECS[f"d{d}{'-causal' if causal else ''}"]
       if group > 1 and dtype == "bfloat16" else
       dict(config=dict(scale=d ** -0.5, causal=causal), shape=[2, 1000, 1200, 8, 8 // group, d], dtype=dtype)
       for d in sm100_backward.SUPPORTED_HEAD_DIMS for causal in (False, True) for group in (1, 4)
       for dtype in ("bfloat16", "float16") if dtype == "bfloat16" or (causal and group > 1)},
    **{f"d{d}-{feature}": dict(config=dict(scale=d ** -0.5, **config), shape=[2, 1000, 4000, 8, 2, d])
       for d in sm100_backward.SUPPORTED_HEAD_DIMS for feature, config in FEATURES.items()},
}


def check_kernel(name: str, compiled: dict):
    ptx = compiled["ptx"]
    assert ".target sm_100a" in ptx
    mmas = re.findall(r"tcgen05\.mma\.cta_group::(\d)", ptx)
    # S^T, dP^T, dV, dK, dQ: five MMAs, all over the CTA pair.
    assert len(mmas) >= 5 and set(mmas) == {"2"}, (name, mmas)
    assert not re.search(r"tcgen05\.\w+(\.\w+)*\.cta_group::1", ptx), "a cta_group::1 tcgen05 op"
    assert re.search(r"tcgen05\.mma\.cta_group::2[^\n]*\[%r\d+\], \[%r\d+\], %rd\d+", ptx), \
        "no MMA with A (P^T / dS^T) from TMEM"
    assert len(re.findall(r"tcgen05\.alloc\.cta_group::2", ptx)) == 1
    assert len(re.findall(r"tcgen05\.dealloc\.cta_group::2", ptx)) == 1
    assert re.search(r"tcgen05\.relinquish_alloc_permit\.cta_group::2", ptx)
    assert re.search(r"tcgen05\.ld\.", ptx) and re.search(r"tcgen05\.st\.", ptx)
    assert re.search(r"tcgen05\.commit\.cta_group::2[^\n]*multicast::cluster", ptx), "no commit to both CTAs"
    assert re.search(r"barrier\.cluster\.arrive", ptx) and re.search(r"barrier\.cluster\.wait", ptx)
    assert re.search(r"cp\.async\.bulk\.tensor\.[^\n]*cta_group::2", ptx), "no 2-CTA TMA loads"
    assert re.search(r"mapa\.", ptx) and re.search(r"st\.shared::cluster", ptx), "no dS exchange via DSMEM"
    assert re.search(r"fence\.proxy\.async\.shared::cluster", ptx)
    assert re.search(r"mbarrier\.arrive[^\n]*\.cluster[^\n]*shared::cluster", ptx), "no remote arrive on the leader"
    assert re.search(r"red\.[^\n]*global\.add\.f32", ptx), "dQ never added"
    if compiled.get("deterministic"):
        assert re.search(r"ld\.acquire\.gpu[^\n]*\.(b|s|u)32", ptx), "no wait for the dQ turn"
        assert re.search(r"red\.release\.gpu[^\n]*add", ptx), "the dQ turn is never passed on"
    assert sm100_inspect.issued_by_one_thread(ptx), "tcgen05.mma/commit or TMA not issued by one thread"
    assert re.search(r"setmaxnreg\.inc", ptx) and re.search(r"setmaxnreg\.dec", ptx)
    assert not sm100_inspect.uses_local_memory(ptx), "local memory in the PTX"
    layout = compiled["layout"]
    assert layout["tmem_columns_used"] <= layout["tmem_columns_allocated"] <= 512
    assert layout["shared_memory_bytes"] <= SMEM_CAPACITY
    resources = sm100_inspect.ptxas_resources(compiled["ptx_path"])
    if resources is not None:
        assert resources["spill_store_bytes"] == 0 and resources["stack_frame_bytes"] == 0, (name, resources)


# The report's configuration the quick test compares (the slow one compares them all).
QUICK_REPORT = ["d128-causal"]


@pytest.fixture(scope="module")
def compiled(request, tmp_path_factory):
    """What the selected tests check, compiled in one subprocess: "CASES.<name>", "GRID.<name>" and
    "REPORT.<name>" (BACKWARD_REPORT_SPECS)."""
    tests = ptx_checks.selected_tests(request)
    specs = {f"CASES.{name}": CASES[name] for name in ptx_checks.selected(request, "name")}
    if "test_grid_compiles" in tests:
        specs.update({f"GRID.{name}": spec for name, spec in GRID.items()})
    report = sm100_inspect.BACKWARD_REPORT_SPECS if "test_whole_report_is_current" in tests else \
        QUICK_REPORT if "test_report_is_current" in tests else []
    specs.update({f"REPORT.{name}": sm100_inspect.BACKWARD_REPORT_SPECS[name] for name in report})
    return ptx_checks.CompiledBatch(sm100_inspect.compile_kernels(
        dict(sorted(specs.items())), str(tmp_path_factory.mktemp("sm100_backward_ptx")), direction="backward",
        keep_going=True))


@pytest.mark.parametrize("name", sorted(CASES))
def test_compiles_to_the_2cta_design(compiled, name):
    record = compiled.record(f"CASES.{name}")
    check_kernel(name, {**record, "deterministic": CASES[name]["config"].get("deterministic", False)})


@pytest.mark.slow
def test_grid_compiles(compiled):
    for name in GRID:
        record = compiled.record(f"GRID.{name}")
        check_kernel(name, {**record, "deterministic": GRID[name]["config"].get("deterministic", False)})


# ----------------------------------------------------------------------------------------------------
# The module's face

@pytest.mark.parametrize("shapes, dtype, config, fragment", [
    (((1, 128, 4, 192), (1, 128, 4, 192), (1, 128, 4, 192)), "bfloat16", {}, "head dims"),
    (((1, 128, 4, 256), (1, 128, 4, 256), (1, 128, 4, 256)), "bfloat16", {}, "head dims"),
    (((1, 128, 4, 128), (1, 128, 4, 128), (1, 128, 4, 128)), "float32", {}, "bfloat16 or float16"),
    (((1, 128, 4, 128), (1, 256, 4, 128), (1, 256, 4, 128)), "bfloat16",
     dict(causal=True, has_q_start=True, q_total=256), "q_start"),
])
def test_unsupported_reason_names_the_problem(shapes, dtype, config, fragment):
    reason = sm100_backward.unsupported_reason(AttentionConfig(scale=0.1, **config), host.Problem(*shapes, dtype))
    assert reason is not None and fragment in reason


def test_supported_configs_build_kernel_options():
    shapes = ((2, 1000, 16, 128), (2, 1200, 4, 128), (2, 1200, 4, 128))
    config = AttentionConfig(scale=0.1, causal=True, window_left=64, softcap=5.0, has_sinks=True,
                             has_segment_ids=True, has_q_seq_lengths=True, has_kv_seq_lengths=True)
    problem = host.Problem(*shapes, "bfloat16")
    assert sm100_backward.unsupported_reason(config, problem) is None
    options = sm100_backward.options(config, problem)
    assert options.group == 4 and options.mask.causal and options.has_sinks and options.has_kv_lengths
    kernel = sm100_backward.Sm100BackwardKernel(options)
    assert kernel.tmem_columns_used == 512
    assert hash(options) == hash(sm100_backward.options(config, problem))


# ----------------------------------------------------------------------------------------------------
# The committed compile report (benchmarks/results/sm100_backward_compile_report.json)

def _committed_report():
    import json

    with open(sm100_inspect.BACKWARD_REPORT_PATH) as handle:
        return json.load(handle)


def _report(compiled, names) -> dict:
    return sm100_inspect.report_of({name: compiled.record(f"REPORT.{name}") for name in names}, direction="backward")


def _assert_matches(fresh: dict, committed: dict):
    for name, record in fresh["configs"].items():
        expected = committed["configs"][name]
        if "registers_at_launch" not in record:  # no ptxas here: compare what the DSL reports
            expected = {key: value for key, value in expected.items() if key in record}
        assert record == expected, (
            f"{name}: the committed sm100 backward compile report is stale; run "
            "`python benchmarks/sm100_report.py --direction backward` and commit the JSON")


def test_report_is_current(compiled):
    """The committed backward report matches what the sources compile to now (one configuration here;
    all of them in the slow test)."""
    committed = _committed_report()
    assert sorted(committed["configs"]) == sorted(sm100_inspect.BACKWARD_REPORT_SPECS)
    for name, record in committed["configs"].items():
        assert record["spec"] == sm100_inspect.BACKWARD_REPORT_SPECS[name]
        assert record["tmem_columns_used"] <= 512 and record["shared_memory_bytes"] <= SMEM_CAPACITY
        assert record["tcgen05_and_tma_issued_by_one_thread"] and not record["local_memory"]
        assert record.get("spill_store_bytes", 0) == 0
    _assert_matches(_report(compiled, QUICK_REPORT), committed)


@pytest.mark.slow
def test_whole_report_is_current(compiled):
    _assert_matches(_report(compiled, sm100_inspect.BACKWARD_REPORT_SPECS), _committed_report())


_LOWER = r"""
import json
import jax, jax.numpy as jnp
from fa4_jax.config import AttentionConfig
from fa4_jax.kernels import host
from fa4_jax.kernels.sm100 import backward as sm100_backward
query = jax.ShapeDtypeStruct((1, 200, 4, 128), jnp.bfloat16)
key = jax.ShapeDtypeStruct((1, 300, 2, 128), jnp.bfloat16)
lse = jax.ShapeDtypeStruct((1, 4, 200), jnp.float32)
sinks = jax.ShapeDtypeStruct((4,), jnp.float32)
lengths = jax.ShapeDtypeStruct((1,), jnp.int32)
config = AttentionConfig(scale=0.125, causal=True, has_sinks=True, has_kv_seq_lengths=True, deterministic=True)
options = sm100_backward.options(config, host.Problem.of(query, key, key))
lowered = jax.jit(lambda q, k, v, o, l, do, dl, s, n: sm100_backward.run(
    options, q, k, v, o, l, do, dl, {"sinks": s, "kv_seq_lengths": n})).trace(
    query, key, key, query, lse, query, lse, sinks, lengths).lower(lowering_platforms=("cuda",))
calls = [line for line in lowered.as_text().splitlines() if "stablehlo.custom_call" in line]
print("LOWERED " + json.dumps({"calls": len(calls), "sm100": sum("sm100_backward" in c for c in calls),
                               "types": [c.split(" : ")[-1] for c in calls]}))
"""


def test_attention_backward_lowers_for_cuda(tmp_path):
    """The module's `run`, which the CUDA dispatch calls on 10.x, traces and lowers to one kernel call
    (compiled for sm_100a on this CPU) with the JAX side around it: the fp32 dQ accumulator and dPsum /
    LSE padded to 128-row blocks, the deterministic mode's counters, dK / dV in the input type."""
    import json
    import os
    import subprocess
    import sys

    environment = dict(os.environ, CUTE_DSL_ARCH=sm100_inspect.TARGET, FA4_JAX_CACHE_DIR=str(tmp_path),
                       PYTHONPATH=sm100_inspect.REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    process = subprocess.run([sys.executable, "-c", _LOWER], env=environment, capture_output=True,
                             text=True, timeout=900)
    assert process.returncode == 0, process.stderr[-4000:]
    line = next(line for line in process.stdout.splitlines() if line.startswith("LOWERED "))
    lowered = json.loads(line[len("LOWERED "):])
    assert lowered["calls"] == 1 and lowered["sm100"] == 1, lowered
    (types,) = lowered["types"]
    # q, k, v, dO, LSE and dPsum padded to 256 rows, kv lengths, the dQ accumulator, the counters.
    assert types.startswith("(tensor<1x200x4x128xbf16>, tensor<1x300x2x128xbf16>, tensor<1x300x2x128xbf16>, "
                            "tensor<1x200x4x128xbf16>, tensor<1x4x256xf32>, tensor<1x4x256xf32>, tensor<1xi32>, "
                            "tensor<1x256x4x128xf32>, tensor<1x4x2xi32>) -> "), types
    assert types.endswith("(tensor<1x256x4x128xf32>, tensor<1x4x2xi32>, tensor<1x300x2x128xbf16>, "
                          "tensor<1x300x2x128xbf16>)"), types
