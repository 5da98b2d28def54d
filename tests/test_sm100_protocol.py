"""CPU: the sm100 kernels' mbarrier protocols, replayed over tiles, query blocks and pipeline stages.

`fa4_jax/kernels/sm100/forward_schedule.py` and `backward_schedule.py` state the protocols once; each
kernel takes its arrival (and stage, byte) counts from its schedule and checks its own synchronisation
calls against it while traced (so every compile test also checks that the kernel issues what is
replayed here). tests/protocol_simulator.py replays all roles of a CTA (the forward), of both CTAs of a
pair and of several pairs sharing the deterministic dQ turns (the backward) in a discrete-event model
of mbarriers under eager, lazy, late and random schedules. Each planted bug below must be caught: a
checker that passes them would prove nothing.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest

import protocol_simulator as sim
from fa4_jax.kernels.common import pipeline_schedule as ps
from fa4_jax.kernels.sm100 import backward_schedule
from fa4_jax.kernels.sm100.forward_schedule import forward_schedule

BYTES = 128 * 128 * 2
SEEDS = 12
# Key blocks per persistent tile of one CTA: several tiles, each with at least two key blocks.
MULTI_BLOCK_TILES = ([2], [3, 2], [4, 2, 3], [2, 6, 2, 2])
# A tile after the first with a single key block (short keys, or a causal tile that sees one block).
SINGLE_BLOCK_TILES = ([1], [2, 1], [1, 1, 1], [3, 1, 2])


def schedule(q_stage=2, kv_stage=3, epi_stage=1, **changes):
    return forward_schedule(q_stage, kv_stage, epi_stage, BYTES, BYTES).replace(**changes)


def kinds(found):
    return {violation.kind for _, _, violation in found}


def _kernel_schedule(head_dim):
    pytest.importorskip("cutlass")
    from fa4_jax.kernels.common import masking
    from fa4_jax.kernels.sm100 import forward
    options = forward.KernelOptions(dtype_name="bfloat16", head_dim=head_dim, group=1, scale=1.0,
                                    mask=masking.MaskShape())
    return forward.Sm100ForwardKernel(options).schedule


@pytest.mark.parametrize("head_dim", (64, 96, 128, 192, 256))
def test_kernel_protocol_holds_over_persistent_tiles(head_dim):
    kernel_schedule = _kernel_schedule(head_dim)
    for tiles in MULTI_BLOCK_TILES:
        assert sim.replay(kernel_schedule, tiles, seeds=SEEDS) == [], tiles


@pytest.mark.parametrize("stages", [(2, 2, 1), (2, 2, 2), (1, 2, 1), (2, 8, 2), (1, 5, 1)])
def test_protocol_holds_for_every_stage_count(stages):
    for tiles in MULTI_BLOCK_TILES:
        assert sim.replay(schedule(*stages), tiles, seeds=SEEDS) == [], tiles


@pytest.mark.parametrize("stages", [(2, 3, 1), (1, 2, 1)])
def test_protocol_holds_with_single_block_tiles(stages):
    for tiles in SINGLE_BLOCK_TILES:
        assert sim.replay(schedule(*stages), tiles, seeds=SEEDS) == [], tiles


def test_without_stats_free_a_single_block_tile_overwrites_row_stats():
    """The race stats_free closes: softmax i finishing a one-block tile and writing row_stats[i]
    before the correction warpgroup has read the previous tile's."""
    def without_stats_free(step):
        if (isinstance(step, ps.Wait) and step.barrier == "stats_free") or (
                isinstance(step, ps.Flip) and step.phase == "stats_free_phase") or is_arrive("stats_free")(step):
            return ()
        return None
    base = schedule()
    bugged = sim.change_role(sim.change_role(base, "softmax", without_stats_free), "correction",
                             without_stats_free)
    bugged = bugged.replace(barriers=tuple(b for b in bugged.barriers if b.name != "stats_free"))
    violation = sim.Simulation(bugged, [2, 1], "eager").run()
    assert violation.kind == "overwrite" and "row_stats0" in violation.message, violation


# ------------------------------------------------------------------------------------------------
# Planted bugs: each must be reported, with the right kind of violation.

def drop(predicate):
    return lambda step: () if predicate(step) else None


def is_arrive(barrier):
    return lambda step: isinstance(step, ps.Arrive) and step.barrier == barrier


def _swap_kv_loads(step):
    # The load warp sends V(j - 1) before K(j): the MMA takes the ring's slots in order, so its K is V.
    if isinstance(step, ps.BlockLoop) and any(isinstance(s, ps.TmaLoad) for s in step.body):
        k_acquire, k_load, v_acquire, v_load = step.body
        return (dataclasses.replace(step, body=(v_acquire, v_load, k_acquire, k_load)),)
    return None


def _read_before_wait(step):
    # The softmax reads S before waiting for the MMA's commit of it.
    if isinstance(step, ps.BlockLoop) and isinstance(step.body[0], ps.Wait):
        wait, flip, read, *rest = step.body
        return (dataclasses.replace(step, body=(read, wait, flip, *rest)),)
    return None


def _flip_final_phase_per_stage(step):
    # The correction toggles final_phase inside its per-query-tile loop instead of once per tile.
    if isinstance(step, ps.Stages) and any(isinstance(s, ps.Wait) and s.phase == "final_phase"
                                           for s in step.body):
        return (ps.Stages(step.body + (ps.Flip("final_phase"),)),)
    if isinstance(step, ps.Flip) and step.phase == "final_phase":
        return ()
    return None


def _masked_branch_forgets_p_ready(step):
    if isinstance(step, ps.Either):
        return (ps.Either(step.first, tuple(s for s in step.second if not is_arrive("p_ready")(s))),)
    return None


def _pipeline(name, **changes):
    base = schedule()
    return base.replace(pipelines=ps.replace_named(base.pipelines, name, **changes))


def _barrier(name, **changes):
    base = schedule()
    return base.replace(barriers=ps.replace_named(base.barriers, name, **changes))


PLANTED = {
    # name: (schedule with the bug, violation kinds accepted, static checks on)
    "correction drops its p_ready arrive (static count)": (
        sim.change_role(schedule(), "correction", drop(is_arrive("p_ready"))), {"arrive_count"}, True),
    "correction drops its p_ready arrive (replayed)": (
        sim.change_role(schedule(), "correction", drop(is_arrive("p_ready"))), {"deadlock"}, False),
    "softmax drops its stats_final arrive": (
        sim.change_role(schedule(), "softmax", drop(is_arrive("stats_final"))), {"deadlock"}, False),
    "masked branch forgets the p_ready arrive": (
        sim.change_role(schedule(), "softmax", _masked_branch_forgets_p_ready), {"deadlock"}, True),
    "load swaps the K and V loads": (
        sim.change_role(schedule(), "load", _swap_kv_loads), {"read_unready"}, True),
    "softmax reads S before its wait": (
        sim.change_role(schedule(), "softmax", _read_before_wait), {"read_unready"}, True),
    "softmax never flips its s_full phase": (
        sim.change_role(schedule(), "softmax", drop(lambda s: isinstance(s, ps.Flip))),
        {"phase_aliasing"}, True),
    "correction flips final_phase per query tile": (
        # Passes on the old phase when the softmax is behind, waits for a phase that never comes
        # when it is ahead.
        sim.change_role(schedule(), "correction", _flip_final_phase_per_stage),
        {"phase_aliasing", "deadlock"}, True),
    "p_ready counts one warpgroup's arrivals (static count)": (
        _barrier("p_ready", arrivals=128), {"arrive_count"}, True),
    "p_ready counts one warpgroup's arrivals (replayed)": (
        _barrier("p_ready", arrivals=128), {"arrive_count", "read_unready", "overwrite"}, False),
    "epilogue pipeline has 2 stages over 1 staging tile": (
        _pipeline("epilogue", stages=2, buffer_stages=1), {"overwrite"}, True),
    "K/V pipeline has 3 stages over a ring of 2 tiles": (
        _pipeline("load_kv", buffer_stages=2), {"overwrite", "read_unready"}, True),
    "s_full has one barrier for two query tiles": (
        _barrier("s_full", stages=1), {"stage_count"}, True),
    "Q expects more TMA bytes than a tile": (
        _pipeline("load_q", tx_bytes=2 * BYTES), {"deadlock"}, True),
    "K/V expects fewer TMA bytes than a tile": (
        _pipeline("load_kv", tx_bytes=BYTES // 2), {"deadlock"}, True),
}


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_planted_bug_is_caught(name):
    bugged, accepted, static_checks = PLANTED[name]
    found = []
    for tiles in MULTI_BLOCK_TILES:
        found += sim.replay(bugged, tiles, seeds=SEEDS, static_checks=static_checks)
    assert found, f"the checker missed: {name}"
    assert kinds(found) <= accepted, [str(v) for _, _, v in found[:5]]


def test_deterministic_schedules_alone_catch_the_ordering_bugs():
    """The eager and lazy schedules (no randomness) already catch each deterministic bug."""
    for name in ("load swaps the K and V loads", "correction flips final_phase per query tile",
                 "epilogue pipeline has 2 stages over 1 staging tile"):
        bugged, accepted, _ = PLANTED[name]
        found = [v for mode in ("eager", "lazy")
                 for v in [sim.Simulation(bugged, [3, 2], mode).run()] if v is not None]
        assert found and {v.kind for v in found} <= accepted, name


def test_deadlock_report_names_the_blocked_waits():
    bugged = PLANTED["correction drops its p_ready arrive (replayed)"][0]
    violation = sim.Simulation(bugged, [2], "eager").run(static_checks=False)
    assert violation.kind == "deadlock"
    assert "mma waits p_ready[0] parity 0" in violation.message


# ------------------------------------------------------------------------------------------------
# The trace-time conformance check the kernel runs on itself

def _issue(trace, role, steps):
    for step in steps:
        if isinstance(step, ps._Optional):
            continue
        kind, name, index = step
        trace.expect(role, kind, name, index)


def test_trace_accepts_the_schedule_order_and_rejects_a_swap():
    forward = schedule()
    for role in ("load", "mma", "softmax0", "correction", "epilogue"):
        trace = ps.ProtocolTrace(forward)
        trace.begin(role)
        _issue(trace, role, ps.traced_steps(forward, role))
        trace.finish(role)
    trace = ps.ProtocolTrace(forward)
    trace.begin("mma")
    steps = [s for s in ps.traced_steps(forward, "mma") if not isinstance(s, ps._Optional)]
    steps[3], steps[4] = steps[4], steps[3]
    with pytest.raises(ps.ProtocolMismatch, match="role mma: step 3"):
        _issue(trace, "mma", steps)


def test_trace_rejects_a_missing_step_and_an_unfinished_role():
    forward = schedule()
    trace = ps.ProtocolTrace(forward)
    trace.begin("correction")
    steps = ps.traced_steps(forward, "correction")
    _issue(trace, "correction", steps[:-2])
    with pytest.raises(ps.ProtocolMismatch, match="stopped after"):
        trace.finish("correction")
    with pytest.raises(ps.ProtocolMismatch, match="roles traced to the end"):
        trace.check_finished()


def test_trace_takes_one_or_both_arms_of_a_branch():
    """A dynamic branch traces both arms (masked / unmasked blocks), a constant one (segments: every
    block is partial) only one."""
    forward = schedule()
    steps = ps.traced_steps(forward, "softmax0")
    (optional,) = [s for s in steps if isinstance(s, ps._Optional)]
    for repeat in (False, True):
        trace = ps.ProtocolTrace(forward)
        trace.begin("softmax0")
        for step in steps:
            if isinstance(step, ps._Optional):
                if repeat:
                    _issue(trace, "softmax0", optional.steps)
                continue
            trace.expect("softmax0", *step)
        trace.finish("softmax0")


_TRACE_WITH_A_SWAP = r"""
import sys
from fa4_jax.config import AttentionConfig
from fa4_jax.kernels import host
from fa4_jax.kernels.common import pipeline_schedule as ps
from fa4_jax.kernels.sm100 import forward
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_stream
sys.path.insert(0, "tests")
import protocol_simulator as sim

config = AttentionConfig(scale=0.125)
shape = [1, 256, 256, 2, 2, 64]
problem = host.Problem(tuple(shape[i] for i in (0, 1, 3, 5)), tuple(shape[i] for i in (0, 2, 4, 5)),
                       tuple(shape[i] for i in (0, 2, 4, 5)), "bfloat16")
kernel = forward.Sm100ForwardKernel(forward.options(config, problem, sm_count=148))

def swap_epilogue(step):   # the schedule says: release the staging tile before the TMA store's wait
    if isinstance(step, ps.Stages) and isinstance(step.body[0], ps.ConsumerWait):
        wait, read, release = step.body
        return (ps.Stages((release, wait, read)),)
    return None

kernel.protocol = ps.ProtocolTrace(sim.change_role(kernel.schedule, "epilogue", swap_epilogue))
try:
    cute.compile(kernel, make_fake_stream(), *host.forward_fake_arguments(config, shape, "bfloat16"))
except ps.ProtocolMismatch as mismatch:
    print("MISMATCH", mismatch)
"""


def test_kernel_trace_rejects_a_schedule_it_does_not_follow():
    """Tracing the real kernel against a schedule with two epilogue steps swapped fails the compile."""
    pytest.importorskip("cutlass")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    environment = dict(os.environ, CUTE_DSL_ARCH="sm_100a",
                       PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run([sys.executable, "-c", _TRACE_WITH_A_SWAP], cwd=root, env=environment,
                            capture_output=True, text=True, timeout=600)
    assert "MISMATCH role epilogue: step 1 of its schedule is ('release', 'o', None), the kernel " \
           "issues ('consumer_wait', 'epilogue', None)" in result.stdout, (
               result.stdout[-2000:], result.stderr[-2000:])


def test_branch_arms_that_synchronise_differently_fail_the_trace_schedule():
    bugged = PLANTED["masked branch forgets the p_ready arrive"][0]
    with pytest.raises(ValueError, match="arms of a branch synchronise differently"):
        ps.traced_steps(bugged, "softmax0")


# ------------------------------------------------------------------------------------------------
# A CTA pair (the 2-CTA MMA of the sm100 backward): one schedule names both CTAs' roles and barriers.

HALF = 64 * 128 * 2


def pair_schedule(stages=2):
    """Each CTA loads half of a K tile into its own ring; the leader's MMA warp consumes both halves,
    writes S into both CTAs' TMEM and commits to both CTAs' s_full; both softmax warpgroups arrive
    on the leader's p_ready before the next S overwrites theirs."""
    def load(cta):
        return ps.Role(f"cta{cta}.load", (ps.TileLoop((ps.BlockLoop((
            ps.Acquire("load_k", "k"), ps.TmaLoad("k", lambda v: f"K{v.tile}.{v.block}", HALF))),)),), 1)

    def softmax(cta):
        return ps.Role(f"cta{cta}.softmax", (ps.TileLoop((ps.BlockLoop((
            ps.Wait(f"cta{cta}.s_full", 0, "s_phase"), ps.Flip("s_phase"),
            ps.Read(f"cta{cta}.tmem_s", lambda v: f"S{v.tile}.{v.block}"),
            ps.Arrive("cta0.p_ready", 0))),)),), 128)

    s_tag = lambda v: f"S{v.tile}.{v.block}"  # noqa: E731
    mma = ps.Role("cta0.mma", (ps.TileLoop((ps.BlockLoop((
        ps.ConsumerWait("load_k", "k"),
        ps.Mma(reads=(("@k", lambda v: f"K{v.tile}.{v.block}", False),),
               writes=(("cta0.tmem_s", s_tag, ("cta0.softmax",)), ("cta1.tmem_s", s_tag, ("cta1.softmax",)))),
        ps.MmaCommit(("cta0.s_full", "cta1.s_full"), 0),
        ps.Release("k"),
        ps.Wait("cta0.p_ready", 0, "p_phase"), ps.Flip("p_phase"))),)),), 1, mma=True)
    return ps.Schedule(
        barriers=(ps.Barrier("cta0.s_full", 1, 1), ps.Barrier("cta1.s_full", 1, 1),
                  ps.Barrier("cta0.p_ready", 1, 256)),
        pipelines=(ps.Pipeline("load_k", ps.TMA_UMMA, stages, ("cta0.load", "cta1.load"), "cta0.mma",
                               1, 1, ("cta0.smem_k", "cta1.smem_k"), tx_bytes=2 * HALF),),
        roles=(load(0), load(1), mma, softmax(0), softmax(1)), stages=1)


def test_cta_pair_protocol_holds():
    for stages in (1, 2, 3):
        for tiles in MULTI_BLOCK_TILES + SINGLE_BLOCK_TILES:
            assert sim.replay(pair_schedule(stages), tiles, seeds=SEEDS) == [], (stages, tiles)


def _commit_to_the_leader_only(step):
    if isinstance(step, ps.MmaCommit):
        return (ps.MmaCommit("cta0.s_full", step.index),)
    return None


@pytest.mark.parametrize("name, bugged, accepted, static_checks", [
    ("the commit reaches only the leader's s_full",
     sim.change_role(pair_schedule(), "cta0.mma", _commit_to_the_leader_only), {"deadlock"}, False),
    ("p_ready counts one CTA's softmax",
     pair_schedule().replace(barriers=ps.replace_named(pair_schedule().barriers, "cta0.p_ready",
                                                       arrivals=128)), {"arrive_count"}, True),
    ("the leader expects one half's bytes",
     pair_schedule().replace(pipelines=ps.replace_named(pair_schedule().pipelines, "load_k",
                                                        tx_bytes=HALF)),
     {"arrive_count", "read_unready", "deadlock"}, True),
    ("the peer's half is never loaded",
     sim.change_role(pair_schedule(), "cta1.load", drop(lambda s: isinstance(s, ps.TmaLoad))),
     {"deadlock"}, True),
])
def test_cta_pair_planted_bug_is_caught(name, bugged, accepted, static_checks):
    found = []
    for tiles in MULTI_BLOCK_TILES:
        found += sim.replay(bugged, tiles, seeds=SEEDS, static_checks=static_checks)
    assert found and kinds(found) <= accepted, (name, [str(v) for _, _, v in found[:3]])


# ------------------------------------------------------------------------------------------------
# The sm100 backward (sm100/backward_schedule.py): both CTAs of a pair over a walk of query blocks,
# and several pairs at once for the deterministic turns. Its kernel is not persistent: a pair walks
# one tile, `[n]` query blocks (none for keys no query sees).

BACKWARD_WALKS = ([0], [1], [2], [3], [5])
KEY_BYTES, QUERY_BYTES = backward_schedule.pair_bytes(128, 2)


def backward(deterministic=True, q_stages=1, **changes):
    return backward_schedule.backward_schedule(KEY_BYTES, QUERY_BYTES, deterministic, q_stages).replace(**changes)


def replay_walks(schedule, walks=BACKWARD_WALKS, static_checks=True):
    found = []
    for walk in walks:
        found += sim.replay(schedule, walk, seeds=SEEDS, static_checks=static_checks)
    return found


@pytest.mark.parametrize("head_dim", (64, 96, 128))
@pytest.mark.parametrize("deterministic", (False, True))
def test_backward_kernel_protocol_holds_for_both_ctas(head_dim, deterministic):
    pytest.importorskip("cutlass")
    from fa4_jax.kernels.common import masking
    from fa4_jax.kernels.sm100 import backward as sm100_backward
    kernel = sm100_backward.Sm100BackwardKernel(sm100_backward.KernelOptions(
        dtype_name="bfloat16", head_dim=head_dim, group=1, scale=1.0, mask=masking.MaskShape(),
        deterministic=deterministic))
    assert {role.name for role in kernel.schedule.roles} == {
        "cta0.load", "cta1.load", "cta0.mma", "cta0.compute", "cta1.compute", "cta0.dq", "cta1.dq"}
    assert replay_walks(kernel.schedule) == []


@pytest.mark.parametrize("q_stages", (1, 2, 3))
def test_backward_protocol_holds_for_more_query_stages(q_stages):
    """The kernel's shared memory holds one Q / dO stage; the ring would hold with more."""
    for deterministic in (False, True):
        assert replay_walks(backward(deterministic, q_stages)) == [], deterministic


def test_backward_names_what_each_hand_off_protects():
    """The programs state the buffers the protocol protects, in both CTAs: a replay that checks
    hazards on them (not only waits and arrives)."""
    buffers = set()
    for role in backward().roles:
        for step, variables in ps.expand(backward(), role, [2]):
            if isinstance(step, (ps.Read, ps.Write)):
                buffers.add(step.buffer)
            elif isinstance(step, ps.Mma):
                buffers.update(name for name, *_ in step.reads + step.writes)
            elif isinstance(step, ps.TmaLoad):
                buffers.add(step.buffer or "@" + step.handle)
    expected = {f"cta{cta}.{name}" for cta in (0, 1) for name in (
        "smem_kv", "tmem_s", "tmem_dp", "tmem_dv", "tmem_dk", "sds.k0", "sds.k1")}
    assert expected | {"@q"} <= buffers, sorted(buffers)


def test_backward_phases_follow_the_pattern_the_kernel_computes():
    """The kernel computes a phase in block `it` as its initial value flipped `it` times: a schedule
    that flips a phase twice per block, or outside the loop, or takes a slot twice, is refused."""
    for role in backward().roles:
        backward_schedule.block_phases(role)
    twice = sim.change_role(backward(), "cta0.dq", lambda s: (s, s) if isinstance(s, ps.Flip) else None)
    after = sim.change_role(backward(), "cta0.compute", lambda s: (s, ps.Flip("dkv_phase"))
                            if isinstance(s, ps.Wait) and "dkv" in s.barrier else None)
    slots = sim.change_role(backward(), "cta0.mma", lambda s: (s, s) if isinstance(s, ps.ConsumerWait) else None)
    for bugged, role in ((twice, "cta0.dq"), (after, "cta0.compute"), (slots, "cta0.mma")):
        with pytest.raises(ValueError, match=role):
            backward_schedule.block_phases(bugged.role(role))


def _pairs(mask, pairs, m_blocks, group, deterministic=True):
    """Every CTA pair of one (batch, KV head) at once: (merged schedule, walk per role). Each pair walks
    the query blocks its keys see (masking.query_block_range) for every head of the group, taking
    its turn on each (ordered_reduction.key_block_turn), as the kernel does."""
    from fa4_jax.kernels.common import masking, ordered_reduction
    rows, keys = backward_schedule.ROWS, 2 * backward_schedule.ROWS
    q_len, kv_len = m_blocks * rows, pairs * keys
    offset = kv_len - q_len
    schedules, walks = [], {}
    for pair in range(pairs):
        m_lo, m_hi = masking.query_block_range(mask, pair, rows, keys, kv_len, offset, m_blocks)
        m_count = max(m_hi - m_lo, 0)

        def turn(block, pair=pair, m_lo=m_lo, m_count=m_count):
            head, m = divmod(block, m_count)
            return (head, m_lo + m), ordered_reduction.key_block_turn(mask, pair, (m_lo + m) * rows, rows, keys,
                                                                      kv_len, offset, highest_first=True)
        schedule = backward_schedule.backward_schedule(KEY_BYTES, QUERY_BYTES, deterministic,
                                                       prefix=f"pair{pair}.", turn=turn)
        schedules.append(schedule)
        walks.update({role.name: [m_count * group] for role in schedule.roles})
    return sim.merge(*schedules), walks


PAIR_GRIDS = {
    # (mask, pairs, query blocks, heads of the group)
    "full": (dict(), 3, 2, 1),
    "causal": (dict(causal=True), 3, 6, 1),
    "causal-gqa": (dict(causal=True), 2, 4, 2),
    "window": (dict(window_left=200, window_right=0), 4, 8, 1),
}


@pytest.mark.parametrize("grid", sorted(PAIR_GRIDS))
def test_backward_pairs_take_their_dq_turns(grid):
    """Several pairs, each walking its own query blocks, share the dQ turn counters: every pair takes
    each turn once, in order (highest pair first, CTA 0 before CTA 1), with no deadlock."""
    pytest.importorskip("cutlass")
    from fa4_jax.kernels.common import masking
    mask, pairs, m_blocks, group = PAIR_GRIDS[grid]
    schedule, walks = _pairs(masking.MaskShape(**mask), pairs, m_blocks, group)
    assert sim.replay(schedule, walks, seeds=SEEDS) == []
    simulation = sim.Simulation(schedule, walks, "random", 1)
    assert simulation.run() is None
    # Each query block's counter shows two turns (its two CTAs) per pair that visits it.
    visits = {}
    for role in schedule.roles:
        if role.name.endswith("cta0.dq"):
            for step, variables in ps.expand(schedule, role, walks[role.name]):
                if isinstance(step, ps.TurnWait):
                    visits[step.index(variables)] = visits.get(step.index(variables), 0) + 2
    assert visits and dict(simulation.counters) == {("dq_turn", key): count for key, count in visits.items()}


def test_backward_turns_hold_in_any_fixed_order_and_deadlock_off_by_one():
    """The same grid with CTA 1 of each pair taking its turn before CTA 0 (2 turn + 1 - rank) still
    holds: any fixed order does; with every turn one later than the counter gives, the first visitor
    of a tile waits for ever."""
    pytest.importorskip("cutlass")
    from fa4_jax.kernels.common import masking
    schedule, walks = _pairs(masking.MaskShape(causal=True), 3, 6, 1)

    def turn_of_cta1_first(step):
        if isinstance(step, ps.TurnWait):
            value = step.value
            return (dataclasses.replace(step, value=lambda v: value(v) ^ 1),)
        return None
    assert sim.replay(sim.change_role(schedule, "pair", turn_of_cta1_first), walks, seeds=4) == []

    def off_by_one(step):     # every turn one later: the first visitor waits for a turn never given
        if isinstance(step, ps.TurnWait):
            value = step.value
            return (dataclasses.replace(step, value=lambda v: value(v) + 1),)
        return None
    found = sim.replay(sim.change_role(schedule, "pair", off_by_one), walks, seeds=4)
    assert found and kinds(found) == {"deadlock"}


def _swap_mma_waits(step):
    # The MMA warp waits for dS (ds_ready) before the dQ warps' release (dq_empty): dS needs the dP^T
    # that is issued only after the second wait.
    if isinstance(step, ps.BlockLoop) and isinstance(step.body[0], ps.ConsumerWait):
        body = list(step.body)
        first, second = [i for i, s in enumerate(body) if isinstance(s, ps.Wait)]
        body[first], body[second] = body[second], body[first]
        return (dataclasses.replace(step, body=tuple(body)),)
    return None


def _dq_arrives_before_reading(step):
    # The dQ warpgroup releases dQ's TMEM columns (dq_empty) before it has read them.
    if isinstance(step, ps.BlockLoop) and isinstance(step.body[0], ps.Wait):
        wait, read, arrive, *rest = step.body
        if isinstance(read, ps.Read) and isinstance(arrive, ps.Arrive):
            return (dataclasses.replace(step, body=(wait, arrive, read, *rest)),)
    return None


def _release_q_after_dp(step):
    # The MMA warp releases the Q / dO slot after dP^T, before the dV and dK MMAs have read it.
    if isinstance(step, ps.BlockLoop) and isinstance(step.body[0], ps.ConsumerWait):
        body = [s for s in step.body if not isinstance(s, ps.Release)]
        dp_commit = [i for i, s in enumerate(body) if isinstance(s, ps.MmaCommit)][1]
        body.insert(dp_commit + 1, ps.Release("q"))
        return (dataclasses.replace(step, body=tuple(body)),)
    return None


def _publish_ds_before_writing(step):
    # The compute warpgroup arrives on ds_ready before it has written dS.
    if isinstance(step, ps.BlockLoop) and any(isinstance(s, ps.Arrive) for s in step.body):
        arrive = next(s for s in step.body if isinstance(s, ps.Arrive))
        rest = [s for s in step.body if s is not arrive]
        first_write = next(i for i, s in enumerate(rest) if isinstance(s, ps.Write))
        return (dataclasses.replace(step, body=(*rest[:first_write], arrive, *rest[first_write:])),)
    return None


def _phase_starts_at(phase, value):
    def change(schedule):
        phases = {**dict(schedule.role("cta0.mma").initial_phases), phase: value}
        return schedule.replace(roles=ps.replace_named(schedule.roles, "cta0.mma",
                                                       initial_phases=tuple(phases.items())))
    return change


def _backward_barrier(name, **changes):
    base = backward()
    return base.replace(barriers=ps.replace_named(base.barriers, name, **changes))


def is_wait(fragment):
    return lambda step: isinstance(step, ps.Wait) and fragment in step.barrier


def _commit_to_the_leader_only(fragment):
    return lambda step: ((ps.MmaCommit(step.barrier[0], step.index),)
                         if isinstance(step, ps.MmaCommit) and fragment in step.barrier[0] else None)


def _same_turn_for_both_ctas(step):
    if isinstance(step, ps.TurnWait):
        value = step.value
        return (dataclasses.replace(step, value=lambda v: value(v) & ~1),)
    return None


BACKWARD_PLANTED = {
    # name: (schedule with the bug, violation kinds accepted, static checks on)
    "CTA 1's compute drops its ds_ready arrive (static count)": (
        sim.change_role(backward(), "cta1.compute", drop(is_arrive("cta0.ds_ready"))), {"arrive_count"}, True),
    "CTA 1's compute drops its ds_ready arrive (replayed)": (
        sim.change_role(backward(), "cta1.compute", drop(is_arrive("cta0.ds_ready"))), {"deadlock"}, False),
    "the dQ warpgroups drop their dq_empty arrive (replayed)": (
        sim.change_role(backward(), "cta", drop(is_arrive("cta0.dq_empty"))), {"deadlock"}, False),
    "the MMA warp swaps its dq_empty and ds_ready waits": (
        sim.change_role(backward(), "cta0.mma", _swap_mma_waits), {"deadlock"}, True),
    "CTA 1's dQ warpgroup releases dQ before reading it": (
        sim.change_role(backward(), "cta1.dq", _dq_arrives_before_reading), {"overwrite", "read_unready"}, True),
    "the MMA warp releases the Q slot before dV and dK read it": (
        sim.change_role(backward(), "cta0.mma", _release_q_after_dp), {"read_unready", "overwrite"}, True),
    "CTA 0's compute publishes dS before writing it": (
        sim.change_role(backward(), "cta0.compute", _publish_ds_before_writing), {"read_unready"}, True),
    "dq_empty counts one CTA's dQ warpgroup (static count)": (
        _backward_barrier("cta0.dq_empty", arrivals=128), {"arrive_count"}, True),
    "dq_empty counts one CTA's dQ warpgroup (replayed)": (
        _backward_barrier("cta0.dq_empty", arrivals=128), {"arrive_count", "overwrite", "read_unready"}, False),
    "ds_ready counts one arrival too many": (
        _backward_barrier("cta0.ds_ready", arrivals=257), {"arrive_count"}, True),
    "CTA 0's dQ warpgroup never flips its phase": (
        sim.change_role(backward(), "cta0.dq", drop(lambda s: isinstance(s, ps.Flip))), {"phase_aliasing"}, True),
    "CTA 1's compute never flips its phase": (
        sim.change_role(backward(), "cta1.compute", drop(lambda s: isinstance(s, ps.Flip))),
        {"phase_aliasing", "deadlock"}, True),
    "the MMA warp's dq_empty phase starts at 0": (
        _phase_starts_at("dq_empty_phase", 0)(backward()), {"deadlock"}, True),
    # The model takes a phase's initial value as what the schedule means (a producer's first wait
    # passes on a fresh barrier): the dS read before it is written shows the bug.
    "the MMA warp's ds_ready phase starts at 1 (its first wait passes at once)": (
        _phase_starts_at("ds_phase", 1)(backward()), {"read_unready"}, True),
    "the load warps have no producer tail": (
        sim.change_role(backward(), "cta", drop(lambda s: isinstance(s, ps.Drain))), {"late_arrival"}, True),
    "CTA 1's load warp has no producer tail": (
        sim.change_role(backward(), "cta1.load", drop(lambda s: isinstance(s, ps.Drain))), {"late_arrival"}, True),
    "the S^T commit reaches only the leader (static count)": (
        sim.change_role(backward(), "cta0.mma", _commit_to_the_leader_only("s_full")), {"arrive_count"}, True),
    "the dQ commit reaches only the leader (replayed)": (
        sim.change_role(backward(), "cta0.mma", _commit_to_the_leader_only("dq_full")), {"deadlock"}, False),
    "the leader expects one CTA's Q / dO bytes": (
        backward().replace(pipelines=ps.replace_named(backward().pipelines, "load_q", tx_bytes=QUERY_BYTES // 2)),
        {"arrive_count", "read_unready", "deadlock"}, True),
    "CTA 1 never loads its K, V, K^T half": (
        sim.change_role(backward(), "cta1.load", drop(lambda s: isinstance(s, ps.TmaLoad) and s.handle is None)),
        {"deadlock", "read_unready"}, True),
    "the MMA warp skips its kv_full wait": (
        sim.change_role(backward(), "cta0.mma", drop(is_wait("kv_full"))), {"read_unready"}, True),
    "CTA 1's compute reads dK, dV without waiting for dkv_full": (
        sim.change_role(backward(), "cta1.compute", drop(is_wait("dkv_full"))), {"read_unready"}, True),
    "both CTAs of the pair take the same dQ turn": (
        sim.change_role(backward(), "cta", _same_turn_for_both_ctas), {"deadlock", "turn"}, True),
    "CTA 1 adds its dQ without waiting for its turn": (
        sim.change_role(backward(), "cta1.dq", drop(lambda s: isinstance(s, ps.TurnWait))), {"turn"}, True),
    "two Q / dO stages over one buffer": (
        backward(q_stages=2).replace(pipelines=ps.replace_named(backward(q_stages=2).pipelines, "load_q",
                                                                buffer_stages=1)), {"overwrite"}, True),
}


@pytest.mark.parametrize("name", sorted(BACKWARD_PLANTED))
def test_backward_planted_bug_is_caught(name):
    bugged, accepted, static_checks = BACKWARD_PLANTED[name]
    found = replay_walks(bugged, ([1], [2], [3]), static_checks)
    assert found, f"the checker missed: {name}"
    assert kinds(found) <= accepted, [str(v) for _, _, v in found[:5]]


def test_backward_late_schedule_alone_catches_what_random_ones_miss():
    """A missing tail or a skipped wait on an operand loaded once needs an arrival or a copy that lands
    after everything else: the "late" schedule gives that ordering every time."""
    for name in ("CTA 1's load warp has no producer tail", "the MMA warp skips its kv_full wait"):
        bugged, accepted, _ = BACKWARD_PLANTED[name]
        violation = sim.Simulation(bugged, [3], "late").run()
        assert violation is not None and violation.kind in accepted, (name, violation)


def test_backward_trace_checks_both_ctas_programs():
    """The kernel's one code copy of a pair role is checked against both CTAs' programs, its barrier
    names resolved per CTA: a schedule whose CTA 1 copy differs from what the code issues fails."""
    schedule = backward()
    trace = ps.ProtocolTrace(schedule)
    trace.begin("compute")
    for kind, name, index in ps.traced_steps(schedule, "cta0.compute"):
        trace.expect("compute", kind, name.replace("cta0.s_full", "cta{cta}.s_full").replace(
            "cta0.dp_full", "cta{cta}.dp_full").replace("cta0.dkv_full", "cta{cta}.dkv_full"), index)
    trace.finish("compute")
    trace = ps.ProtocolTrace(schedule)
    trace.begin("compute")
    with pytest.raises(ps.ProtocolMismatch, match=r"role cta1\.compute: step 1 .* 'cta0\.s_full'"):
        trace.expect("compute", "loop", "blocks")
        trace.expect("compute", ps.WAIT, "cta0.s_full", 0)     # the leader's, not its own


_TRACE_BACKWARD = r"""
import dataclasses, sys
from fa4_jax.config import AttentionConfig
from fa4_jax.kernels.common import pipeline_schedule as ps
from fa4_jax.kernels.sm100 import backward
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_stream
sys.path.insert(0, "tests")
import protocol_simulator as sim

config = AttentionConfig(scale=0.125, deterministic=True)
shape = [1, 256, 512, 2, 2, 64]

def swap_waits(step):   # the schedule says: the MMA waits ds_ready before dq_empty
    if isinstance(step, ps.BlockLoop) and isinstance(step.body[0], ps.ConsumerWait):
        body = list(step.body)
        first, second = [i for i, s in enumerate(body) if isinstance(s, ps.Wait)]
        body[first], body[second] = body[second], body[first]
        return (dataclasses.replace(step, body=tuple(body)),)
    return None

def peer_skips_turn(step):   # CTA 1's dQ warpgroup: no turn wait
    return () if isinstance(step, ps.TurnWait) else None

for role, change in (("cta0.mma", swap_waits), ("cta1.dq", peer_skips_turn)):
    kernel = backward.Sm100BackwardKernel(backward.options(config, backward.host.Problem(
        (1, 256, 2, 64), (1, 512, 2, 64), (1, 512, 2, 64), "bfloat16")))
    kernel.protocol = ps.ProtocolTrace(sim.change_role(kernel.schedule, role, change))
    try:
        cute.compile(kernel, make_fake_stream(), *backward.fake_arguments(config, shape, "bfloat16"))
        print("COMPILED", role)
    except ps.ProtocolMismatch as mismatch:
        print("MISMATCH", mismatch)
"""


def test_backward_kernel_trace_rejects_a_schedule_it_does_not_follow():
    """Tracing the real backward kernel against a schedule with the MMA's two waits swapped, or with
    CTA 1's dQ warpgroup skipping its turn, fails the compile."""
    pytest.importorskip("cutlass")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    environment = dict(os.environ, CUTE_DSL_ARCH="sm_100a",
                       PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run([sys.executable, "-c", _TRACE_BACKWARD], cwd=root, env=environment,
                            capture_output=True, text=True, timeout=900)
    mismatches = [line for line in result.stdout.splitlines() if line.startswith("MISMATCH")]
    assert mismatches == [
        "MISMATCH role cta0.mma: step 4 of its schedule is ('wait', 'cta0.ds_ready', 0), the kernel "
        "issues ('wait', 'cta0.dq_empty', 0)",
        "MISMATCH role cta1.dq: step 3 of its schedule is ('turn_pass', 'dq_turn', None), the kernel "
        "issues ('turn_wait', 'dq_turn', None)",
    ], (result.stdout[-2000:], result.stderr[-2000:])
