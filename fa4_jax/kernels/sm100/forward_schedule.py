"""The sm100 forward kernel's mbarrier protocol (fa4_jax.kernels.common.pipeline_schedule vocabulary).

`Sm100ForwardKernel` takes its pipeline stage counts, barrier arrival counts and TMA byte counts from
`forward_schedule`, and checks each role method's synchronisation calls against the role programs here
while it is traced; tests/test_sm100_protocol.py replays the programs over several persistent tiles.

Buffers the programs name (what each hand-off protects):
  smem_q[s], smem_kv[s]   the Q tiles and the K/V ring (pipeline slots, filled by TMA)
  smem_o[s]               the O staging tile and its LSE rows (epilogue pipeline slots)
  tmem_s{i}               S_i, then P_i over it (TMEM of query tile i)
  tmem_o{i}               the O_i accumulator (TMEM)
  row_scale{i}            the rows' rescale factors of the current key block (shared memory)
  row_stats{i}            the rows' 1/sum and LSE at the end of a tile (shared memory)
Tags name what a buffer holds: "S2.3" is S of the CTA's third tile, fourth key block; "O2.3r" is O after
the correction warpgroup rescaled it for the fifth block.
"""

from __future__ import annotations

import dataclasses

from fa4_jax.kernels.common.pipeline_schedule import (
    ASYNC, STAGE, TMA_UMMA, Acquire, Arrive, Barrier, BlockLoop, Commit, ConsumerWait, Either, Flip,
    Mma, MmaCommit, Pipeline, Read, Release, Role, Schedule, Stages, TileLoop, TmaLoad, Wait, Write)

ROWS_PER_TILE = 128
SOFTMAX_THREADS = ROWS_PER_TILE        # one row per thread
CORRECTION_THREADS = ROWS_PER_TILE
EPILOGUE_THREADS = 32
ELECTED = 1                            # TMA expect_tx and tcgen05.commit come from one elected thread


def _tag(prefix, block=lambda v: v.block):
    return lambda v: f"{prefix}{v.tile}.{block(v)}"


def _softmax_program():
    hand_over_p = (
        Write("row_scale{stage}", _tag("scale"), readers=("correction",)),
        Arrive("stats_ready", STAGE),
        Write("tmem_s{stage}", _tag("P"), readers=("mma",)),
        Arrive("p_ready", STAGE),
    )
    return (TileLoop((
        BlockLoop((
            Wait("s_full", STAGE, "s_full_phase"),
            Flip("s_full_phase"),
            Read("tmem_s{stage}", _tag("S")),
            # Masked and unmasked blocks: each branch hands P over itself (Sm100ForwardKernel.hand_over_p).
            Either(hand_over_p, hand_over_p),
        )),
        # The correction warpgroup may still be reading the previous tile's: with a single key block
        # nothing else orders this write after that read.
        Wait("stats_free", STAGE, "stats_free_phase"),
        Flip("stats_free_phase"),
        Write("row_stats{stage}", lambda v: f"final{v.tile}", readers=("correction",)),
        Arrive("stats_final", STAGE),
    )),)


def _previous_o(v, suffix=""):
    """O_i as the PV of block v.block - 1 left it (None for the tile's first block, which overwrites)."""
    return None if v.block == 0 else f"O{v.tile}.{v.block - 1}{suffix}"


def _mma_program():
    def qk(block):
        return Mma(reads=(("@q{stage}", lambda v: f"Q{v.tile}.{v.stage}", False),
                          ("@k", _tag("K", block), False)),
                   writes=(("tmem_s{stage}", _tag("S", block), ("softmax{stage}",)),))

    def pv(block):
        return Mma(reads=(("tmem_s{stage}", _tag("P", block), True),
                          ("@v", _tag("V", block), False),
                          ("tmem_o{stage}", lambda v: _previous_o(dataclasses.replace(v, block=block(v)), "r"), True)),
                   writes=(("tmem_o{stage}", _tag("O", block), ("correction",)),))

    return (TileLoop((
        Stages((ConsumerWait("load_q", "q{stage}"),)),
        ConsumerWait("load_kv", "k"),
        Stages((qk(lambda v: 0), MmaCommit("s_full", STAGE))),
        Release("k"),
        # Key block j: PV of block j - 1, then QK of block j (in-order tcgen05 keeps P alive for the PV).
        BlockLoop((
            ConsumerWait("load_kv", "k"),
            ConsumerWait("load_kv", "v"),
            Stages((
                Wait("p_ready", STAGE, "p_ready_phase"),
                pv(lambda v: v.block - 1),
                qk(lambda v: v.block),
                MmaCommit("s_full", STAGE),
            )),
            Flip("p_ready_phase"),
            Release("k"),
            Release("v"),
        ), first=1),
        ConsumerWait("load_kv", "v"),
        Stages((
            Wait("p_ready", STAGE, "p_ready_phase"),
            pv(lambda v: v.blocks - 1),
            MmaCommit("o_full", STAGE),
        )),
        Flip("p_ready_phase"),
        Release("v"),
        Stages((Release("q{stage}"),)),
    )),)


def _load_program(q_tile_bytes, kv_tile_bytes):
    return (TileLoop((
        Stages((Acquire("load_q", "q"), TmaLoad("q", lambda v: f"Q{v.tile}.{v.stage}", q_tile_bytes))),
        Acquire("load_kv", "k"),
        TmaLoad("k", _tag("K", lambda v: 0), kv_tile_bytes),
        BlockLoop((
            Acquire("load_kv", "k"),
            TmaLoad("k", _tag("K"), kv_tile_bytes),
            Acquire("load_kv", "v"),
            TmaLoad("v", _tag("V", lambda v: v.block - 1), kv_tile_bytes),
        ), first=1),
        Acquire("load_kv", "v"),
        TmaLoad("v", _tag("V", lambda v: v.blocks - 1), kv_tile_bytes),
    )),)


def _correction_program():
    return (TileLoop((
        BlockLoop((
            Stages((
                Wait("stats_ready", STAGE, "stats_phase"),
                Read("row_scale{stage}", _tag("scale")),
                # The first block's PV overwrites O; later blocks rescale what the previous PV left.
                Read("tmem_o{stage}", _previous_o),
                Write("tmem_o{stage}", lambda v: _previous_o(v, "r"), readers=("mma",)),
                Arrive("p_ready", STAGE),
            )),
            Flip("stats_phase"),
        )),
        Stages((
            Wait("stats_final", STAGE, "final_phase"),
            Read("row_stats{stage}", lambda v: f"final{v.tile}"),
            Arrive("stats_free", STAGE),
            Wait("o_full", STAGE, "final_phase"),
            Acquire("epilogue", "o"),
            Read("tmem_o{stage}", _tag("O", lambda v: v.blocks - 1)),
            Write("@o", lambda v: f"out{v.tile}.{v.stage}", readers=("epilogue",)),
            Commit("o"),
        )),
        Flip("final_phase"),
    )),)


def _epilogue_program():
    return (TileLoop((
        Stages((
            ConsumerWait("epilogue", "o"),
            Read("@o", lambda v: f"out{v.tile}.{v.stage}", done=False),
            Release("o"),
        )),
    )),)


def forward_schedule(q_stage: int, kv_stage: int, epi_stage: int, q_tile_bytes: int,
                     kv_tile_bytes: int) -> Schedule:
    """The protocol of one Sm100ForwardKernel configuration (its tile shape's stage counts)."""
    barriers = (
        Barrier("s_full", q_stage, ELECTED),                                   # MMA -> softmax i
        Barrier("o_full", q_stage, ELECTED),                                   # MMA -> correction
        Barrier("p_ready", q_stage, SOFTMAX_THREADS + CORRECTION_THREADS),     # both -> MMA
        Barrier("stats_ready", q_stage, SOFTMAX_THREADS),                      # softmax i -> corr.
        Barrier("stats_final", q_stage, SOFTMAX_THREADS),
        Barrier("stats_free", q_stage, CORRECTION_THREADS),                    # corr. -> softmax i
    )
    pipelines = (
        Pipeline("load_q", TMA_UMMA, q_stage, "load", "mma", ELECTED, ELECTED, "smem_q",
                 tx_bytes=q_tile_bytes),
        # K and V tiles alternate through one ring (same size since d_v = d).
        Pipeline("load_kv", TMA_UMMA, kv_stage, "load", "mma", ELECTED, ELECTED, "smem_kv",
                 tx_bytes=kv_tile_bytes),
        Pipeline("epilogue", ASYNC, epi_stage, "correction", "epilogue", CORRECTION_THREADS,
                 EPILOGUE_THREADS, "smem_o"),
    )
    roles = (
        Role("load", _load_program(q_tile_bytes, kv_tile_bytes), ELECTED),
        Role("mma", _mma_program(), ELECTED, mma=True),
        # stats_free's first wait passes: there is no previous tile's row_stats to wait for.
        *(Role(f"softmax{stage}", _softmax_program(), SOFTMAX_THREADS, stage=stage,
               initial_phases=(("stats_free_phase", 1),))
          for stage in range(q_stage)),
        Role("correction", _correction_program(), CORRECTION_THREADS),
        Role("epilogue", _epilogue_program(), EPILOGUE_THREADS),
    )
    return Schedule(barriers, pipelines, roles, q_stage)
