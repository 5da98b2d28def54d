"""CPU-only: compile the Blackwell backward kernel for sm_100a with fake tensors and inspect its PTX.

No Blackwell GPU is reachable, so this is what shows the 2-CTA design is real: every tensor-core MMA is
`tcgen05.mma.cta_group::2` (one MMA over the CTA pair; the PTX may not mix in any cta_group::1
instruction), tensor memory is allocated and freed for the pair (`tcgen05.alloc` / `dealloc`
cta_group::2), S^T / dP^T / dQ / dK / dV are read from TMEM and P^T / dS^T written into it
(`tcgen05.ld` / `tcgen05.st`), MMA completion is multicast to both CTAs' mbarriers, the pair
synchronises (`barrier.cluster`) and exchanges dS through distributed shared memory
(`st.shared::cluster` after `fence.proxy.async.shared::cluster`), the operand tiles arrive by 2-CTA
TMA (`cp.async.bulk.tensor ... cta_group::2`), dQ is added with fp32 atomics, and ptxas reports no
spills. The barrier protocol table (`sm100.backward.PROTOCOL`) is checked for balance here; its
numerics are the sm90 backward's (docs/blackwell.md).
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from fa4_jax.config import AttentionConfig
pytest.importorskip("cutlass")  # the kernel modules need nvidia-cutlass-dsl (Linux only)
from fa4_jax.kernels import host  # noqa: E402
from fa4_jax.kernels.sm100 import backward as sm100_backward  # noqa: E402
from tools import sm100_inspect  # noqa: E402

SMEM_CAPACITY = 227 * 1024

# Compiled in CI: head dims 128, 96 and 64, causal, GQA, fp16, deterministic, and every feature path.
CASES = {
    "d128": dict(config=dict(scale=128 ** -0.5), shape=[1, 512, 512, 4, 4, 128]),
    "d64-causal-gqa-fp16": dict(config=dict(scale=0.125, causal=True), shape=[2, 1000, 1000, 8, 2, 64],
                                dtype="float16"),
    "d128-window-softcap-sinks-segments-lengths": dict(
        config=dict(scale=1.0, softcap=5.0, window_left=100, window_right=20, has_sinks=True,
                    has_segment_ids=True, has_q_seq_lengths=True, has_kv_seq_lengths=True),
        shape=[2, 333, 555, 4, 4, 128]),
    "d96-causal-gqa": dict(config=dict(scale=96 ** -0.5, causal=True), shape=[2, 1000, 1000, 8, 2, 96]),
    "d128-causal-gqa-deterministic": dict(config=dict(scale=128 ** -0.5, causal=True, deterministic=True),
                                          shape=[2, 1000, 1000, 8, 2, 128]),
}

# Exhaustive: head dims x causal x GQA x dtype, plus the feature paths per head dim.
FEATURES = {
    "window-softcap-sinks": dict(window_left=300, window_right=20, softcap=30.0, has_sinks=True),
    "deterministic-causal": dict(causal=True, deterministic=True),
    "segments-lengths-causal": dict(causal=True, has_segment_ids=True, has_q_seq_lengths=True,
                                    has_kv_seq_lengths=True),
}
GRID = {
    **{f"d{d}-{'causal' if causal else 'full'}-{'gqa' if group > 1 else 'mha'}-{dtype}": dict(
        config=dict(scale=d ** -0.5, causal=causal), shape=[2, 1000, 1200, 8, 8 // group, d], dtype=dtype)
       for d in sm100_backward.SUPPORTED_HEAD_DIMS for causal in (False, True) for group in (1, 4)
       for dtype in ("bfloat16", "float16")},
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


def check_protocol_trace(trace: list):
    """The waits and signals each role took while the kernel was traced (its loop bodies once) are
    ROLE_STEPS, in order: the table the tests check is the one the kernel runs (its waits take their
    parity from it too)."""
    expected = [[role, section, action, name] for role, sections in sm100_backward.ROLE_STEPS.items()
                for section, steps in sections.items() for action, name, _ in steps]
    key = lambda step: list(sm100_backward.ROLE_STEPS).index(step[0])  # noqa: E731 (roles trace in any order)
    assert sorted(trace, key=key) == expected


@pytest.mark.parametrize("name", sorted(CASES))
def test_compiles_to_the_2cta_design(name, tmp_path):
    compiled = sm100_inspect.compile_kernels({name: CASES[name]}, str(tmp_path), direction="backward")[name]
    check_kernel(name, {**compiled, "deterministic": CASES[name]["config"].get("deterministic", False)})
    check_protocol_trace(compiled["protocol_trace"])


@pytest.mark.slow
def test_grid_compiles(tmp_path):
    compiled = sm100_inspect.compile_kernels(GRID, str(tmp_path), direction="backward")
    assert sorted(compiled) == sorted(GRID)
    for name in GRID:
        check_kernel(name, {**compiled[name], "deterministic": GRID[name]["config"].get("deterministic", False)})


# ----------------------------------------------------------------------------------------------------
# The barrier protocol table (what the role loops follow), checked without compiling

def test_protocol_balances_per_query_block():
    """Every barrier is signalled by exactly one role and waited by exactly one; a barrier with `count` >
    1 is signalled by every thread of both CTAs (the table says so), and once-per-CTA barriers appear
    only in prologue / epilogue steps."""
    barriers = {barrier.name: barrier for barrier in sm100_backward.BARRIERS}
    once = {"kv_full", "dkv_full"}
    signals, waits = {}, {}
    for role, phases in sm100_backward.ROLE_STEPS.items():
        for phase_name, steps in phases.items():
            for action, name, phase in steps:
                assert name in barriers, (role, name)
                # Per-block barriers also appear once after the walk: a producer's tail wait.
                assert name not in once or phase_name != "block", (role, name)
                assert phase in (("0",) if name in once else ("p", "p^1")), (role, name, phase)
                (signals if action == "signal" else waits).setdefault(name, set()).add(role)
    assert sorted(signals) == sorted(waits) == sorted(barriers)
    for name, barrier in barriers.items():
        assert len(signals[name]) == 1 and len(waits[name]) == 1, name
        (signaller,), (waiter,) = signals[name], waits[name]
        assert signaller != waiter, name
        assert barrier.signalled_by.startswith(signaller), (name, barrier.signalled_by)
        assert barrier.waited_by == waiter, name
        # Remote arrivals of every thread of a 128-thread role in both CTAs, or one commit / expect_tx.
        assert barrier.count in (1, 2 * sm100_backward.ROWS), name
        assert barrier.home == ("leader" if waiter == "mma" else "each"), name


def replay(role_steps, barriers, blocks: int, seed: int = 0) -> list:
    """Run the roles of both CTAs of a pair over `blocks` query blocks on a model of the mbarriers, in a
    random interleaving (`seed`); the problems found (none for a sound protocol).

    Model: a barrier instance per CTA ("each") or the leader's only; a wait with parity P passes when
    the completed-phase count k has k % 2 != P (hardware), and it must then be exactly the completion
    the step means (`p`: block b's, k == b + 1; `p^1`: the previous block's, k == b; `0`: k == 1),
    else the wait passed on another round's phase (aliasing). Signals: the MMA warp (leader only)
    commits to both CTAs' instances; the load warps of both CTAs add their TMA bytes to the leader's
    instance and the leader's arrives (expect_tx); the 128 threads of a compute or dQ warpgroup of each
    CTA arrive on the leader's. The MMA warp's commits land later, in any order (the PTX promises each
    lands once its MMAs complete, not an order between two of them), so each CTA must wait for every
    commit sent to it before it exits (a producer's tail); the threads' own arrivals precede their
    exit.
    A phase completes at its count (and, with TMA bytes, both CTAs' bytes); more arrivals in a phase
    than its count is a problem; a state where no role can move before all finished is a deadlock."""
    rows = sm100_backward.ROWS
    table = {barrier.name: barrier for barrier in barriers}
    state = {(name, cta): [0, 0, 0] for name in table for cta in (0, 1)}   # completed, arrivals, tx
    programs = {}
    for cta in (0, 1):
        for role, sections in role_steps.items():
            if role == "mma" and cta == 1:
                continue
            steps = [(0, step) for step in sections["prologue"]]
            steps += [(b, step) for b in range(blocks) for step in sections["block"]]
            steps += [(blocks, step) for step in sections["epilogue"]]
            programs[(role, cta)] = steps
    position = {agent: 0 for agent in programs}
    problems = []

    def arrive(name, cta, arrivals, tx):
        instance = state[(name, cta)]
        instance[1] += arrivals
        instance[2] += tx
        barrier = table[name]
        if instance[1] > barrier.count:
            problems.append(f"{name}: {instance[1]} arrivals in a phase of {barrier.count}")
        if instance[1] == barrier.count and (not barrier.tx or instance[2] == 2):
            instance[0] += 1
            instance[1] = instance[2] = 0

    def ready(agent):
        block, (action, name, label) = programs[agent][position[agent]]
        if action != "wait":
            return True
        home = agent[1] if table[name].home == "each" else 0
        return state[(name, home)][0] % 2 != {"p": block & 1, "p^1": (block & 1) ^ 1, "0": 0}[label]

    random = np.random.default_rng(seed)
    in_flight = []          # the MMA warp's commits not yet landed (in any order)
    commits = {}            # (barrier, CTA): commits issued to it
    observed = {}           # (barrier, CTA): the latest of its completions a role of that CTA waited for
    while not problems:
        unfinished = [agent for agent in programs if position[agent] < len(programs[agent])]
        if not unfinished:
            for (name, cta), count in commits.items():
                if observed.get((name, cta), 0) < count:
                    problems.append(f"{name}@{cta}: a commit no role of the CTA waits for may land after "
                                    "it has exited")
            break
        movable = [agent for agent in unfinished if ready(agent)]
        if in_flight and (not movable or random.integers(2)):
            landed = in_flight.pop(random.integers(len(in_flight)))
            for peer in (0, 1):
                arrive(landed, peer, 1, 0)
            continue
        if not movable:
            problems.append(f"deadlock: { {agent: programs[agent][position[agent]] for agent in unfinished} }")
            break
        role, cta = movable[random.integers(len(movable))]
        block, (action, name, label) = programs[(role, cta)][position[(role, cta)]]
        if action == "wait":
            completed = state[(name, cta if table[name].home == "each" else 0)][0]
            target = {"p": block + 1, "p^1": block, "0": 1}[label]
            home = (name, cta if table[name].home == "each" else 0)
            observed[home] = max(observed.get(home, 0), target)
            if completed != target:
                problems.append(f"{role}@{cta} block {block}: wait on {name} passed at phase "
                                f"{completed}, meant {target}")
        elif role == "mma":
            in_flight.append(name)
            for peer in (0, 1):
                commits[(name, peer)] = commits.get((name, peer), 0) + 1
        elif role == "load":
            arrive(name, 0, 1 if cta == 0 else 0, 1)
        else:
            arrive(name, 0, rows, 0)
        position[(role, cta)] += 1
    return problems


@pytest.mark.parametrize("blocks", [0, 1, 2, 3, 5])
def test_protocol_replays_without_deadlock_or_aliasing(blocks):
    for seed in range(50):
        assert replay(sm100_backward.ROLE_STEPS, sm100_backward.BARRIERS, blocks, seed) == [], seed


def _planted(role, section, change):
    steps = {role_name: dict(sections) for role_name, sections in sm100_backward.ROLE_STEPS.items()}
    steps[role][section] = change(list(steps[role][section]))
    return steps


PLANTED_BUGS = {
    # the compute warpgroup forgets to publish dS
    "dropped-arrive": (_planted("compute", "block", lambda s: [x for x in s if x[1] != "ds_ready"]),
                       sm100_backward.BARRIERS),
    # the MMA warp waits for dS before it has committed dP, which dS needs
    "swapped-steps": (_planted("mma", "block", lambda s: s[:3] + [s[4], s[3]] + s[5:]),
                      sm100_backward.BARRIERS),
    # the MMA warp's dQ-drained wait takes this block's parity instead of the previous block's
    "wrong-parity": (_planted("mma", "block",
                              lambda s: [(a, n, "p" if n == "dq_empty" else ph) for a, n, ph in s]),
                     sm100_backward.BARRIERS),
    # the load warp refills the Q / dO stage without waiting for the MMAs that read it
    "dropped-wait": (_planted("load", "block", lambda s: [x for x in s if x[1] != "q_empty"]),
                     sm100_backward.BARRIERS),
    # the load warp leaves without waiting for the last block's release (the producer's tail)
    "no-tail": (_planted("load", "epilogue", lambda s: []), sm100_backward.BARRIERS),
    # dq_empty initialised for one CTA's warpgroup: the phase completes before the peer has read dQ
    "half-count": (sm100_backward.ROLE_STEPS,
                   tuple(b if b.name != "dq_empty" else sm100_backward.Barrier(
                       b.name, sm100_backward.ROWS, b.home, b.signalled_by, b.waited_by)
                         for b in sm100_backward.BARRIERS)),
}


@pytest.mark.parametrize("bug", sorted(PLANTED_BUGS))
def test_protocol_replay_catches_planted_bugs(bug):
    role_steps, barriers = PLANTED_BUGS[bug]
    assert all(replay(role_steps, barriers, 3, seed) != [] for seed in range(10))


def test_protocol_waits_precede_the_signals_they_enable():
    """Within one query block, a role never signals a barrier before it waited for what that signal
    publishes: the MMA warp's commits follow their operands' waits in the table's order."""
    mma = [step[:2] for step in sm100_backward.ROLE_STEPS["mma"]["block"]]
    assert mma.index(("wait", "q_full")) < mma.index(("signal", "s_full"))
    assert mma.index(("wait", "dq_empty")) < mma.index(("signal", "dp_full"))
    assert mma.index(("wait", "ds_ready")) < mma.index(("signal", "dq_full"))
    assert mma[-1] == ("signal", "q_empty")
    compute = [step[:2] for step in sm100_backward.ROLE_STEPS["compute"]["block"]]
    assert compute.index(("wait", "dp_full")) < compute.index(("signal", "ds_ready"))


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


def _assert_matches(fresh: dict, committed: dict):
    for name, record in fresh["configs"].items():
        expected = committed["configs"][name]
        if "registers_at_launch" not in record:  # no ptxas here: compare what the DSL reports
            expected = {key: value for key, value in expected.items() if key in record}
        assert record == expected, (
            f"{name}: the committed sm100 backward compile report is stale; run "
            "`python benchmarks/sm100_report.py --direction backward` and commit the JSON")


def test_report_is_current(tmp_path):
    """The committed backward report matches what the sources compile to now (one configuration here;
    all of them in the slow test)."""
    committed = _committed_report()
    assert sorted(committed["configs"]) == sorted(sm100_inspect.BACKWARD_REPORT_SPECS)
    for name, record in committed["configs"].items():
        assert record["spec"] == sm100_inspect.BACKWARD_REPORT_SPECS[name]
        assert record["tmem_columns_used"] <= 512 and record["shared_memory_bytes"] <= SMEM_CAPACITY
        assert record["tcgen05_and_tma_issued_by_one_thread"] and not record["local_memory"]
        assert record.get("spill_store_bytes", 0) == 0
    _assert_matches(sm100_inspect.build_report(str(tmp_path), ["d128-causal"], direction="backward"), committed)


@pytest.mark.slow
def test_whole_report_is_current(tmp_path):
    _assert_matches(sm100_inspect.build_report(str(tmp_path), direction="backward"), _committed_report())


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
