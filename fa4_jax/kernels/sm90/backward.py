"""Hopper (sm_90a) attention backward for head dims 64, 96 and 128: dQ, dK, dV in CuTe DSL.

The preprocess, the launch and the postprocess are kernels/host.py's; this kernel
(`Sm90BackwardKernel`): one CTA per (key block, KV head, batch) keeps its K and V tiles in shared
memory and its dK, dV accumulators in registers while it walks the query blocks of every query head
of its group. Per query block it recomputes S^T = K Q^T and P^T from the stored LSE, dP^T = V dO^T,
dS^T = P^T * (dP^T - dPsum) (times the softcap derivative), dV += P^T dO and dK += dS^T Q with
P^T / dS^T straight from registers (wgmma with A in registers), then stages dS in shared memory for
dQ = dS K, and stages dQ in shared memory for the dQ writer warp, which adds it into the fp32
accumulator in global memory with TMA bulk reduce-adds. (At D = 128 without a mask the blocks are 80
query rows and dQ is computed transposed, dQ^T = K^T dS^T: `Tuning.query_rows`.)

Warp roles: warp group 0 is the producer (warp 0 issues the TMA loads of K, V once and of Q, dO per
query block into a two-deep ring of mbarrier-guarded buffers; warp 1, the dQ writer, issues the dQ
reduce-adds); warp groups 1 and 2 are consumers, each owning 64 of the tile's 128 keys for S, dP,
dK, dV and half of the head dimension for dQ.

`Tuning` holds the choices that change speed only; DEFAULT_TUNING is what the H200 sweep measured
fastest (docs/sm90_backward_tuning.md has the measurements and the predictions behind them).

deterministic=True orders the dQ additions: a per (batch, query head, query block) counter in global
memory lets key block n add only after every higher key block of the tile has added, so the fp32
sums happen in one fixed order and the result is bitwise reproducible (the turns are
common/ordered_reduction.py's, shared with backward_large_heads). Highest first ("diagonal first")
because under a causal mask key block n starts at query block ~2n, so key block n + 1 reaches every
tile two steps before key block n: the turn order is the arrival order and nobody waits (lowest
first, key block n would wait ~2n steps at its first tile). The key blocks of a head
launch highest first too, so a CTA only ever waits for CTAs launched before it (no deadlock).

Head splits (`options.head_splits` > 1, for GQA / MQA): with few KV heads one CTA per (key block,
KV head, batch) leaves SMs idle, and under a causal mask the key blocks' walks differ in length by up
to 2x, so a single wave lasts as long as its longest CTA. Then `head_splits` CTAs share each (key
block, KV head, batch): grid y is kv_heads * head_splits, and CTA (n, kv_head * head_splits + s, b)
walks query heads kv_head * group + s * group / head_splits onwards (group / head_splits of them, in
the unsplit order). Its dK, dV are partial sums: it stages them in fp32 over the Q / dO rings and the
K / V tiles, which nothing reads after the last query block, and adds them with TMA bulk reduce-adds
into zeroed fp32 accumulators that the JAX side then casts. `head_splits_for` picks the split when
`Tuning.head_splits` is None. Deterministic mode takes at most 2: two fp32 addends onto zero give the
same bits in either order (0 + a + b == 0 + b + a), three or more do not.

Packed variable-length sequences (attention_varlen, `options.packed`; B = 1): grid x is
tile_scheduler.packed_key_item's slots over (sequence, key block), and each CTA runs the walk above in
its sequence's own rows (TMA coordinates offset to the sequence's first query row and key, the rows and
keys past its ends masked as past its lengths). A sequence starts at any row, so its dQ tiles are TMA
reduces at that row (the tiled staging; the last one adds exact zeros into the next sequence's rows),
dK / dV go out by per-element stores clipped at its end and the row statistics by per-thread loads;
deterministic turn counters are per (sequence, query block) slot. Slot order keeps a sequence's key
blocks in order, so the reversed launch is still the turn order.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_helpers
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.experimental import primitives
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from fa4_jax.config import AttentionConfig
from fa4_jax.kernels import host
from fa4_jax.kernels.common import masking, ordered_reduction, tile_scheduler
from fa4_jax.kernels.sm90 import DEFAULT_SM_COUNT, backward_common
from fa4_jax.kernels.sm90.backward_common import BackwardOptions, Sm90BackwardBase
from fa4_jax.kernels.sm90.wgmma import (K_MAJOR, MN_MAJOR, WARP_GROUP, gemm, k_major_layout, mn_major_layout,
                                        query_major_view, swizzle_columns, transpose_view, warpgroup_first_thread)

SUPPORTED_HEAD_DIMS = (64, 96, 128)
# (192 and 256, whose dK + dV accumulators do not fit this kernel's registers, are backward_large_heads'.)
TILE_N = 128     # keys per CTA (64 per consumer warp group)
QUERY_STAGES = 2     # Q / dO ring depth (a third stage measured no faster and leaves no room for dQ)


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Choices that change the speed, not the function computed (beyond dQ's fp32 summation order).

    The first three default to what the H200 sweep measured fastest (docs/sm90_backward_tuning.md);
    turning one off
    gives the code path that configurations short of registers take anyway. With softcap or segment
    ids those three are off (`Sm90BackwardKernel` says why).

    early_dv: issue dV += P^T dO as soon as P is in registers, so the dS arithmetic and the dPsum loads
      run while the tensor cores compute dV (otherwise dV waits for dS, behind dP).
    staged_row_stats: the producer copies each query block's LSE and dPsum (64 floats each) into the
      Q / dO stage with one bulk copy apiece, and the consumers read them from shared memory where
      they are used, instead of 32 scattered global loads per thread per block held in registers.
    tma_dkv_store: at the end, dK and dV go through shared memory (over K and V, no longer read) and
      two TMA bulk stores, instead of 128 two-byte global stores per thread.
    head_splits: CTAs that share a (key block, KV head, batch), each walking group / head_splits of
      its query heads and adding fp32 partial dK / dV (the module docstring says how). None:
      `head_splits_for` chooses (in `options`, where the shapes are known); a number forces it
      (benchmark sweeps, tests). It changes the fp32 summation order of dK and dV too.
    query_rows: query rows per block (the GEMMs' N for S^T / dP^T, K for dV / dK, M for dQ): 64, or
      128 where registers and shared memory allow it (D = 64 without softcap, segment ids or head
      splits), which halves the per-block fixed costs (barrier hand-offs, pipeline waits, row
      statistics) per FLOP. None: `query_rows_for` chooses (in `options`).
      80 (TRANSPOSED_DQ_ROWS; the default at D = 128 without a mask, head splits or determinism): 80 is
      no multiple of wgmma's M = 64, so dQ is computed transposed, dQ^T = K^T dS^T, the warp groups
      splitting the head dim (M) and the query rows N; S^T and dP^T are m64n80 (40 registers each
      beside dK, dV's 128) and shared memory holds one dQ staging buffer (two dS buffers, Q / dO rings
      of 80 rows: 227 KiB, the whole budget). dQ^T goes through the tiled staging (`options` resolves
      flat_dq off): in the register order its head dims lie 16 floats apart, and the read-back took
      147 us against 70. Why: per 64 query rows the 64-row kernel issues 256 wgmma instructions and
      its fixed per-block work (barriers, descriptors, row statistics); 80 rows take 272 per 80 (ncu,
      an H100, rev aea2164: FA4's D = 128 kernel runs this shape, 5 % fewer instructions and 6 % fewer
      cycles than ours; docs/sm90_backward_tuning.md, "80 query rows"). Deterministic mode keeps 64
      rows: its two dQ writers need two staging buffers, and 80 rows with one writer measured slower
      there (docs/sm90_backward_tuning.md, "Deterministic at 80 rows").
    flat_dq: stage dQ in the wgmma accumulator's own register order (each thread's 4-value chunks side
      by side: 128-bit shared stores without bank conflicts, where the swizzled [rows, D/2] tile
      takes 64-bit stores that conflict 2-way) and add it with one 1-D bulk reduce per block into an
      fp32 accumulator kept in that order ([B, Hq, query block, rows x D], `backward_common.dq_from_fragments`
      reads it back), instead of two TMA tensor reduces into a [B, Sq, Hq, D] accumulator.
      Measured 1.03-1.06x at D = 128 and 1.03-1.07x at D = 64 over the tiled staging (H200, rev
      82798e2, docs/sm90_backward_tuning.md); False keeps the tiled path for comparison.
    ds_stmatrix: stage dS^T for dQ with stmatrix (four 8x8 matrices per instruction, rows of one key
      and 8 contiguous queries) instead of one 32-bit store per register: at D = 128 4 STSM where 16
      STS and the 48 instructions of their swizzled addresses were, which ptxas recomputes every
      block for want of registers (SASS per block 472 -> 421; D = 64 at 128 rows 767 -> 648). Same
      values at the same places (`_ds_store_copy`, checked on the CPU by
      tests/test_kernel_compile_sm90_backward.py). Measured 1.008-1.017x at D = 128 and 1.024-1.043x
      at D = 64 (H200, rev 4bfbbaa, docs/sm90_backward_tuning.md); False keeps the plain stores.
    poly_exp2_every: every this many key columns of a thread's P, one exp2 runs as a polynomial on the
      FMA pipe (common/exp2_polynomial.py) instead of MUFU.EX2 (0: none). MUFU issues 16 exp2 per
      clock per SM; at D = 128 a 64 x 128 block's 8192 exponentials take 512 of its ~2560 tensor
      cycles, at D = 64 (128 rows, half the FLOPs per score) 1024, and only dP^T runs on the tensor
      cores meanwhile. A candidate, off until measured (docs/sm90_backward_tuning.md).
    dq_row_split: at 128 query rows (D = 64), the dQ GEMM's two warp groups split the query rows, each
      computing its 64 rows over the whole head dim (m64n64k16 at D = 64), instead of the head dim, each
      computing both 64-row atoms over half of it (m64n32k16). An SS wgmma reads its A and B slices from
      shared memory once per instruction: m64n32k16 reads 3 KB per 16 tensor-core clocks, 192 bytes a
      clock against the 128 shared memory gives, where m64n64k16 reads 4 KB per 32 (128). FA4's D = 64
      configuration splits dQ by rows too. The flat dQ staging then holds warp group g's rows 64 g ... in
      the place of the 64-row atom m (`dq_from_fragments` with one column group reads it). 128 query
      rows and flat_dq only. None (the default) takes it wherever those are chosen: measured +2.6 to
      +4.0 % at D = 64 (an H100, rev 6d8d911, docs/sm90_backward_tuning.md, "dq_row_split measured");
      False keeps the column split.
    rotated_turns (deterministic, full masks): key block n walks its query blocks starting at n (mod
      their count) and each tile takes its adds in arrival order (`ordered_reduction.rotated_turn`),
      instead of every key block walking from the first query block, where they queue at each tile
      one add after another (key block n starts ~n add latencies late: the full rows' 0.73-0.76x of
      the default on an H100). A key block then also waits for key blocks launched after it, so it is
      taken only where all key blocks of a head fit on the GPU at once (`rotated_turns_reason`) and
      resolved to False elsewhere (`options`). On: measured on an H100 (rev 17f1841, cuDNN ms / ours,
      deterministic full masks at 1k / 4k): D = 64 0.84 / 0.84 -> 0.97 / 0.97, D = 128 0.79 / 0.79 ->
      0.83 / 0.82 (docs/sm90_backward_tuning.md, "Deterministic dQ: rotated turns"). False: every key
      block walks from the first query block, the turns highest key block first.
    dq_writers (deterministic): warps of the producer warp group that write dQ, 1 or DQ_BUFFERS (2). In
      deterministic mode a writer holds its staging buffer through the tile's turn, the add's completion
      in global memory and the release of the turn (~1.5-2 us a block at D = 128, against a block of
      ~2.6 us); one writer runs those chains one block after another, so the consumers, at most
      DQ_BUFFERS blocks ahead, wait for a free buffer (ncu, an H100, rev c09cd79: their wait is 16 % of
      the warp samples deterministic, 6 % default). With DQ_BUFFERS writers, writer w takes the blocks
      i = w (mod DQ_BUFFERS), always in buffer w, so the chains of consecutive blocks overlap; each
      stage's mbarriers still pass between the consumers and one writer, one phase at a time. Each
      tile's adds keep their order (the turns), so dQ is one writer's bit for bit; no wait is added
      (block i still needs only block i - DQ_BUFFERS's buffer back), so the turns stay free of cycles.
      Measured on an H100 (rev ceba8e5, cuDNN ms / ours, deterministic 1k / 4k): D = 128 full 0.82 /
      0.80 -> 0.96 / 0.92, causal 0.88 / 0.88 -> 1.02 / 1.09; D = 64 full 0.96 / 0.98 -> 0.98 / 0.97,
      causal 1.07 / 1.08 -> 1.08 / 1.13 (docs/sm90_backward_tuning.md). Resolved to 1 outside
      deterministic mode (`options`), where one writer keeps up.
    ds_store_first: where dV waits for dS (early_dv off, or not taken: 80 and 128 query rows, the defaults
      at D = 128 and 64), store dS^T to shared memory before issuing dV rather than after, so that dV's
      issue stands between the stores and the shared-memory fence before the dQ GEMM. Issued right before
      the fence, the stores were still in flight there: an ncu profile (an H100, rev 1f1461b) put 8 % of
      the consumers' samples at D = 128 (13 % at D = 64) on that fence and the barrier after it, against
      1 % in FA4, which issues a GEMM between its dS stores and the fence. A candidate, off until measured
      (docs/sm90_backward_tuning.md, "dS stored before dV").
    row_stats_early (staged_row_stats): load this thread's staged LSE into registers before the wait for S,
      and its dPsum before the wait for dP, instead of reading shared memory at their first use after the
      wait: there the first FFMA of each row waited for its LDS (short scoreboard: ~12 % of the consumers'
      samples at D = 128 causal GQA, 64 rows, in the rev 1f1461b profile). FA4 loads them while its S GEMM
      is issued. Costs a register a row across the wait: taken at 64 query rows only (D = 96, D = 128
      causal or deterministic), where it fits. A candidate, off until measured (docs/sm90_backward_tuning.md,
      "Row statistics loaded before the wait").
    dq_publish_after_dk: where dQ is staged while dK runs (`stage_dq_under_dk`), publish the staged dQ to
      the writer warp (the proxy fence that orders the stores before its bulk reduce, and the commit) after
      the wait for dK instead of right after the stores. Right after them the fence waited for the stores'
      completion (long scoreboard: 5.4 % of the consumers' samples at D = 128 causal GQA, 4.0 % at D = 64,
      ncu, an H100, rev 1f1461b; FA4 pays the same there); after the dK wait they have landed under dK.
      The writer gets each block a dK later, inside the DQ_BUFFERS slack. A candidate, off until measured
      (docs/sm90_backward_tuning.md, "dQ published after dK").
    key_blocks_outer: launch the grid key block slowest, (head slice, batch, key block) for
      (x, y, z), so every head's key block 0 (under a causal mask the longest walk) starts before any
      key block 1 (longest first across the whole grid), instead of key block fastest. Off: measured
      on the H200 below head_splits_for's split in the normal order on two of three GQA / MQA rows
      (docs/sm90_backward_tuning.md). Deterministic mode ignores it: its turn order launches the
      highest key block first, so the grid would start with every head's shortest walk.
    """
    early_dv: bool = True
    staged_row_stats: bool = True
    tma_dkv_store: bool = True
    head_splits: Optional[int] = None
    key_blocks_outer: bool = False
    query_rows: Optional[int] = None
    flat_dq: bool = True
    ds_stmatrix: bool = True
    poly_exp2_every: int = 0
    dq_row_split: Optional[bool] = None
    rotated_turns: bool = True
    dq_writers: int = 2   # DQ_BUFFERS
    ds_store_first: bool = False
    row_stats_early: bool = False
    dq_publish_after_dk: bool = False


DEFAULT_TUNING = Tuning()


def unsupported_reason(config: AttentionConfig, problem: host.Problem) -> Optional[str]:
    """Why this kernel cannot take the call, or None when it can."""
    reason = backward_common.unsupported_reason("sm90 backward", config, problem, SUPPORTED_HEAD_DIMS,
                                                takes_packed=True)
    if reason is None and config.has_cu_seqlens and (config.has_segment_ids or config.has_q_seq_lengths
                                                     or config.has_kv_seq_lengths or config.has_q_start):
        # The packed scheduler takes each sequence's extents from the offsets alone, as the forward's.
        return ("sm90 backward does not combine packed sequences (cu_seqlens) with segment ids, sequence lengths "
                "or q_start")
    return reason


# ----------------------------------------------------------------------------------------------------
# The CuTe kernel
# ----------------------------------------------------------------------------------------------------

DS_READY_BARRIER = 1
DQ_BUFFERS = 2             # dQ staging buffers between the consumers and the dQ writer warp
WGMMA_M = 64               # wgmma's M per warp group: the query rows are N of S^T, M of dQ
TRANSPOSED_DQ_ROWS = 80    # `Tuning.query_rows` whose dQ is computed transposed (M = head dim)
TRANSPOSED_DQ_HEAD_DIMS = (128,)   # two warp groups x wgmma's M = 64 head-dim rows of dQ^T
DETERMINISTIC_HEAD_SPLITS = 2   # fp32 partial sums that add onto zero in an order-free way


class Sm90BackwardKernel(Sm90BackwardBase):
    """The backward kernel for head dims 64-128; `__call__` is the host-side launcher."""

    def __str__(self):
        # The DSL names the compiled kernel after str(self): a fixed name instead of the default
        # repr (module path and address), so profiles show it and moving the class renames nothing.
        return "fa4_jax_sm90_backward"

    def __init__(self, options: BackwardOptions):
        super().__init__(options)
        tuning = options.tuning
        # Softcap and segment ids leave no registers to spare: there early_dv, staged_row_stats
        # and tma_dkv_store each make ptxas spill (D = 128: 148/92, 36/8 and 48 bytes), so those
        # configurations take none of them.
        register_bound = options.softcap is not None or options.has_segment_ids
        self.tile_m = tuning.query_rows or backward_common.TILE_M
        masked = options.causal or options.window_left is not None or options.window_right is not None
        reason = (query_rows_reason(self.tile_m, self.head_dim, options.head_splits, register_bound,
                                    options.deterministic, tuning.flat_dq, tuning.ds_stmatrix)
                  or dq_row_split_reason(tuning, self.tile_m))
        if reason is not None:
            raise ValueError(reason)
        self.dq_transposed = self.tile_m == TRANSPOSED_DQ_ROWS
        # At 128 query rows S^T, dP^T, dK and dV take 192 registers already: early dV's live P^T
        # operand on top makes ptxas serialize the wgmmas (and spill), so it waits for dS there.
        self.early_dv = tuning.early_dv and not register_bound and self.tile_m == backward_common.TILE_M
        # dQ staged while dK runs keeps dQ, dS^T and dK, dV live together: ptxas spills 8 bytes
        # (the sm_90a compile grid) with softcap or segment ids, and with head splits and no mask.
        self.stage_dq_under_dk = not register_bound and (options.head_splits == 1 or masked)
        self.dq_publish_after_dk = tuning.dq_publish_after_dk and self.stage_dq_under_dk
        # Where dV waits for dS (not early_dv), `Tuning.ds_store_first` stores dS^T before issuing it.
        self.ds_store_first = tuning.ds_store_first and not self.early_dv
        # At 80 and 128 query rows the row statistics held across the waits spill (ptxas 13: 92-108 bytes at
        # D = 128, 16 at D = 64, with the LSE alone too), so `Tuning.row_stats_early` takes 64 rows only.
        self.row_stats_early = (tuning.row_stats_early and tuning.staged_row_stats and not register_bound
                                and self.tile_m == backward_common.TILE_M)
        self.staged_row_stats = tuning.staged_row_stats and not register_bound
        self.tma_dkv_store = tuning.tma_dkv_store and not register_bound
        self.key_blocks_outer = tuning.key_blocks_outer and not options.deterministic
        # Resolved by `options` (off where a head's key blocks may not all be resident at once).
        self.rotated_turns = tuning.rotated_turns and options.deterministic
        self.staggered_walk = self.rotated_turns    # `_first_query_block`, `_next_query_block`
        self.poly_exp2_every = tuning.poly_exp2_every
        self.head_splits = options.head_splits
        self.tile_n = TILE_N
        self.stages = QUERY_STAGES
        if self.packed:
            reason = packed_reason(self.head_splits, self.tile_m, tuning.flat_dq)
            if reason is not None:
                raise ValueError(reason)
            # A sequence's query and key blocks start anywhere in the packed rows: the bulk copies of
            # the row statistics need 16-byte aligned sources, and the TMA store of dK / dV would
            # overwrite the next sequence's first keys (written by another CTA), so those go by
            # per-thread loads and per-element stores clipped at the sequence's end. The grid is
            # the scheduler's slots on x.
            self.staged_row_stats = False
            self.tma_dkv_store = False
            self.key_blocks_outer = False
        self.dq_buffers = dq_staging_buffers(self.tile_m)
        if tuning.dq_writers not in (1, DQ_BUFFERS) or (tuning.dq_writers > 1 and not self.deterministic):
            raise ValueError(f"dq_writers={tuning.dq_writers}: one dQ writer warp, or in deterministic mode one per "
                             f"staging buffer ({DQ_BUFFERS})")
        self.dq_writers = tuning.dq_writers
        self.check_shared_memory()
        if self.head_splits != 1:
            self._check_head_splits()
        self.num_consumer_groups = 2
        self.num_threads = WARP_GROUP * (1 + self.num_consumer_groups)
        self.consumer_threads = WARP_GROUP * self.num_consumer_groups
        self.producer_registers = 24
        self.consumer_registers = 240

    def _check_head_splits(self):
        """Refuse a head split the kernel cannot do, and check the shared memory its fp32 dK / dV
        staging reuses: [tile_n, D] fp32 over the Q and dO rings, the same over K and V."""
        reason = head_splits_reason(self.head_splits, self.group, self.deterministic)
        if reason is not None:
            raise ValueError(reason)
        element = self.dtype.width // 8
        q_ring = self.stages * self.tile_m * self.head_dim * element
        key_tile = self.tile_n * self.head_dim * element
        partial = self.tile_n * self.head_dim * 4
        # SharedStorage's sQ, sdO, sK, sV are consecutive 1024-byte aligned members: sizes in whole
        # KiB leave no gap, so sQ + sdO and sK + sV are each one fp32 tile.
        assert q_ring % 1024 == 0 and key_tile % 1024 == 0, (q_ring, key_tile)
        assert 2 * q_ring == partial == 2 * key_tile, (q_ring, key_tile, partial)

    def shared_memory_bytes(self):
        """What `SharedStorage` takes, member by member with its alignment: the mbarriers, Q and dO
        rings, K, V, two dS buffers, the dQ staging buffers, the staged row statistics;
        the whole rounded up to its largest alignment."""
        element = self.dtype.width // 8
        q_ring = self.stages * self.tile_m * self.head_dim * element
        key_tile = self.tile_n * self.head_dim * element
        members = [(q_ring, 1024), (q_ring, 1024), (key_tile, 1024), (key_tile, 1024),
                   (2 * self.tile_m * self.tile_n * element, 1024),
                   (self.tile_m * self.head_dim * 4 * self.dq_buffers, 1024),
                   (self._row_stats_floats() * 4, 128), (self._row_stats_floats() * 4, 128)]
        offset = 8 * (2 * self.stages + 2 + 2 * self.dq_buffers)
        for size, alignment in members:
            offset = host.ceil_div(offset, alignment) * alignment + size
        return host.ceil_div(offset, 1024) * 1024

    def _row_stats_floats(self):
        """Floats per row statistic (LSE, dPsum) in shared memory: a query block per stage."""
        return self.tile_m * self.stages if self.staged_row_stats else 0

    # -------------------------------------------------------------------------------- host side
    def _tiled_mmas(self):
        d = self.head_dim
        # S^T = K Q^T and dP^T = V dO^T: M = keys (one warp group per 64), N = query rows.
        mma_sdp = sm90_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_MAJOR, K_MAJOR, Float32, (2, 1, 1), (64, self.tile_m))
        # dV += P^T dO, dK += dS^T Q: A = P^T / dS^T from registers, B = dO / Q read MN-major.
        mma_dkv = sm90_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_MAJOR, MN_MAJOR, Float32, (2, 1, 1), (64, d),
            warpgroup.OperandSource.RMEM)
        # dQ = dS K: A = dS (query rows contiguous), B = K read MN-major; warp groups split D, or the
        # query rows with `dq_row_split`.
        mma_dq = sm90_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, MN_MAJOR, MN_MAJOR, Float32, (1, 2, 1), (64, d // 2))
        if const_expr(self.tuning.dq_row_split):
            mma_dq = sm90_helpers.make_trivial_tiled_mma(
                self.dtype, self.dtype, MN_MAJOR, MN_MAJOR, Float32, (2, 1, 1), (WGMMA_M, d))
        if const_expr(self.dq_transposed):
            # dQ^T = K^T dS^T: A = K^T (head dim contiguous), B = dS^T read with the queries contiguous;
            # warp group g computes head-dim rows 64 g ... for all the block's queries.
            mma_dq = sm90_helpers.make_trivial_tiled_mma(
                self.dtype, self.dtype, MN_MAJOR, MN_MAJOR, Float32, (2, 1, 1), (WGMMA_M, self.tile_m))
        return mma_sdp, mma_dkv, mma_dq

    def _smem_layouts(self):
        d = self.head_dim
        q_layout = k_major_layout(self.dtype, self.tile_m, d, self.stages, swizzle_columns(d, 64))
        # K is read MN-major by dQ with N = D / 2 per warp group: its swizzle atom must fit that.
        k_layout = k_major_layout(self.dtype, self.tile_n, d, None, swizzle_columns(d // 2, 64))
        v_layout = k_major_layout(self.dtype, self.tile_n, d, None, swizzle_columns(d, 64))
        ds_layout = mn_major_layout(self.dtype, self.tile_m, self.tile_n, 2)
        # dQ staging for the TMA reduce: (rows, D/2, warp group, buffer) fp32 tiles, swizzled
        # (128 bytes where D/2 allows) so the accumulator stores do not conflict on banks.
        dq_layout = k_major_layout(Float32, self.tile_m, d // 2, (2, self.dq_buffers),
                                   swizzle_columns(d // 2, 32))
        if const_expr(self.tuning.flat_dq):
            dq_layout = cute.make_layout((self.tile_m * d, self.dq_buffers))
        return q_layout, k_layout, v_layout, ds_layout, dq_layout

    def _dkv_partial_layout(self):
        """Head splits: a [tile_n, D] fp32 dK or dV partial in shared memory for the TMA reduce-add,
        128-byte swizzled (32 fp32 columns) like the dQ staging."""
        return k_major_layout(Float32, self.tile_n, self.head_dim, None, swizzle_columns(self.head_dim, 32))

    @cute.jit
    def __call__(self, stream, mQ, mK, mV, mdO, mLSE, mdPsum, mQSegmentIds, mKVSegmentIds, mQSeqLengths, mKVSeqLengths,
                 mQStart, mCuSeqlensQ, mCuSeqlensK, mdQacc, mSemaphores, mdK, mdV=None):
        if const_expr(self.head_splits > 1):
            # One fp32 accumulator [2, B, Sk, Hkv, D] for dK and dV (host.launch_backward says why).
            accumulators = mdK
            single = cute.select(accumulators.layout, mode=[1, 2, 3, 4])
            mdK = cute.make_tensor(accumulators.iterator, single)
            mdV = cute.make_tensor(accumulators.iterator + cute.crd2idx((1, 0, 0, 0, 0), accumulators.layout),
                                   single)
        # Logical views: rows, head dim, head, batch (JAX arrays are [B, S, H, D] row-major).
        qkv_order = [1, 3, 2, 0]
        mQ, mK, mV, mdO, mdK, mdV = [
            cute.make_tensor(t.iterator, cute.select(t.layout, mode=qkv_order))
            for t in (mQ, mK, mV, mdO, mdK, mdV)]
        if const_expr(not self.tuning.flat_dq):      # flat: [B, Hq, query block, rows x D] as it is
            mdQacc = cute.make_tensor(mdQacc.iterator, cute.select(mdQacc.layout, mode=qkv_order))
        # Row statistics [B, H, S_pad] -> (S_pad, H, B).
        mLSE, mdPsum = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 1, 0]))
                        for t in (mLSE, mdPsum)]

        mma_sdp, mma_dkv, mma_dq = self._tiled_mmas()
        q_layout, k_layout, v_layout, ds_layout, dq_layout = self._smem_layouts()
        q_stage_layout = cute.select(q_layout, mode=[0, 1])

        tma_q, tma_mQ = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mQ, q_stage_layout, (self.tile_m, self.head_dim))
        tma_do, tma_mdO = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mdO, q_stage_layout, (self.tile_m, self.head_dim))
        tma_k, tma_mK = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mK, k_layout, (self.tile_n, self.head_dim))
        tma_v, tma_mV = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mV, v_layout, (self.tile_n, self.head_dim))
        tma_dq, tma_mdQ = None, mdQacc
        if const_expr(not self.tuning.flat_dq):
            tma_dq, tma_mdQ = cpasync.make_tiled_tma_atom(
                cpasync.CopyReduceBulkTensorTileS2GOp(), mdQacc, cute.select(dq_layout, mode=[0, 1]),
                (self.tile_m, self.head_dim // 2))
        tma_dk, tma_mdK, tma_dv, tma_mdV = None, None, None, None
        if const_expr(self.head_splits > 1):
            # mdK, mdV are the fp32 accumulators the CTAs of a head split add their partials into.
            partial_layout = self._dkv_partial_layout()
            tma_dk, tma_mdK = cpasync.make_tiled_tma_atom(
                cpasync.CopyReduceBulkTensorTileS2GOp(), mdK, partial_layout, (self.tile_n, self.head_dim))
            tma_dv, tma_mdV = cpasync.make_tiled_tma_atom(
                cpasync.CopyReduceBulkTensorTileS2GOp(), mdV, partial_layout, (self.tile_n, self.head_dim))
        elif const_expr(self.tma_dkv_store):
            tma_dk, tma_mdK = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), mdK, k_layout, (self.tile_n, self.head_dim))
            tma_dv, tma_mdV = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), mdV, v_layout, (self.tile_n, self.head_dim))
        self.query_block_bytes = 2 * cute.size_in_bytes(self.dtype, q_stage_layout)
        if const_expr(self.staged_row_stats):
            self.query_block_bytes += 2 * self.tile_m * 4
        self.key_block_bytes = (cute.size_in_bytes(self.dtype, k_layout)
                                + cute.size_in_bytes(self.dtype, v_layout))

        align = 1024

        @cute.struct
        class SharedStorage:
            query_barriers: cute.struct.MemRange[cutlass.Int64, self.stages * 2]
            key_barriers: cute.struct.MemRange[cutlass.Int64, 2]
            dq_barriers: cute.struct.MemRange[cutlass.Int64, 2 * self.dq_buffers]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(q_layout)], align]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(q_layout)], align]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(k_layout)], align]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(v_layout)], align]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(ds_layout)], align]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(dq_layout)], align]
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, self._row_stats_floats()], 128]
            sdPsum: cute.struct.Align[cute.struct.MemRange[Float32, self._row_stats_floats()], 128]

        self.shared_storage = SharedStorage
        # shared_memory_bytes() is what __init__ checks tunings against.
        assert SharedStorage.size_in_bytes() == self.shared_memory_bytes(), (
            SharedStorage.size_in_bytes(), self.shared_memory_bytes())
        num_n_blocks = cute.ceil_div(cute.size(mK, mode=[0]), self.tile_n)
        if const_expr(self.packed):
            num_n_blocks = tile_scheduler.packed_slots_per_head(self.options.num_sequences, cute.size(mK, mode=[0]),
                                                                self.tile_n)
        grid = (num_n_blocks, cute.size(mK, mode=[2]), cute.size(mK, mode=[3]))
        if const_expr(self.head_splits > 1):
            grid = (num_n_blocks, cute.size(mK, mode=[2]) * self.head_splits, cute.size(mK, mode=[3]))
        if const_expr(self.key_blocks_outer):
            grid = (cute.size(mK, mode=[2]) * self.head_splits, cute.size(mK, mode=[3]), num_n_blocks)
        self.kernel(mma_sdp, mma_dkv, mma_dq, tma_q, tma_mQ, tma_do, tma_mdO, tma_k, tma_mK,
                    tma_v, tma_mV, mLSE, mdPsum, mQSegmentIds, mKVSegmentIds, mQSeqLengths, mKVSeqLengths, mQStart, mCuSeqlensQ, mCuSeqlensK,
                    mSemaphores, mdK,
                    mdV, tma_dq, tma_mdQ, tma_dk, tma_mdK, tma_dv, tma_mdV, mQ.shape[0],
                    q_layout, k_layout, v_layout, ds_layout, dq_layout).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    # ------------------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, mma_sdp, mma_dkv, mma_dq, tma_q, mQ, tma_do, mdO, tma_k, mK, tma_v, mV,
               mLSE, mdPsum, mQSegmentIds, mKVSegmentIds, mQSeqLengths, mKVSeqLengths, mQStart, mCuSeqlensQ,
               mCuSeqlensK, mSemaphores, mdK, mdV,
               tma_dq, mdQ_tma, tma_dk, tma_mdK, tma_dv, tma_mdV, q_len_static, q_layout, k_layout,
               v_layout, ds_layout, dq_layout):
        tidx, _, _ = cute.arch.thread_idx()
        n_block, kv_head, batch = cute.arch.block_idx()
        if const_expr(self.deterministic and not self.rotated_turns):
            n_block = cute.arch.grid_dim()[0] - 1 - n_block      # launched in dQ turn order
        if const_expr(self.key_blocks_outer):        # the other launch order, instead
            kv_head, batch, n_block = cute.arch.block_idx()
            if const_expr(self.deterministic):
                n_block = cute.arch.grid_dim()[2] - 1 - n_block
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warp_group = cute.arch.make_warp_uniform(tidx // WARP_GROUP)

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        sQ = storage.sQ.get_tensor(q_layout.outer, swizzle=q_layout.inner)
        sdO = storage.sdO.get_tensor(q_layout.outer, swizzle=q_layout.inner)
        sK = storage.sK.get_tensor(k_layout.outer, swizzle=k_layout.inner)
        sV = storage.sV.get_tensor(v_layout.outer, swizzle=v_layout.inner)
        sdS = storage.sdS.get_tensor(ds_layout.outer, swizzle=ds_layout.inner)
        if const_expr(self.tuning.flat_dq):
            sdQ = storage.sdQ.get_tensor(dq_layout)
        else:
            sdQ = storage.sdQ.get_tensor(dq_layout.outer, swizzle=dq_layout.inner)
        sLSE = None
        sdPsum = None
        if const_expr(self.staged_row_stats):
            stats_layout = cute.make_layout((self.tile_m, self.stages))
            sLSE = storage.sLSE.get_tensor(stats_layout)
            sdPsum = storage.sdPsum.get_tensor(stats_layout)

        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread)
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                              self.consumer_threads // 32)
        # A query stage's empty mbarrier expects one arrival from every consumer thread (not one per
        # warp, as `consumers` gives the key pipe): every thread reads the stage's staged LSE / dPsum
        # rows, so the producer may copy the next block into the stage only after each reader has
        # arrived itself. The consumers' release below is a plain per-thread arrive to match.
        query_releasers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.consumer_threads)
        query_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.query_barriers.data_ptr(), num_stages=self.stages,
            producer_group=producer, consumer_group=query_releasers,
            tx_count=self.query_block_bytes, defer_sync=True)
        key_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.key_barriers.data_ptr(), num_stages=1,
            producer_group=producer, consumer_group=consumers,
            tx_count=self.key_block_bytes, defer_sync=True)
        dq_pipe = pipeline.PipelineAsync.create(
            barrier_storage=storage.dq_barriers.data_ptr(), num_stages=self.dq_buffers,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.consumer_threads),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
            defer_sync=True)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        # Per-batch geometry in the forward kernel's terms: global row = local row + q_start, and
        # global row i sits at key position i + offset.
        sequence = None
        if const_expr(self.packed):
            # Grid x is the scheduler's slots over (sequence, key block): the rest in that sequence's
            # own rows, as for a batch element padded at its end (rows past q_len are masked, so the
            # dQ rows of the next sequence that a last query block covers get exact zeros).
            n_block, k_row0, kv_len, q_row0, q_len, query_slot = tile_scheduler.packed_key_item(
                n_block, mCuSeqlensQ, mCuSeqlensK, self.options.num_sequences, q_len_static,
                cute.size(mK, mode=[0]), self.tile_m, self.tile_n)
            sequence = (q_row0, k_row0, query_slot)
            offset = kv_len - q_len
            num_m_blocks = (q_len + self.tile_m - 1) // self.tile_m
        else:
            q_len, kv_len, offset = masking.batch_extents(batch, q_len_static, cute.size(mK, mode=[0]), mQSeqLengths,
                                                          mKVSeqLengths, self.q_total)
            num_m_blocks = cute.ceil_div(q_len_static, self.tile_m)
        q_start = Int32(0)
        if const_expr(self.has_q_start):
            q_start = mQStart[0]
        m_lo, m_hi = masking.query_block_range(self.mask, n_block, self.tile_m, self.tile_n, kv_len,
                                               offset + q_start, num_m_blocks)
        m_count = m_hi - m_lo
        iterations = m_count * self.group
        if const_expr(self.head_splits > 1):
            # Grid y is kv_head * head_splits + split; `_query_block` offsets the heads by the split.
            kv_head = kv_head // self.head_splits
            iterations = m_count * (self.group // self.head_splits)

        if warp_group == 0:
            cute.arch.setmaxregister_decrease(self.producer_registers)
            if warp_idx == 0:
                self._produce(tma_q, mQ, tma_do, mdO, tma_k, mK, tma_v, mV, sQ, sdO, sK, sV,
                              mLSE, mdPsum, sLSE, sdPsum, query_pipe, key_pipe, n_block, kv_head,
                              batch, m_lo, m_count, iterations, sequence)
            for writer in cutlass.range_constexpr(self.dq_writers):
                if warp_idx == 1 + writer:
                    self._write_dq(dq_pipe, sdQ, tma_dq, mdQ_tma, mSemaphores, n_block, kv_head, batch, m_lo,
                                   m_count, iterations, kv_len, offset, q_start, sequence, writer)
        else:
            cute.arch.setmaxregister_increase(self.consumer_registers)
            self._consume(mma_sdp, mma_dkv, mma_dq, sQ, sdO, sK, sV, sdS, sdQ, sLSE, sdPsum,
                          dq_pipe, query_pipe, key_pipe, mLSE, mdPsum, mQSegmentIds, mKVSegmentIds, mdK, mdV,
                          (tma_dk, tma_mdK, tma_dv, tma_mdV),
                          tidx - WARP_GROUP, n_block, kv_head, batch, m_lo, m_count, iterations,
                          offset, kv_len, q_len, q_start, sequence)

    @cute.jit
    def _consume(self, mma_sdp, mma_dkv, mma_dq, sQ, sdO, sK, sV, sdS, sdQ, sLSE, sdPsum, dq_pipe,
                 query_pipe, key_pipe, mLSE, mdPsum, mQSegmentIds, mKVSegmentIds, mdK, mdV, dkv_store, tidx,
                 n_block, kv_head, batch, m_lo, m_count, iterations, offset, kv_len, q_len,
                 q_start, sequence):
        d = self.head_dim
        thr_sdp = mma_sdp.get_slice(tidx)
        thr_dkv = mma_dkv.get_slice(tidx)
        thr_dq = mma_dq.get_slice(tidx)
        # Shared-memory operands sliced at the warp group's first thread (`warpgroup_first_thread`; at
        # `tidx` their descriptors took 83 of 555 SASS instructions per block at D = 128).
        warpgroup_thread = warpgroup_first_thread(tidx)
        warpgroup_sdp = mma_sdp.get_slice(warpgroup_thread)
        warpgroup_dkv = mma_dkv.get_slice(warpgroup_thread)
        warpgroup_dq = mma_dq.get_slice(warpgroup_thread)

        # Operand fragments (shared-memory descriptors, or registers for the RS operand).
        tSrK = warpgroup_sdp.make_fragment_A(warpgroup_sdp.partition_A(sK))
        tSrQ = warpgroup_sdp.make_fragment_B(warpgroup_sdp.partition_B(sQ))
        tdPrV = warpgroup_sdp.make_fragment_A(warpgroup_sdp.partition_A(sV))
        tdPrdO = warpgroup_sdp.make_fragment_B(warpgroup_sdp.partition_B(sdO))
        tdVrdO = warpgroup_dkv.make_fragment_B(warpgroup_dkv.partition_B(transpose_view(sdO)))
        tdKrQ = warpgroup_dkv.make_fragment_B(warpgroup_dkv.partition_B(transpose_view(sQ)))
        if const_expr(self.dq_transposed):
            tdQrK = warpgroup_dq.make_fragment_A(warpgroup_dq.partition_A(transpose_view(sK)))
            tdQrdS = warpgroup_dq.make_fragment_B(warpgroup_dq.partition_B(sdS))
            shape_dq = (d, self.tile_m)
        else:
            tdQrdS = warpgroup_dq.make_fragment_A(warpgroup_dq.partition_A(sdS))
            tdQrK = warpgroup_dq.make_fragment_B(warpgroup_dq.partition_B(transpose_view(sK)))
            shape_dq = (self.tile_m, d)
        tdSsdS = thr_sdp.partition_C(transpose_view(sdS))     # where this thread's dS^T goes
        ds_store = thread_ds_store = None                     # plain stores, or stmatrix:
        if const_expr(self.tuning.ds_stmatrix):
            ds_store = self._ds_store_copy(mma_sdp)
            thread_ds_store = ds_store.get_slice(tidx)
            tdSsdS = thread_ds_store.partition_D(transpose_view(sdS))

        shape_st = (self.tile_n, self.tile_m)
        acc_dK = cute.make_rmem_tensor(thr_dkv.partition_shape_C((self.tile_n, d)), Float32)
        acc_dV = cute.make_rmem_tensor(thr_dkv.partition_shape_C((self.tile_n, d)), Float32)
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)

        # (query, key) coordinates of this thread's S^T elements, viewed (query, key) like the
        # forward's scores so the shared mask code applies unchanged.
        tScS = thr_sdp.partition_C(transpose_view(
            cute.make_identity_tensor((self.tile_m, self.tile_n))))
        coords_qk = query_major_view(tScS)
        key_base = n_block * self.tile_n
        if const_expr(self.staged_row_stats):
            # A stage's LSE / dPsum seen as (key, query) matrices constant along the keys and
            # partitioned like S^T, so element [r] of the query-major view is row r's statistic.
            broadcast = cute.make_layout((self.tile_n, self.tile_m, self.stages),
                                         stride=(0, 1, self.tile_m))
            tLSE = thr_sdp.partition_C(cute.make_tensor(sLSE.iterator, broadcast))
            tdPsum = thr_sdp.partition_C(cute.make_tensor(sdPsum.iterator, broadcast))

        key_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        key_pipe.consumer_wait(key_state)
        query_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer,
                                                   self.stages)
        ds_barrier = pipeline.NamedBarrier(barrier_id=DS_READY_BARRIER,
                                           num_threads=self.consumer_threads)
        dq_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.dq_buffers)
        m_start = self._first_query_block(n_block, m_lo, m_count)
        q_head, m_block = self._first_head(kv_head), m_start
        for it in cutlass.range(iterations, unroll=1):
            row_base = m_block * self.tile_m
            stage = query_state.index
            ds_stage = it % 2
            query_pipe.consumer_wait(query_state)

            # S^T = K Q^T, dP^T = V dO^T (two commit groups).
            acc_s = cute.make_rmem_tensor(thr_sdp.partition_shape_C(shape_st), Float32)
            acc_dp = cute.make_rmem_tensor(thr_sdp.partition_shape_C(shape_st), Float32)
            warpgroup.fence()
            gemm(mma_sdp, acc_s, tSrK, tSrQ[None, None, None, stage], True)
            warpgroup.commit_group()
            gemm(mma_sdp, acc_dp, tdPrV, tdPrdO[None, None, None, stage], True)
            warpgroup.commit_group()

            # LSE of this thread's query rows (the view's rows), loaded while the GEMMs run.
            scores = query_major_view(acc_s)
            rows = cute.size(scores, mode=[0])
            if const_expr(self.staged_row_stats):
                lse = query_major_view(tLSE[None, None, None, stage])
                if const_expr(self.row_stats_early):
                    lse = self._into_registers(lse, rows)
            else:
                lse = cute.make_rmem_tensor(cute.make_layout(rows), Float32)
                for r in cutlass.range_constexpr(rows):
                    lse[r] = self._row_statistic(mLSE, row_base + coords_qk[r, 0][0], q_head, batch, sequence)

            warpgroup.wait_group(1)
            self.numerics.probabilities(acc_s, scores, coords_qk, lse, n_block, q_start + row_base, row_base,
                                key_base, kv_len, q_len, offset, mQSegmentIds, mKVSegmentIds, batch)

            # early_dv: dV += P^T dO runs on the tensor cores while dS is computed.
            if const_expr(self.early_dv):
                frag_p = self._as_operand(acc_s, thr_dkv)
                warpgroup.fence()
                gemm(mma_dkv, acc_dV, frag_p, tdVrdO[None, None, None, stage], False)
                warpgroup.commit_group()
            # dPsum only now: keeping it and the LSE live together would spill (dK, dV, S, dP
            # already hold 192 registers at D = 128).
            if const_expr(self.staged_row_stats):
                dpsum = query_major_view(tdPsum[None, None, None, stage])
                if const_expr(self.row_stats_early):
                    dpsum = self._into_registers(dpsum, rows)
            else:
                dpsum = cute.make_rmem_tensor(cute.make_layout(rows), Float32)
                for r in cutlass.range_constexpr(rows):
                    dpsum[r] = self._row_statistic(mdPsum, row_base + coords_qk[r, 0][0], q_head, batch, sequence)

            if const_expr(self.early_dv):
                warpgroup.wait_group(1)            # dP^T done; dV may still run
            else:
                warpgroup.wait_group(0)
            self.numerics.ds_over_dp(scores, query_major_view(acc_dp), dpsum, lse)

            # P^T and dS^T as bf16/fp16 A operands (same register order as the accumulator).
            if const_expr(not self.early_dv):
                frag_p = self._as_operand(acc_s, thr_dkv)
            frag_ds = self._as_operand(acc_dp, thr_dkv)

            ds_rows = cute.make_tensor(frag_ds.iterator, acc_dp.layout)
            if const_expr(self.ds_store_first):
                self._store_ds(ds_rows, ds_store, thread_ds_store, tdSsdS[None, None, None, ds_stage])
            warpgroup.fence()
            if const_expr(not self.early_dv):
                gemm(mma_dkv, acc_dV, frag_p, tdVrdO[None, None, None, stage], False)
                warpgroup.commit_group()
            if const_expr(not self.ds_store_first):
                self._store_ds(ds_rows, ds_store, thread_ds_store, tdSsdS[None, None, None, ds_stage])
            if const_expr(not self.stage_dq_under_dk):
                gemm(mma_dkv, acc_dK, frag_ds, tdKrQ[None, None, None, stage], False)
                warpgroup.commit_group()

            # dS complete in shared memory (both warp groups) before dQ = dS K reads it.
            cute.arch.fence_view_async_shared()
            ds_barrier.arrive_and_wait()
            acc_dq = cute.make_rmem_tensor(thr_dq.partition_shape_C(shape_dq), Float32)
            if const_expr(self.dq_transposed):
                gemm(mma_dq, acc_dq, tdQrK, tdQrdS[None, None, None, ds_stage], True)
            else:
                gemm(mma_dq, acc_dq, tdQrdS[None, None, None, ds_stage], tdQrK, True)
            warpgroup.commit_group()
            if const_expr(self.stage_dq_under_dk):
                # dK after dQ, so that dQ is staged for the writer warp while the tensor cores compute
                # dK (staged after both, the stores ran with the tensor cores idle: 2-6 % at D = 128).
                gemm(mma_dkv, acc_dK, frag_ds, tdKrQ[None, None, None, stage], False)
                warpgroup.commit_group()
                warpgroup.wait_group(1)
                self._stage_dq(acc_dq, sdQ, thr_dq, dq_pipe, dq_state)
                if const_expr(not self.dq_publish_after_dk):
                    self._publish_dq(dq_pipe, dq_state)
                    dq_state.advance()
            warpgroup.wait_group(0)
            # Every thread arrives on the stage's empty mbarrier (its count is consumer_threads, see
            # `query_releasers`), so its own reads of the staged LSE / dPsum are ordered before the
            # producer's next copy into the stage. PipelineTmaAsync.consumer_release would arrive from
            # lane 0 of each warp only, leaving the other lanes' reads unordered against that copy.
            cute.arch.mbarrier_arrive(query_pipe.consumer_get_barrier(query_state))
            query_state.advance()
            if const_expr(self.dq_publish_after_dk):
                self._publish_dq(dq_pipe, dq_state)
                dq_state.advance()
            if const_expr(not self.stage_dq_under_dk):
                self._stage_dq(acc_dq, sdQ, thr_dq, dq_pipe, dq_state)
                self._publish_dq(dq_pipe, dq_state)
                dq_state.advance()
            q_head, m_block = self._next_query_block(q_head, m_block, m_start, m_lo, m_count)

        if const_expr(self.head_splits > 1):
            self._add_dkv_partials(acc_dK, acc_dV, sQ, sK, *dkv_store, thr_dkv, n_block, kv_head, batch,
                                   tidx)
        elif const_expr(self.tma_dkv_store):
            self._store_dkv_tma(acc_dK, acc_dV, sK, sV, *dkv_store, thr_dkv, n_block, kv_head, batch,
                                tidx)
        else:
            self._store_dkv(acc_dK, acc_dV, mdK, mdV, thr_dkv, n_block, kv_head, batch, kv_len, sequence)

    @cute.jit
    def _row_statistic(self, mStat, row, q_head, batch, sequence):
        """LSE or dPsum of query row `row` (of the batch element, or with packed sequences of the
        sequence: clamped into the array, since a sequence's last block reaches up to tile_m - 1 rows
        past the packed rows, which the mask hides)."""
        if const_expr(self.packed):
            row = cutlass.min(sequence[0] + row, cute.size(mStat, mode=[0]) - 1)
        return mStat[row, q_head, batch]

    @cute.jit
    def _stage_dq(self, acc_dq, sdQ, thr_dq, dq_pipe, dq_state):
        """Stage this block's dQ for the writer warp (`_publish_dq` hands it over); wait only for a free
        buffer. The two [tile_m, D/2] halves are viewed as one [tile_m, D] tile: column c in half c // (D/2)."""
        dq_pipe.producer_acquire(dq_state)
        if const_expr(self.tuning.flat_dq):
            chunks = cute.size(acc_dq) // 4
            staging = backward_common.register_order_staging(
                sdQ[None, dq_state.index].iterator, cute.arch.thread_idx()[0] - WARP_GROUP, chunks)
            cute.autovec_copy(cute.make_tensor(acc_dq.iterator, cute.make_layout((4, chunks))), staging)
        else:
            staging = cute.group_modes(sdQ[None, None, None, dq_state.index], 1, 3)
            if const_expr(self.dq_transposed):
                # dQ^T's value (dim, query) at (query, dim): a warp's 32-bit stores of one register hit 8
                # consecutive dims of 4 queries 2 apart, whose 16-byte chunks the 128-byte swizzle (row % 8)
                # spreads over all banks: one wavefront each.
                staging = transpose_view(staging)
            cute.autovec_copy(acc_dq, thr_dq.partition_C(staging))

    def _ds_store_copy(self, mma_sdp):
        """`Tuning.ds_stmatrix`'s store of dS^T: stmatrix tiled over the S^T / dP^T accumulator of
        `mma_sdp`, non-transposed because sdS keeps the queries (the accumulator's columns, which a
        register's two values are) contiguous."""
        return cute.make_tiled_copy_C(sm90_helpers.get_smem_store_op(LayoutEnum.ROW_MAJOR, self.dtype, Float32),
                                      mma_sdp)

    @cute.jit
    def _query_block(self, it, kv_head, n_block, m_lo, m_count):
        """(query head, query block) of iteration `it`: the group's heads in turn, each over the query
        blocks this key block sees, lowest first. (`n_block` is unused here; the large-head kernel,
        which shares `_produce`, staggers its walk by it.) With head splits the walk covers this
        CTA's share of the group: its split, grid y modulo head_splits, offsets the heads."""
        if const_expr(self.rotated_turns):
            return self._first_head(kv_head) + it // m_count, m_lo + (it + n_block) % m_count
        return self._first_head(kv_head) + it // m_count, m_lo + it % m_count

    @cute.jit
    def _first_head(self, kv_head):
        """The first query head of this CTA's walk."""
        if const_expr(self.head_splits > 1):
            split = cute.arch.block_idx()[0 if self.key_blocks_outer else 1] % self.head_splits
            return kv_head * self.group + split * (self.group // self.head_splits)
        return kv_head * self.group

    @cute.jit
    def _into_registers(self, staged, rows: cutlass.Constexpr):
        """The first `rows` values of a staged row statistic (a view of shared memory) loaded into registers
        here, where a wgmma wait follows (`Tuning.row_stats_early`), rather than at their first use after it."""
        values = cute.make_rmem_tensor(cute.make_layout(rows), Float32)
        for r in cutlass.range_constexpr(rows):
            values[r] = staged[r]
        return values

    @cute.jit
    def _store_ds(self, ds_rows, ds_store, thread_ds_store, destination):
        """This thread's dS^T (bf16 / fp16, in the accumulator's register order) into shared memory for the
        dQ GEMM: stmatrix (`Tuning.ds_stmatrix`) or plain stores."""
        if const_expr(self.tuning.ds_stmatrix):
            cute.copy(ds_store, thread_ds_store.retile(ds_rows), destination)
        else:
            cute.autovec_copy(ds_rows, destination)

    @cute.jit
    def _as_operand(self, accumulator, thr_dkv):
        """An fp32 (keys x queries) accumulator rounded to the input type as the register A operand
        of dV / dK (same register order as the accumulator)."""
        fragment = cute.make_rmem_tensor(thr_dkv.partition_shape_A((self.tile_n, self.tile_m)),
                                         self.dtype)
        cute.make_tensor(fragment.iterator, accumulator.layout).store(
            accumulator.load().to(self.dtype))
        return fragment

    @cute.jit
    def _write_dq(self, dq_pipe, sdQ, tma_dq, mdQ_tma, mSemaphores, n_block, kv_head, batch, m_lo, m_count,
                  iterations, kv_len, offset, q_start, sequence, writer: cutlass.Constexpr = 0):
        """The dQ writer warp: per query block, wait for the consumers' staged dQ, add it into the
        fp32 accumulator with two bulk tensor reduces (one per half of D), free the buffer once the
        copy engine has read it. Deterministic: in the tile's turn, highest key block first
        (`ordered_reduction`). Packed sequences: the tiles are the sequence's own, at its rows, and
        their turn counters the scheduler's query slots (`tile_scheduler.packed_key_item`). With
        `Tuning.dq_writers` > 1, writer `writer` takes every dq_writers-th block from block `writer`."""
        lane = cute.arch.lane_idx()
        dq_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.dq_buffers)
        m_start = self._first_query_block(n_block, m_lo, m_count)
        q_head, m_block = self._first_head(kv_head), m_start
        for _ in cutlass.range_constexpr(writer):
            dq_state.advance()
            q_head, m_block = self._next_query_block(q_head, m_block, m_start, m_lo, m_count)
        for it in cutlass.range((iterations - writer + self.dq_writers - 1) // self.dq_writers, unroll=1):
            tdQsdQ, tdQgdQ = None, None
            if const_expr(not self.tuning.flat_dq):
                gdQ = cute.local_tile(self._sequence_rows(mdQ_tma[None, None, q_head, batch], sequence, 0),
                                      (self.tile_m, self.head_dim // 2), (m_block, None))
                tdQsdQ, tdQgdQ = cpasync.tma_partition(
                    tma_dq, 0, cute.make_layout(1),
                    cute.group_modes(sdQ[None, None, None, dq_state.index], 0, 2),
                    cute.group_modes(gdQ, 0, 2))
            dq_pipe.consumer_wait(dq_state)
            flag = None
            if const_expr(self.deterministic):
                if const_expr(self.rotated_turns):
                    # A full mask: every key block [0, N) visits every query block [m_lo, m_lo + m_count).
                    turn = ordered_reduction.rotated_turn(n_block, m_block - m_lo,
                                                          (kv_len + self.tile_n - 1) // self.tile_n, m_count)
                else:
                    turn = ordered_reduction.key_block_turn(
                        self.mask, n_block, q_start + m_block * self.tile_m, self.tile_m, self.tile_n,
                        kv_len, offset, highest_first=True)
                tile = m_block
                if const_expr(self.packed):
                    tile = sequence[2] + m_block
                flag = ordered_reduction.wait_for_turn(mSemaphores, (batch, q_head, tile), turn, lane)
            if const_expr(self.tuning.flat_dq):
                if lane == 0:
                    destination = mdQ_tma.iterator + cute.crd2idx((batch, q_head, m_block, 0), mdQ_tma.layout)
                    primitives.cp_reduce_async_bulk_global_shared_cta(
                        destination, sdQ[None, dq_state.index].iterator, self.tile_m * self.head_dim * 4,
                        op=primitives.CpReduceOp.ADD, type=primitives.CpReduceType.F32)
            else:
                for half in cutlass.range_constexpr(2):
                    cute.copy(tma_dq, tdQsdQ[None, half], tdQgdQ[None, half])
            cute.arch.cp_async_bulk_commit_group()
            ordered_reduction.finish_bulk_adds(flag, lane)
            dq_pipe.consumer_release(dq_state)
            for _ in cutlass.range_constexpr(self.dq_writers):
                dq_state.advance()
                q_head, m_block = self._next_query_block(q_head, m_block, m_start, m_lo, m_count)

    @cute.jit
    def _add_dkv_partials(self, acc_dK, acc_dV, sQ, sK, tma_dk, mdK, tma_dv, mdV, thr_dkv, n_block,
                          kv_head, batch, tidx):
        """Head splits: this CTA's dK (scaled) and dV, partial sums over its share of the group's query
        heads, staged in fp32 over the Q + dO rings (dK) and the K + V tiles (dV), then added into
        the fp32 accumulators with one TMA bulk reduce-add each; the copy engine clips the rows past
        the sequence end. Nothing reads those buffers any more: every TMA load into them was waited
        for by the consumers' last full-barrier waits, and every wgmma reading them was waited for
        (wait_group 0) before the barrier below."""
        consumers = pipeline.NamedBarrier(barrier_id=backward_common.DKV_STORE_BARRIER,
                                          num_threads=self.consumer_threads)
        consumers.arrive_and_wait()        # both warp groups' last GEMMs have read Q, dO, K and V
        layout = self._dkv_partial_layout()
        sdK = cute.make_tensor(cute.recast_ptr(sQ.iterator, layout.inner, dtype=Float32), layout.outer)
        sdV = cute.make_tensor(cute.recast_ptr(sK.iterator, layout.inner, dtype=Float32), layout.outer)
        acc_dK.store(acc_dK.load() * self.scale)
        cute.autovec_copy(acc_dK, thr_dkv.partition_C(sdK))
        cute.autovec_copy(acc_dV, thr_dkv.partition_C(sdV))
        # The generic-proxy stores must be visible to the copy engine (async proxy) before it reads.
        cute.arch.fence_proxy("async.shared", space="cta")
        consumers.arrive_and_wait()
        self._copy_dkv_tiles(tma_dk, sdK, mdK, tma_dv, sdV, mdV, n_block, kv_head, batch, tidx)

    @cute.jit
    def _store_dkv(self, acc_dK, acc_dV, mdK, mdV, thr_dkv, n_block, kv_head, batch, kv_len, sequence):
        """dK (scaled) and dV by per-element stores of the rows up to the array's end (packed: up to the
        sequence's end: the keys after it are the next sequence's CTA's)."""
        tile = (self.tile_n, self.head_dim)
        gdK = cute.local_tile(self._sequence_rows(mdK[None, None, kv_head, batch], sequence, 1), tile, (n_block, 0))
        gdV = cute.local_tile(self._sequence_rows(mdV[None, None, kv_head, batch], sequence, 1), tile, (n_block, 0))
        key_rows = cute.size(mdK, mode=[0])
        if const_expr(self.packed):
            key_rows = kv_len
        tdKgdK = thr_dkv.partition_C(gdK)
        tdVgdV = thr_dkv.partition_C(gdV)
        coords = thr_dkv.partition_C(cute.make_identity_tensor(tile))
        key_base = n_block * self.tile_n
        for e in cutlass.range_constexpr(cute.size(acc_dK)):
            if key_base + coords[e][0] < key_rows:
                tdKgdK[e] = (acc_dK[e] * self.scale).to(self.dtype)
                tdVgdV[e] = acc_dV[e].to(self.dtype)



# ----------------------------------------------------------------------------------------------------
# The kernel module's face (what fa4_jax/lowering/cuda.py calls)
# ----------------------------------------------------------------------------------------------------

# The launcher's optional inputs after dPsum, by name (absent ones None).
OPTIONAL_INPUTS = ("q_segment_ids", "kv_segment_ids", "q_seq_lengths", "kv_seq_lengths", "q_start", "cu_seqlens_q",
                   "cu_seqlens_k")


def dq_accumulator_shape(batch, padded_rows, q_heads, head_dim):
    """The fp32 dQ accumulator: [B, Sq padded to whole query blocks, Hq, D], the query's own layout."""
    return (batch, padded_rows, q_heads, head_dim)


def _dq_rows(dq_accum, q_len):
    return dq_accum[:, :q_len]


def head_splits_reason(head_splits: int, group: int, deterministic: bool, kv_heads: Optional[int] = None,
                       kv_len: Optional[int] = None, key_blocks_outer: bool = False) -> Optional[str]:
    """Why the kernel cannot take `head_splits` (and, given the shapes, the grid it makes), or None."""
    if head_splits < 1 or group % head_splits:
        return f"head_splits={head_splits} must divide the group of {group} query heads per KV head"
    if deterministic and head_splits > DETERMINISTIC_HEAD_SPLITS:
        return (f"deterministic=True takes head_splits <= {DETERMINISTIC_HEAD_SPLITS} (got {head_splits}): "
                "more fp32 partial sums of dK / dV would add in the order the CTAs finish")
    if kv_heads is not None and not key_blocks_outer and kv_heads * head_splits > host.MAX_GRID_Y_Z:
        return (f"{kv_heads} key/value heads x head_splits={head_splits} exceed CUDA's grid limit of "
                f"{host.MAX_GRID_Y_Z} (gridDim.y)")
    if kv_len is not None and key_blocks_outer and host.ceil_div(kv_len, TILE_N) > host.MAX_GRID_Y_Z:
        return (f"key_blocks_outer launches the key blocks on gridDim.z: {kv_len} keys make more than "
                f"CUDA's limit of {host.MAX_GRID_Y_Z} blocks of {TILE_N}")
    return None


def options(config: AttentionConfig, problem: host.Problem, tuning: Tuning = DEFAULT_TUNING) -> BackwardOptions:
    """The static kernel configuration for one call (`tuning`: this kernel's speed choices).

    `tuning.head_splits` None is resolved here, where the shapes are known, by `head_splits_for` (on
    the local GPU's SM count); the options carry the resolved count and the tuning with head_splits
    None, so a forced split and the same split chosen share one compile key. A forced split the
    kernel or CUDA's grid cannot take raises ValueError.

    Packed sequences (`config.has_cu_seqlens`, `problem.sequences` set) resolve None to one CTA per
    (sequence, key block, KV head), 64 query rows and the tiled dQ staging (`packed_reason` says why);
    choices forced otherwise raise ValueError."""
    if config.has_cu_seqlens:
        if problem.sequences is None:
            raise ValueError("packed sequences (cu_seqlens) need the Problem's sequence count: "
                             "host.Problem.of(query, key, value, optional)")
        head_splits = 1 if tuning.head_splits is None else tuning.head_splits
        query_rows = tuning.query_rows or backward_common.TILE_M
        reason = packed_reason(head_splits, query_rows, flat_dq=False)
        if reason is not None:
            raise ValueError(reason)
        packed_tuning = dataclasses.replace(tuning, head_splits=None, query_rows=query_rows, flat_dq=False,
                                            dq_row_split=bool(tuning.dq_row_split), rotated_turns=False,
                                            dq_writers=tuning.dq_writers if config.deterministic else 1)
        return dataclasses.replace(BackwardOptions.of(config, problem, packed_tuning), num_sequences=problem.sequences)
    key_blocks_outer = tuning.key_blocks_outer and not config.deterministic   # as the kernel applies it
    head_splits = tuning.head_splits
    if head_splits is None and (tuning.query_rows or backward_common.TILE_M) != backward_common.TILE_M:
        head_splits = 1        # 128 query rows stage no fp32 dK / dV partials (query_rows_reason)
    if head_splits is None:
        head_splits = head_splits_for(problem.batch, problem.kv_heads, problem.group, problem.q_len,
                                      problem.kv_len, host.sm_count(DEFAULT_SM_COUNT), config.deterministic,
                                      masking.MaskShape.from_config(config), key_blocks_outer)
    reason = head_splits_reason(head_splits, problem.group, config.deterministic, problem.kv_heads,
                                problem.kv_len, key_blocks_outer)
    if reason is not None:
        raise ValueError(reason)
    register_bound = config.softcap is not None or config.has_segment_ids
    query_rows = tuning.query_rows
    if query_rows is None:
        query_rows = query_rows_for(problem.head_dim, head_splits, register_bound, config.deterministic,
                                    config.causal or config.has_window, tuning.ds_stmatrix)
    # 80 rows stage dQ^T in the tiled form only (`query_rows_reason`).
    tuning = dataclasses.replace(tuning, flat_dq=tuning.flat_dq and query_rows != TRANSPOSED_DQ_ROWS)
    reason = (query_rows_reason(query_rows, problem.head_dim, head_splits, register_bound, config.deterministic,
                                tuning.flat_dq, tuning.ds_stmatrix)
              or dq_row_split_reason(tuning, query_rows))
    if reason is not None:
        raise ValueError(reason)
    dq_row_split = tuning.dq_row_split
    if dq_row_split is None:
        dq_row_split = query_rows == WIDE_QUERY_ROWS and tuning.flat_dq
    rotated_turns = tuning.rotated_turns and rotated_turns_reason(config, problem) is None
    # A second dQ writer shortens the deterministic mode's serial turns only; without them one keeps up.
    dq_writers = tuning.dq_writers if config.deterministic else 1
    return BackwardOptions.of(config, problem, dataclasses.replace(
        tuning, head_splits=None, query_rows=query_rows, dq_row_split=dq_row_split, rotated_turns=rotated_turns,
        dq_writers=dq_writers), head_splits)


def dq_staging_buffers(query_rows: int) -> int:
    """dQ staging buffers between the consumers and the writer warps: DQ_BUFFERS, or one at 80 query rows,
    whose Q / dO rings and dS buffers leave shared memory for no second one (`Tuning.query_rows`)."""
    return 1 if query_rows == TRANSPOSED_DQ_ROWS else DQ_BUFFERS


def rotated_turns_reason(config: AttentionConfig, problem: host.Problem,
                         tuning: Tuning = DEFAULT_TUNING) -> Optional[str]:
    """Why `Tuning.rotated_turns` cannot order this call's dQ adds, or None: backward_common's rule, the
    key blocks of TILE_N keys (every `tuning` here; the parameter is the face both sm90 backwards show)."""
    return backward_common.rotated_turns_reason(config, host.ceil_div(problem.kv_len, TILE_N),
                                                host.sm_count(DEFAULT_SM_COUNT))


def packed_reason(head_splits: int, query_rows: int, flat_dq: bool) -> Optional[str]:
    """Why the kernel cannot take packed sequences with these choices, or None. A sequence's blocks start
    anywhere in the packed rows, so its dQ goes through the tiled staging (a TMA tensor reduce at any
    row), not the register-order accumulator of whole packed blocks; head splits and 128 query rows
    are left out of the packed path, which is built and checked at one CTA per key block and 64 rows."""
    if head_splits != 1:
        return (f"packed sequences (cu_seqlens) take head_splits=1 (got {head_splits}): the packed backward "
                "is built without fp32 dK / dV partials")
    if query_rows != backward_common.TILE_M:
        return (f"packed sequences (cu_seqlens) take {backward_common.TILE_M} query rows per block (got "
                f"{query_rows})")
    if flat_dq:
        return ("packed sequences (cu_seqlens) need flat_dq=False: the register-order dQ accumulator holds "
                "whole blocks of the packed rows, where a sequence's query blocks start anywhere")
    return None


WIDE_QUERY_ROWS = 128
QUERY_ROWS = (backward_common.TILE_M, TRANSPOSED_DQ_ROWS, WIDE_QUERY_ROWS)
WIDE_QUERY_HEAD_DIMS = (64,)     # where 128 query rows fit: [128 x 128] S^T and dP^T beside dK, dV


def query_rows_for(head_dim: int, head_splits: int, register_bound: bool, deterministic: bool = False,
                   masked: bool = False, ds_stmatrix: bool = True) -> int:
    """Query rows per block when `Tuning.query_rows` is None (`register_bound`: softcap or segment ids;
    `masked`: causal or a window): 128 wherever the kernel takes it (measured 1.07-1.11x the 64-row kernel
    at D = 64 on the H200, deterministic 1.2-1.3x; docs/sm90_backward_tuning.md); 80 (dQ^T) where it takes
    those and no mask: measured +1.2 to +2.8 % on the full-mask D = 128 rows, MHA and GQA / MQA, but -1.3
    to -4.3 % causal, where an 80-row block straddles the diagonal with more masked scores (an H100, rev
    458b42a, docs/sm90_backward_tuning.md, "80 query rows"); deterministic mode keeps 64 (its two dQ
    writers need two staging buffers; 80 rows with one writer measured slower, `query_rows_reason`); else 64."""
    if query_rows_reason(WIDE_QUERY_ROWS, head_dim, head_splits, register_bound) is None:
        return WIDE_QUERY_ROWS
    if not masked and query_rows_reason(TRANSPOSED_DQ_ROWS, head_dim, head_splits, register_bound, deterministic,
                                        flat_dq=False, ds_stmatrix=ds_stmatrix) is None:
        return TRANSPOSED_DQ_ROWS
    return backward_common.TILE_M


def query_rows_reason(query_rows: int, head_dim: int, head_splits: int, register_bound: bool,
                      deterministic: bool = False, flat_dq: bool = True, ds_stmatrix: bool = True) -> Optional[str]:
    """Why the kernel cannot take `query_rows` query rows per block, or None."""
    if query_rows not in QUERY_ROWS:
        return f"query_rows={query_rows} must be one of {QUERY_ROWS}"
    if query_rows == TRANSPOSED_DQ_ROWS:
        if head_dim not in TRANSPOSED_DQ_HEAD_DIMS:
            return (f"query_rows={query_rows} computes dQ^T with the head dim split into the warp groups' 64 "
                    f"rows: head dims {TRANSPOSED_DQ_HEAD_DIMS} only (got {head_dim})")
        if deterministic:
            return (f"query_rows={query_rows} leaves shared memory for one dQ staging buffer: deterministic mode "
                    f"runs {backward_common.TILE_M} rows at D = 128, where its two dQ writers take two staging "
                    "buffers, and 80 rows with one writer measured slower there (docs/sm90_backward_tuning.md, "
                    "\"Deterministic at 80 rows\")")
        if not ds_stmatrix:
            return (f"query_rows={query_rows} stores dS^T with stmatrix only (ds_stmatrix=True): the plain "
                    "stores' addresses make ptxas spill beside the 80-row accumulators")
        if flat_dq:
            return (f"query_rows={query_rows} stages dQ^T as a swizzled [rows, D] tile (flat_dq=False): in the "
                    "register order its head dims lie 16 floats apart, and reading them back cost more than "
                    "the 80 rows saved")
    if query_rows != backward_common.TILE_M and register_bound:
        return (f"query_rows={query_rows} does not combine with softcap or segment ids: their per-row "
                "statistics in registers make ptxas spill (D = 64: 352 bytes)")
    if query_rows == WIDE_QUERY_ROWS and head_dim not in WIDE_QUERY_HEAD_DIMS:
        return (f"query_rows={query_rows} fits registers and shared memory at head dims {WIDE_QUERY_HEAD_DIMS} "
                f"only (got {head_dim})")
    if query_rows != backward_common.TILE_M and head_splits > 1:
        return (f"query_rows={query_rows} does not combine with head_splits={head_splits}: the fp32 dK / dV "
                "partials are staged over Q / dO rings sized for 64 rows")
    return None


def dq_row_split_reason(tuning: Tuning, query_rows: int) -> Optional[str]:
    """Why the kernel cannot take `tuning.dq_row_split` at `query_rows` rows per block, or None."""
    if not tuning.dq_row_split:
        return None
    if query_rows != WIDE_QUERY_ROWS:
        return (f"dq_row_split needs {WIDE_QUERY_ROWS} query rows per block (got {query_rows}): each of the two "
                "warp groups takes 64 of them")
    if not tuning.flat_dq:
        return "dq_row_split needs flat_dq=True: its dQ fragment is staged in the register order only"
    return None


# The cost model of `head_splits_for`, in units of one query block of one head (5 GEMMs of
# 64 x 128 x D): first guesses, which the H200 sweep of docs/sm90_backward_tuning.md checked.
CTA_OVERHEAD_BLOCKS = 2     # per CTA: the K / V load, filling and draining the pipeline, the dK / dV store
PARTIAL_ADD_BLOCKS = 1      # per CTA with head splits, on top: fp32 dK / dV staged and reduce-added
SPLIT_GAIN = 0.03           # a larger split is taken only if it predicts at least 3 % less time
BALANCED_WAVES = 16         # a grid this many waves deep is left unsplit: its tail is short already


@functools.lru_cache(maxsize=256)
def head_splits_for(batch, kv_heads, group, q_len, kv_len, sm_count, deterministic,
                    mask: masking.MaskShape, key_blocks_outer: bool = False) -> int:
    """How many CTAs share each (key block, KV head, batch) when `Tuning.head_splits` is None.

    Why split: the kernel fits one CTA per SM (it takes nearly all shared memory), and one CTA per
    (key block, KV head, batch) is few CTAs with few KV heads; under a causal mask, moreover, key
    block n walks only the query blocks from ~2n on, so CTAs differ up to 2x and a single wave lasts
    as long as the longest. Splitting divides every CTA's walk by the split, at the price of one more
    K / V load and an fp32 dK / dV reduce-add per CTA; where the grid already fills whole waves with
    equal CTAs (MHA, or MQA without a mask at 128 CTAs on 132 SMs) it buys nothing.
    How: for each allowed split (a divisor of the group; at most DETERMINISTIC_HEAD_SPLITS when
    deterministic; grid y within CUDA's limit), predict the time by giving the CTAs, in launch order,
    each to the SM that frees first (`key_blocks_outer`: the order that option launches in), a
    CTA costing its query blocks (the kernel's own `masking.query_block_range`) times its heads plus
    the overheads above; the smallest split within SPLIT_GAIN of the fastest wins, so a guess that
    barely pays is not taken."""
    if group == 1:
        return 1
    key_blocks = host.ceil_div(kv_len, TILE_N)
    if key_blocks * kv_heads * batch >= BALANCED_WAVES * sm_count:
        return 1
    num_m_blocks = host.ceil_div(q_len, backward_common.TILE_M)
    walks = []                  # query blocks per key block, in launch order
    for x in range(key_blocks):
        n_block = key_blocks - 1 - x if deterministic else x
        first, end = masking.query_block_range(mask, n_block, backward_common.TILE_M, TILE_N, kv_len,
                                               kv_len - q_len, num_m_blocks)
        walks.append(end - first)
    limit = DETERMINISTIC_HEAD_SPLITS if deterministic else group
    allowed = [splits for splits in range(1, limit + 1)
               if group % splits == 0 and kv_heads * splits <= host.MAX_GRID_Y_Z]
    predicted = {}
    for splits in allowed:
        overhead = CTA_OVERHEAD_BLOCKS + (PARTIAL_ADD_BLOCKS if splits > 1 else 0)
        costs = [walk * (group // splits) + overhead for walk in walks]
        free_at = [0] * sm_count        # a heap: when each SM takes its next CTA
        slices = kv_heads * splits * batch
        launched = ([cost for cost in costs for _ in range(slices)] if key_blocks_outer
                    else costs * slices)
        for cost in launched:
            heapq.heapreplace(free_at, free_at[0] + cost)
        predicted[splits] = max(free_at)
    fastest = min(predicted.values())
    return next(splits for splits in allowed if predicted[splits] <= fastest * (1 + SPLIT_GAIN))


def fake_arguments(config: AttentionConfig, shape, dtype_name: str, head_splits: int = 1,
                   query_rows: int = backward_common.TILE_M, flat_dq: bool = True,
                   num_sequences: Optional[int] = None) -> list:
    """Fake tensors in the launcher's order (dK, dV fp32 accumulators with head splits), for compiling
    without a GPU. shape = (B, Sq, Sk, Hq, Hkv, D); with packed sequences B = 1 and `num_sequences`
    sizes the offsets."""
    accumulator_shape = backward_common.flat_dq_accumulator_shape(query_rows) if flat_dq else dq_accumulator_shape
    return host.backward_fake_arguments(config, shape, dtype_name, OPTIONAL_INPUTS, accumulator_shape, query_rows,
                                        fp32_dkv=head_splits > 1, num_sequences=num_sequences)


def run(options: BackwardOptions, query, key, value, out, lse, d_out, d_lse, optional: dict):
    """(dq, dk, dv, dsinks or None) for one attention call; traceable JAX."""
    kernel = Sm90BackwardKernel(options)
    accumulator_shape, dq_rows = dq_accumulator_shape, _dq_rows
    if options.tuning.flat_dq:
        accumulator_shape = backward_common.flat_dq_accumulator_shape(kernel.tile_m)
        column_groups = 1 if options.tuning.dq_row_split else 2
        dq_rows = backward_common.dq_from_fragments(kernel.tile_m, column_groups=column_groups)
    return host.run_backward(kernel, options, query, key, value, out, lse, d_out, d_lse, optional, OPTIONAL_INPUTS,
                             accumulator_shape, dq_rows, kernel.tile_m, options.num_sequences)
