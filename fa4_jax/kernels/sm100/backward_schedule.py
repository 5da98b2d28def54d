"""The sm100 backward kernel's mbarrier protocol, for one CTA pair (pipeline_schedule vocabulary).

`Sm100BackwardKernel` takes its barrier arrival counts and TMA byte counts from `backward_schedule`,
computes every wait's parity from the phase variables' initial values here, and checks each role
method's synchronisation calls against the programs of both CTAs' copies of the role while it is
traced; tests/test_sm100_protocol.py replays the programs for both CTAs of a pair (and several pairs,
for the deterministic turns) over several query blocks and stage counts.

Roles, per CTA c of the pair (cta{c}.<role>; the MMA warp only in the leader, cta0):
  load      TMA of the CTA's halves: K, V, K^T once, on the leader's kv_full; Q and dO in both forms per
            query block through the load_q pipeline (a slot per CTA, the leader's full barrier)
  mma       the leader's MMA warp: the pair's five 2-CTA MMAs per query block, multicast commits
  compute   S^T, dP^T from TMEM -> P^T, dS^T into TMEM, dS into both CTAs' dQ operands; dK, dV at the end
  dq        dQ from TMEM, fp32 atomics into the global accumulator (deterministic: in turn order)

Barriers (each CTA has the kernel's whole array; the ones named here are those the protocol uses):
  cta0.kv_full        the leader's load arrives expecting both CTAs' K, V, K^T bytes
  load_q              full: the leader's, both CTAs' Q / dO bytes; empty: each CTA's, the MMA's release
  cta{c}.s_full, dp_full, dq_full, dkv_full   the MMA's commits, multicast to both CTAs
  cta0.ds_ready       every compute thread of both CTAs (dS written, in TMEM and both dQ operands)
  cta0.dq_empty       every dQ thread of both CTAs (dQ read out of TMEM)
  dq_turn             deterministic: the global counter of each (head, query block), CTA pairs in turn

Buffers the programs name:
  cta{c}.smem_kv      K, V, K^T of the CTA's 128 keys (loaded once, read by every query block's MMAs)
  cta{c}.smem_q[s]    Q and dO, in rows and in columns: the CTA's half of one query block (a slot)
  cta{c}.sds.k{r}     the dQ MMA's A operand in CTA c (its 64 queries of dS), the 128 keys of CTA r:
                      CTA r's compute writes it (for c != r through distributed shared memory)
  cta{c}.tmem_s       S^T, then P^T over it (TMEM)
  cta{c}.tmem_dp      dP^T, then dS^T over it, then dQ over the same columns
  cta{c}.tmem_dv, tmem_dk   the accumulators over the walk
Tags: "S3" is S^T of the walk's fourth query block; "dSt3" dS^T, "dS3" the dQ operand's dS.
"""

from __future__ import annotations

from typing import Callable, Optional

from fa4_jax.kernels.common.pipeline_schedule import (
    TMA_UMMA, Acquire, Arrive, Barrier, BlockLoop, ConsumerWait, Drain, ExpectTx, Flip, Leader, Mma,
    MmaCommit, Pipeline, Read, Release, Role, Schedule, TmaLoad, TurnPass, TurnWait, Wait, Write)

ROWS = 128                             # keys per CTA, query rows per block, threads per warpgroup
CTAS = (0, 1)
ELECTED = 1                            # expect_tx and tcgen05.commit come from one elected thread
PAIR_THREADS = 2 * ROWS                # a warpgroup of each CTA arriving on the leader's barrier
TURN_COUNTER = "dq_turn"


# Barrier names as the kernel reports them (ProtocolTrace resolves them for each CTA's copy).
def own(name: str) -> str:
    """The reporting CTA's own barrier (a wait is always on its own CTA's)."""
    return "cta{cta}." + name


def leader(name: str) -> str:
    """The leader's barrier (the peer arrives on it at cluster scope)."""
    return "cta0." + name


def both(name: str) -> tuple:
    """Every CTA's barrier: a tcgen05.commit multicast to the pair."""
    return tuple(f"cta{cta}.{name}" for cta in CTAS)


def pair_bytes(head_dim: int, element_bytes: int) -> tuple:
    """(K, V, K^T bytes; Q, dO bytes in both forms) per CTA pair: what the leader's expect_tx announces.

    Each CTA loads 128 keys x d of K and of V, and d / 2 columns x 256 keys of K^T; per query block
    64 rows x d of Q and of dO, and d / 2 columns x 128 queries of Q^T and of dO^T."""
    tile = ROWS * head_dim * element_bytes
    return 2 * 3 * tile, 2 * 2 * tile


def _tag(prefix):
    return lambda v: f"{prefix}{v.block}"


def _previous(prefix):
    """The accumulator as the previous query block left it (None for the first, which overwrites)."""
    return lambda v: None if v.block == 0 else f"{prefix}{v.block - 1}"


def _last(prefix):
    """The accumulator after the walk (None when the walk is empty: the compute warpgroup writes zeros)."""
    return lambda v: None if v.blocks == 0 else f"{prefix}{v.blocks - 1}"


def backward_schedule(key_bytes: int, query_bytes: int, deterministic: bool = False, q_stages: int = 1,
                      prefix: str = "", turn: Optional[Callable] = None) -> Schedule:
    """The protocol of one CTA pair of Sm100BackwardKernel.

    `q_stages`: Q / dO slots per CTA (the kernel's shared memory holds one; more are replayed to show
    the ring would hold). `prefix` and `turn` are for a replay of several pairs: every name of the pair
    gets `prefix`; `turn(block)` is (the output tile's counter index, this pair's turn on it) of query
    block `block` of the walk (default: the pair is the only visitor, turn 0 at counter `block`)."""
    turn = turn or (lambda block: (block, 0))
    mma = f"{prefix}cta0.mma"
    load_q = f"{prefix}load_q"

    def name(cta, what):
        return f"{prefix}cta{cta}.{what}"

    def every(what):
        return tuple(name(cta, what) for cta in CTAS)

    def load(cta):
        return (
            # The leader announces both CTAs' bytes; each CTA's copies complete on the leader's barrier.
            Leader((ExpectTx(name(0, "kv_full"), 0, key_bytes),)),
            TmaLoad(None, "KV", key_bytes // 2, buffer=name(cta, "smem_kv"), barrier=name(0, "kv_full"),
                    readers=(mma,)),
            BlockLoop((
                Acquire(load_q, "q"),
                TmaLoad("q", _tag("Q"), query_bytes // 2),
            )),
            # The producer's tail: the last blocks' releases, commits multicast into this CTA, land
            # before it exits.
            *(Drain(load_q) for _ in range(q_stages)),
        )

    kv = tuple((buffer, "KV", False) for buffer in every("smem_kv"))
    query = (("@q", _tag("Q"), False),)

    def accumulate(accumulator, operand, operand_tag, tag):
        """dV += P^T dO, dK += dS^T Q: A from TMEM (the compute warpgroups' P^T / dS^T), B from the slot."""
        def readers(cta):
            return lambda v: (mma,) if v.block < v.blocks - 1 else (name(cta, "compute"),)
        return Mma(reads=(*((buffer, _tag(operand_tag), True) for buffer in every(operand)), *query,
                          *((buffer, _previous(tag), True) for buffer in every(accumulator))),
                   writes=tuple((name(cta, accumulator), _tag(tag), readers(cta)) for cta in CTAS))

    mma_program = (
        Wait(name(0, "kv_full"), 0, "kv_phase"),
        BlockLoop((
            ConsumerWait(load_q, "q"),
            Mma(reads=query + kv,                                                    # S^T = K Q^T
                writes=tuple((name(cta, "tmem_s"), _tag("S"), (name(cta, "compute"),)) for cta in CTAS)),
            MmaCommit(every("s_full"), 0),
            # dP^T overwrites the previous block's dQ: the dQ warps of both CTAs must have read it.
            Wait(name(0, "dq_empty"), 0, "dq_empty_phase"),
            Mma(reads=query + kv,                                                    # dP^T = V dO^T
                writes=tuple((name(cta, "tmem_dp"), _tag("dP"), (name(cta, "compute"),)) for cta in CTAS)),
            MmaCommit(every("dp_full"), 0),
            Wait(name(0, "ds_ready"), 0, "ds_phase"),
            accumulate("tmem_dv", "tmem_s", "P", "dV"),
            accumulate("tmem_dk", "tmem_dp", "dSt", "dK"),
            # dQ = dS K over dS^T's columns (issued after dK, which reads them: tcgen05 runs in order).
            Mma(reads=(*((name(target, f"sds.k{source}"), _tag("dS"), True) for target in CTAS for source in CTAS),
                       *kv),
                writes=tuple((name(cta, "tmem_dp"), _tag("dQ"), (name(cta, "dq"),)) for cta in CTAS)),
            MmaCommit(every("dq_full"), 0),
            Release("q"),
            Flip("dq_empty_phase"),
            Flip("ds_phase"),
        )),
        # K, V, K^T stay until the pair's last MMA has read them.
        *(Read(buffer, "KV") for buffer in every("smem_kv")),
        MmaCommit(every("dkv_full"), 0),
    )

    def compute(cta):
        return (
            BlockLoop((
                Wait(name(cta, "s_full"), 0, "phase"),
                Wait(name(cta, "dp_full"), 0, "phase"),
                Read(name(cta, "tmem_s"), _tag("S")),
                Read(name(cta, "tmem_dp"), _tag("dP")),
                Write(name(cta, "tmem_s"), _tag("P"), readers=(mma,)),
                Write(name(cta, "tmem_dp"), _tag("dSt"), readers=(mma,)),
                # This CTA's keys of dS in both CTAs' dQ operands (the peer's through DSMEM).
                *(Write(name(target, f"sds.k{cta}"), _tag("dS"), readers=(mma,)) for target in CTAS),
                Arrive(name(0, "ds_ready"), 0),
                Flip("phase"),
            )),
            Wait(name(cta, "dkv_full"), 0, "dkv_phase"),
            Read(name(cta, "tmem_dv"), _last("dV")),
            Read(name(cta, "tmem_dk"), _last("dK")),
        )

    def dq(cta):
        turns = ()
        if deterministic:
            # Pairs in turn order (ordered_reduction.key_block_turn), CTA 0 of a pair before CTA 1.
            turns = (TurnWait(TURN_COUNTER, lambda v: turn(v.block)[0], lambda v: 2 * turn(v.block)[1] + cta),
                     TurnPass(TURN_COUNTER, lambda v: turn(v.block)[0]))
        return (
            BlockLoop((
                Wait(name(cta, "dq_full"), 0, "phase"),
                Read(name(cta, "tmem_dp"), _tag("dQ")),
                Arrive(name(0, "dq_empty"), 0),
                *turns,
                Flip("phase"),
            )),
        )

    barriers = (
        Barrier(name(0, "kv_full"), 1, ELECTED),
        *(Barrier(barrier, 1, ELECTED) for barrier in every("s_full") + every("dp_full")),
        Barrier(name(0, "ds_ready"), 1, PAIR_THREADS),
        *(Barrier(barrier, 1, ELECTED) for barrier in every("dq_full")),
        Barrier(name(0, "dq_empty"), 1, PAIR_THREADS),
        *(Barrier(barrier, 1, ELECTED) for barrier in every("dkv_full")),
    )
    pipelines = (
        Pipeline(load_q, TMA_UMMA, q_stages, every("load"), mma, ELECTED, ELECTED, every("smem_q"),
                 tx_bytes=query_bytes),
    )
    roles = (
        *(Role(name(cta, "load"), load(cta), ELECTED, cta=cta) for cta in CTAS),
        # dq_empty's first wait passes: there is no previous block's dQ to wait for.
        Role(mma, mma_program, ELECTED, mma=True, initial_phases=(("dq_empty_phase", 1),), cta=0),
        *(Role(name(cta, "compute"), compute(cta), ROWS, cta=cta) for cta in CTAS),
        *(Role(name(cta, "dq"), dq(cta), ROWS, cta=cta) for cta in CTAS),
    )
    return Schedule(barriers, pipelines, roles, stages=1, cluster=len(CTAS))


def block_phases(role: Role) -> dict:
    """{phase variable: True if flipped once per query block, False if never} for each phase variable
    `role` waits with: the kernel's role loops compute a phase in block `it` of the walk as its
    initial value flipped `it` times (Sm100BackwardKernel.parity), which holds only for these two
    patterns, and a one-stage pipeline's phase likewise from its slots taken; any other raises."""
    (loop,) = [step for step in role.program if isinstance(step, BlockLoop)] or [BlockLoop(())]
    inside = [step.phase for step in loop.body if isinstance(step, Flip)]
    outside = [step.phase for step in role.program if isinstance(step, Flip)]
    waited = {step.phase for step in role.program + loop.body if isinstance(step, Wait)}
    if outside or len(inside) != len(set(inside)) or not set(inside) <= waited:
        raise ValueError(f"role {role.name}: phases must flip once per query block or never "
                         f"(flipped in the loop: {inside}, outside it: {outside})")
    # Likewise a pipeline participant's phase (one stage): one acquire or wait per block, a drain after.
    advances = [step.pipeline for step in loop.body if isinstance(step, (Acquire, ConsumerWait))]
    if len(advances) != len(set(advances)) or any(
            isinstance(step, (Acquire, ConsumerWait)) or isinstance(step, Drain) and step.pipeline not in advances
            for step in role.program):
        raise ValueError(f"role {role.name}: a pipeline slot must be taken once per query block")
    return {phase: phase in inside for phase in waited}
