"""Blackwell (sm_100a) attention forward: the FlashAttention-4 design in CuTe DSL.

One CTA owns `q_stage` query tiles of 128 rows (two, ping-ponged, for head dims up to 192; one for 256,
whose O accumulator alone fills the 512 TMEM columns two tiles would need). Warp roles:

  warps 0-3   softmax warpgroup 0 (query tile 0), one row per thread
  warps 4-7   softmax warpgroup 1 (query tile 1)
  warps 8-11  correction warpgroup: lazy rescale of O in TMEM, final normalisation of O into shared memory
  warp 12     MMA warp: one elected thread issues every tcgen05.mma
  warp 13     load warp: TMA of Q (once per tile) and of K/V through a multi-stage ring
  warp 14     epilogue warp: TMA store of O, LSE rows to global memory
  warp 15     spare (keeps the register split warpgroup-aligned)

Tensor memory (columns of 32-bit lanes, 128 lanes = 128 query rows):
  S_i = Q_i K^T           columns [i * n_block, (i + 1) * n_block)
  P_i (bf16/fp16 pairs)   written by the softmax over the second half of S_i, read by the PV MMA
  O_i                     columns [q_stage * n_block + i * d, ...)

Hand-offs per query tile i and key block j (mbarriers; the MMA warp signals with tcgen05.commit):
  s_full[i]      MMA -> softmax i     S_i(j) is in TMEM (and, by issue order, PV_i(j-1) has landed in O_i)
  stats_ready[i] softmax i -> corr.   the row's rescale factor for step j is in shared memory
  p_ready[i]     softmax i + corr. -> MMA   P_i(j) is in TMEM and O_i is rescaled: PV_i(j) may run
  o_full[i]      MMA -> correction    the last PV of the tile has landed
  stats_final[i] softmax i -> corr.   the row's 1/sum and LSE (OnlineSoftmax.finalize) in shared memory
  stats_free[i]  corr. -> softmax i   the correction has read them: the next tile's may be written (a
                                      tile of one key block gives no other order between the two)
The MMA warp issues PV_i(j-1) before QK_i(j), so tcgen05's in-order execution keeps P_i(j-1) alive until
the PV that reads it is done, and S_i's columns can be reused for P without another barrier.
These barriers and pipelines, their stage and arrival counts, and each role's order of waits and arrives
are stated once in forward_schedule.py: the kernel takes its counts from there and checks each role's
synchronisation calls against it while it is traced (`self.protocol`), and tests/test_sm100_protocol.py
replays it.

The numerics (masks, online softmax with lazy rescaling, polynomial exp2, tile order) come from the shared
building blocks that the sm_90 kernel runs on the H200; this module only adds the Blackwell data movement.
No Blackwell GPU was available while writing it: it is compiled for sm_100a and inspected (see
tests/test_kernel_compile_sm100.py), not run.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from fa4_jax.config import AttentionConfig
from fa4_jax.kernels import host
from fa4_jax.kernels.common import masking, online_softmax, pipeline_schedule, tile_scheduler
from fa4_jax.kernels.common.pipeline_schedule import (
    ACQUIRE, ARRIVE, COMMIT, CONSUMER_WAIT, FLIP, MMA_COMMIT, RELEASE, WAIT)
from fa4_jax.kernels.common.softcap import apply_softcap
from fa4_jax.kernels.sm100.forward_schedule import forward_schedule

SUPPORTED_HEAD_DIMS = (64, 96, 128, 192, 256)
TMEM_COLUMNS = 512
THREADS_PER_WARP = 32
ROWS_PER_TILE = 128
DEFAULT_SM_COUNT = 148  # B200; the real count is passed in when a GPU is present.
SMEM_TILE_BUDGET = 220 * 1024  # Q, O and K/V tiles; the rest of the 227 KiB holds barriers and stats
MAX_KV_STAGES = 8


def _tile_shape(head_dim: int) -> tuple[int, int]:
    """(query tiles per CTA, key block) per head dim, from the 512-column TMEM budget.

    Two ping-ponged tiles need 2 x (key block + d) columns: d <= 128 fits 128-key blocks, d = 192
    fits 64-key blocks, d = 256 leaves room for one tile only (64-key blocks, to keep 2 K/V stages
    in shared memory next to Q and the O staging tile).
    """
    if head_dim <= 128:
        return 2, 128
    if head_dim <= 192:
        return 2, 64
    return 1, 64


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """Everything static about one compiled kernel (hashable: it is the compile key)."""

    dtype_name: str            # "bfloat16" | "float16"
    head_dim: int
    group: int                 # query heads per key/value head
    scale: float
    mask: masking.MaskShape
    softcap: Optional[float] = None
    has_sinks: bool = False
    has_kv_lengths: bool = False
    has_q_start: bool = False
    q_total: Optional[int] = None
    sm_count: int = DEFAULT_SM_COUNT
    rescale_threshold: float = 8.0
    # Every `poly_exp2_every`-th score of a row takes the FMA-pipe exp2 (0: all on MUFU.EX2).
    poly_exp2_every: int = 4
    # Causal: each CTA runs a query block and its mirror of the same head back to back
    # (tile_scheduler.mirrored_tile), units of equal length in head order, instead of the
    # longest-first order over all heads, whose waves read a different head's K / V per CTA from DRAM
    # (the sm90 forward's measured change, docs/sm90_forward_tuning.md). `options` takes it where the
    # query-block count is even, so no unit has an empty second tile to skip in five warp roles.
    mirrored_tiles: bool = False


class Sm100ForwardKernel:
    """FA4-style forward kernel for one static configuration (`KernelOptions`)."""

    def __str__(self):
        # The DSL names the compiled kernel after str(self): a fixed name instead of the default
        # repr (module path and address), so profiles show it and moving the class renames nothing.
        return "fa4_jax_sm100_forward"

    softmax_warp_ids = ((0, 1, 2, 3), (4, 5, 6, 7))
    correction_warp_ids = (8, 9, 10, 11)
    mma_warp_id = 12
    load_warp_id = 13
    epilogue_warp_id = 14
    threads_per_cta = 16 * THREADS_PER_WARP

    # setmaxnreg budget: 2 x 128 x 192 + 128 x 80 + 128 x 48 = 64 Ki registers.
    registers_softmax = 192
    registers_correction = 80
    registers_other = 48

    def __init__(self, options: KernelOptions):
        head_dim = options.head_dim
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"head_dim {head_dim} not in {SUPPORTED_HEAD_DIMS}")
        self.options = options
        self.mask = options.mask
        self.head_dim = head_dim
        self.dtype = host.cutlass_dtype(options.dtype_name)
        # With a softcap the logits are capped before the softmax, so the exp2 scale is just log2(e).
        logit_scale = 1.0 if options.softcap is not None else options.scale
        self.scale_log2 = logit_scale * online_softmax.LOG2_E
        # One row per thread, so no cross-lane reductions.
        self.softmax = online_softmax.OnlineSoftmax(
            self.scale_log2, threads_per_row=1, rescale_threshold=options.rescale_threshold,
            poly_exp2_every=options.poly_exp2_every)
        # Partial (masked) blocks are few: as in FA4 they exponentiate on MUFU.EX2 alone. (A single
        # step for both kinds of block spills registers with ptxas 13.0 at 192 per softmax thread.)
        self.softmax_on_mufu = online_softmax.OnlineSoftmax(
            self.scale_log2, threads_per_row=1, rescale_threshold=options.rescale_threshold)

        self.q_stage, self.n_block = _tile_shape(head_dim)
        self.cta_rows = self.q_stage * ROWS_PER_TILE
        self.tmem_s_offset = tuple(i * self.n_block for i in range(self.q_stage))
        self.tmem_p_offset = tuple(s + self.n_block // 2 for s in self.tmem_s_offset)
        self.tmem_o_offset = tuple(
            self.q_stage * self.n_block + i * head_dim for i in range(self.q_stage))
        self.tmem_columns_used = self.q_stage * (self.n_block + head_dim)
        assert self.tmem_columns_used <= TMEM_COLUMNS
        self.tmem_columns_allocated = max(32, 1 << (self.tmem_columns_used - 1).bit_length())

        element_bytes = self.dtype.width // 8
        q_bytes = self.q_stage * ROWS_PER_TILE * head_dim * element_bytes
        kv_tile_bytes = self.n_block * head_dim * element_bytes
        # Double-buffer the O staging tile only where that still leaves 3+ K/V stages (d = 64).
        self.epi_stage = self.q_stage if head_dim <= 64 else 1
        o_bytes = self.epi_stage * ROWS_PER_TILE * head_dim * element_bytes
        self.kv_stage = min(MAX_KV_STAGES, (SMEM_TILE_BUDGET - q_bytes - o_bytes) // kv_tile_bytes)
        assert self.kv_stage >= 2, (head_dim, self.kv_stage)
        self.schedule = forward_schedule(self.q_stage, self.kv_stage, self.epi_stage,
                                         q_tile_bytes=q_bytes // self.q_stage,
                                         kv_tile_bytes=kv_tile_bytes)
        self.protocol = pipeline_schedule.ProtocolTrace(self.schedule)
        assert all(self.schedule.barrier(barrier.name).stages == self.q_stage
                   for barrier in self.schedule.barriers)

        self.qk_mma_tiler = (ROWS_PER_TILE, self.n_block, head_dim)
        self.pv_mma_tiler = (ROWS_PER_TILE, head_dim, self.n_block)
        self.tmem_ready_barrier = pipeline.NamedBarrier(
            barrier_id=1, num_threads=THREADS_PER_WARP * (self.mma_warp_id + 1))
        self.correction_barrier = pipeline.NamedBarrier(
            barrier_id=2, num_threads=THREADS_PER_WARP * len(self.correction_warp_ids))

    # ------------------------------------------------------------------------------------------
    # Host side: views, layouts, TMA atoms, launch
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(
        self,
        stream: cuda.CUstream,
        mQ: cute.Tensor,                         # [B, Sq, Hq, D]
        mK: cute.Tensor,                         # [B, Sk, Hkv, D]
        mV: cute.Tensor,                         # [B, Sk, Hkv, D]
        mSinks: Optional[cute.Tensor],           # [Hq] float32
        mQSegmentIds: Optional[cute.Tensor],     # [B, Sq] int32
        mKVSegmentIds: Optional[cute.Tensor],    # [B, Sk] int32
        mQSeqLengths: Optional[cute.Tensor],     # [B] int32
        mKVSeqLengths: Optional[cute.Tensor],    # [B] int32
        mQStart: Optional[cute.Tensor],          # [1] int32
        mCuSeqlensQ: Optional[cute.Tensor],      # [N + 1] int32 (refused: unsupported_reason)
        mCuSeqlensK: Optional[cute.Tensor],      # [N + 1] int32
        mO: cute.Tensor,                         # [B, Sq, Hq, D]
        mLSE: cute.Tensor,                       # [B, Hq, Sq] float32
    ):
        batch, seqlen_q, num_q_heads, head_dim = mQ.shape
        seqlen_k = mK.shape[1]
        num_kv_heads = mK.shape[2]
        group = self.options.group
        self.o_dtype = mO.element_type

        # Views with the query heads of one KV head as an inner mode ((group, Hkv), B); K and V
        # broadcast over `group` with stride 0, so GQA costs no copies.
        q = cute.make_tensor(mQ.iterator, cute.make_layout(
            (seqlen_q, head_dim, ((group, num_kv_heads), batch)),
            stride=(mQ.stride[1], 1, ((mQ.stride[2], mQ.stride[2] * group), mQ.stride[0]))))
        k = cute.make_tensor(mK.iterator, cute.make_layout(
            (seqlen_k, head_dim, ((group, num_kv_heads), batch)),
            stride=(mK.stride[1], 1, ((0, mK.stride[2]), mK.stride[0]))))
        v = cute.make_tensor(mV.iterator, cute.make_layout(
            (head_dim, seqlen_k, ((group, num_kv_heads), batch)),
            stride=(1, mV.stride[1], ((0, mV.stride[2]), mV.stride[0]))))
        o = cute.make_tensor(mO.iterator, cute.make_layout(
            (seqlen_q, head_dim, ((group, num_kv_heads), batch)),
            stride=(mO.stride[1], 1, ((mO.stride[2], mO.stride[2] * group), mO.stride[0]))))

        cta_group = tcgen05.CtaGroup.ONE
        qk_tiled_mma = sm100_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
            Float32, cta_group, self.qk_mma_tiler[:2])
        # P comes from TMEM (K-major), V from shared memory (MN-major: d is contiguous).
        pv_tiled_mma = sm100_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN,
            Float32, cta_group, self.pv_mma_tiler[:2], tcgen05.OperandSource.TMEM)

        q_smem_layout_staged = sm100_utils.make_smem_layout_a(
            qk_tiled_mma, self.qk_mma_tiler, self.dtype, self.q_stage)
        k_smem_layout_staged = sm100_utils.make_smem_layout_b(
            qk_tiled_mma, self.qk_mma_tiler, self.dtype, self.kv_stage)
        v_smem_layout_staged = sm100_utils.make_smem_layout_b(
            pv_tiled_mma, self.pv_mma_tiler, self.dtype, self.kv_stage)
        p_tmem_layout = sm100_utils.make_smem_layout_a(
            pv_tiled_mma, self.pv_mma_tiler, self.dtype, 1)
        self.o_layout = LayoutEnum.from_tensor(o)
        epi_tile = (ROWS_PER_TILE, self.head_dim)
        o_smem_layout_staged = sm100_utils.make_smem_layout_epi(
            self.o_dtype, self.o_layout, epi_tile, self.epi_stage)

        cluster_layout_vmnk = cute.tiled_divide(
            cute.make_layout((1, 1, 1)), (qk_tiled_mma.thr_id.shape,))
        load_op = cpasync.CopyBulkTensorTileG2SOp(cta_group)
        q_smem_layout = cute.select(q_smem_layout_staged, mode=[0, 1, 2])
        k_smem_layout = cute.select(k_smem_layout_staged, mode=[0, 1, 2])
        v_smem_layout = cute.select(v_smem_layout_staged, mode=[0, 1, 2])
        tma_atom_q, tma_q = cute.nvgpu.make_tiled_tma_atom_A(
            load_op, q, q_smem_layout, self.qk_mma_tiler, qk_tiled_mma, cluster_layout_vmnk.shape)
        tma_atom_k, tma_k = cute.nvgpu.make_tiled_tma_atom_B(
            load_op, k, k_smem_layout, self.qk_mma_tiler, qk_tiled_mma, cluster_layout_vmnk.shape)
        tma_atom_v, tma_v = cute.nvgpu.make_tiled_tma_atom_B(
            load_op, v, v_smem_layout, self.pv_mma_tiler, pv_tiled_mma, cluster_layout_vmnk.shape)
        o_smem_layout = cute.select(o_smem_layout_staged, mode=[0, 1])
        tma_atom_o, tma_o = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), o, o_smem_layout, epi_tile)
        self.q_tile_bytes = cute.size_in_bytes(self.dtype, q_smem_layout)
        self.kv_tile_bytes = cute.size_in_bytes(self.dtype, k_smem_layout)
        assert self.q_tile_bytes == self.schedule.pipeline("load_q").tx_bytes
        assert self.kv_tile_bytes == self.schedule.pipeline("load_kv").tx_bytes
        schedule = self.schedule

        @cute.struct
        class SharedStorage:
            # A pipeline's full and empty barriers per stage.
            load_q_mbar: cute.struct.MemRange[Int64, schedule.pipeline("load_q").stages * 2]
            load_kv_mbar: cute.struct.MemRange[Int64, schedule.pipeline("load_kv").stages * 2]
            epilogue_mbar: cute.struct.MemRange[Int64, schedule.pipeline("epilogue").stages * 2]
            s_full_mbar: cute.struct.MemRange[Int64, schedule.barrier("s_full").stages]
            p_ready_mbar: cute.struct.MemRange[Int64, schedule.barrier("p_ready").stages]
            stats_ready_mbar: cute.struct.MemRange[Int64, schedule.barrier("stats_ready").stages]
            stats_final_mbar: cute.struct.MemRange[Int64, schedule.barrier("stats_final").stages]
            stats_free_mbar: cute.struct.MemRange[Int64, schedule.barrier("stats_free").stages]
            o_full_mbar: cute.struct.MemRange[Int64, schedule.barrier("o_full").stages]
            tmem_address: Int32
            row_scale: cute.struct.MemRange[Float32, self.q_stage * ROWS_PER_TILE]
            row_stats: cute.struct.MemRange[Float32, self.q_stage * ROWS_PER_TILE * 2]
            lse: cute.struct.MemRange[Float32, self.epi_stage * ROWS_PER_TILE]
            sO: cute.struct.Align[
                cute.struct.MemRange[self.o_dtype, cute.cosize(o_smem_layout_staged)], 1024]
            sQ: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(q_smem_layout_staged)], 1024]
            sKV: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(k_smem_layout_staged)], 1024]

        self.shared_storage = SharedStorage

        num_m_blocks = (seqlen_q + self.cta_rows - 1) // self.cta_rows
        if cutlass.const_expr(self.options.mirrored_tiles and isinstance(num_m_blocks, int) and num_m_blocks % 2 == 1):
            raise ValueError(f"mirrored_tiles needs an even query-block count, not {num_m_blocks}")
        units = tile_scheduler.work_units(num_m_blocks, num_q_heads, batch, self.options.mirrored_tiles)
        grid_size = cutlass.min(units, self.options.sm_count)
        self.kernel(
            qk_tiled_mma, pv_tiled_mma,
            tma_atom_q, tma_q, tma_atom_k, tma_k, tma_atom_v, tma_v, tma_atom_o, tma_o,
            mLSE, mSinks, mQSegmentIds, mKVSegmentIds, mQSeqLengths, mKVSeqLengths, mQStart,
            q_smem_layout_staged, k_smem_layout_staged, v_smem_layout_staged, p_tmem_layout,
            o_smem_layout_staged,
            Int32(seqlen_q), Int32(seqlen_k), Int32(num_q_heads), Int32(batch), Int32(num_m_blocks),
        ).launch(grid=[grid_size, 1, 1], block=[self.threads_per_cta, 1, 1], cluster=[1, 1, 1],
                 stream=stream, min_blocks_per_mp=1)

    # ------------------------------------------------------------------------------------------
    # Device side
    # ------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(
        self,
        qk_tiled_mma: cute.TiledMma,
        pv_tiled_mma: cute.TiledMma,
        tma_atom_q: cute.CopyAtom, tma_q: cute.Tensor,
        tma_atom_k: cute.CopyAtom, tma_k: cute.Tensor,
        tma_atom_v: cute.CopyAtom, tma_v: cute.Tensor,
        tma_atom_o: cute.CopyAtom, tma_o: cute.Tensor,
        mLSE: cute.Tensor,
        mSinks: Optional[cute.Tensor],
        mQSegmentIds: Optional[cute.Tensor],
        mKVSegmentIds: Optional[cute.Tensor],
        mQSeqLengths: Optional[cute.Tensor],
        mKVSeqLengths: Optional[cute.Tensor],
        mQStart: Optional[cute.Tensor],
        q_smem_layout_staged: cute.ComposedLayout,
        k_smem_layout_staged: cute.ComposedLayout,
        v_smem_layout_staged: cute.ComposedLayout,
        p_tmem_layout: cute.ComposedLayout,
        o_smem_layout_staged: cute.ComposedLayout,
        seqlen_q: Int32, seqlen_k: Int32, num_q_heads: Int32, batch: Int32, num_m_blocks: Int32,
    ):
        self.protocol.start()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == self.load_warp_id:
            for atom in (tma_atom_q, tma_atom_k, tma_atom_v, tma_atom_o):
                cpasync.prefetch_descriptor(atom)

        storage = SmemAllocator().allocate(self.shared_storage)
        schedule = self.schedule
        load_q_producer, load_q_consumer = self.make_pipeline("load_q", storage.load_q_mbar)
        # K and V tiles alternate through one ring (same size since d_v = d).
        load_kv_producer, load_kv_consumer = self.make_pipeline("load_kv", storage.load_kv_mbar)
        epilogue_producer, epilogue_consumer = self.make_pipeline("epilogue", storage.epilogue_mbar)

        s_full = storage.s_full_mbar.data_ptr()
        p_ready = storage.p_ready_mbar.data_ptr()
        stats_ready = storage.stats_ready_mbar.data_ptr()
        stats_final = storage.stats_final_mbar.data_ptr()
        stats_free = storage.stats_free_mbar.data_ptr()
        o_full = storage.o_full_mbar.data_ptr()
        if warp_idx == self.mma_warp_id:
            with cute.arch.elect_one():
                for stage in cutlass.range_constexpr(self.q_stage):
                    for name, barrier in (("s_full", s_full), ("o_full", o_full), ("p_ready", p_ready),
                                          ("stats_ready", stats_ready), ("stats_final", stats_final),
                                          ("stats_free", stats_free)):
                        cute.arch.mbarrier_init(barrier + stage, schedule.barrier(name).arrivals)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        sQ = storage.sQ.get_tensor(q_smem_layout_staged.outer, swizzle=q_smem_layout_staged.inner)
        sK = storage.sKV.get_tensor(k_smem_layout_staged.outer, swizzle=k_smem_layout_staged.inner)
        sV = cute.make_tensor(
            cute.recast_ptr(sK.iterator, v_smem_layout_staged.inner), v_smem_layout_staged.outer)
        sO = storage.sO.get_tensor(o_smem_layout_staged.outer, swizzle=o_smem_layout_staged.inner)
        row_scale = storage.row_scale.get_tensor(cute.make_layout((ROWS_PER_TILE, self.q_stage)))
        row_stats = storage.row_stats.get_tensor(
            cute.make_layout((ROWS_PER_TILE, 2, self.q_stage)))
        sLSE = storage.lse.get_tensor(cute.make_layout((ROWS_PER_TILE, self.epi_stage)))
        tmem_address = storage.tmem_address

        qk_thr_mma = qk_tiled_mma.get_slice(0)
        pv_thr_mma = pv_tiled_mma.get_slice(0)
        problem = (seqlen_q, seqlen_k, num_q_heads, batch, num_m_blocks)
        optional = host.OptionalTensors(mSinks, mQSegmentIds, mKVSegmentIds, mQSeqLengths, mKVSeqLengths, mQStart)

        if warp_idx == self.load_warp_id:
            cute.arch.setmaxregister_decrease(self.registers_other)
            self.load_role(qk_thr_mma, pv_thr_mma, tma_atom_q, tma_q, tma_atom_k, tma_k,
                           tma_atom_v, tma_v, sQ, sK, sV, load_q_producer, load_kv_producer,
                           problem, optional)
        if warp_idx == self.epilogue_warp_id:
            cute.arch.setmaxregister_decrease(self.registers_other)
            self.epilogue_role(tma_atom_o, tma_o, sO, sLSE, mLSE, epilogue_consumer, problem)
        if warp_idx == self.mma_warp_id:
            cute.arch.setmaxregister_decrease(self.registers_other)
            self.tmem_ready_barrier.arrive_and_wait()
            tmem = cute.arch.retrieve_tmem_ptr(Float32, 16, tmem_address)
            self.mma_role(qk_tiled_mma, pv_tiled_mma, qk_thr_mma, pv_thr_mma, sQ, sK, sV, tmem,
                          p_tmem_layout, load_q_consumer, load_kv_consumer,
                          s_full, p_ready, o_full, problem, optional)
        if warp_idx == self.mma_warp_id + 3:
            cute.arch.setmaxregister_decrease(self.registers_other)
        if warp_idx < self.correction_warp_ids[0]:
            # Both softmax warpgroups run one copy of the code; the stage only moves addresses.
            stage = warp_idx // len(self.softmax_warp_ids[0])
            if stage < self.q_stage:
                cute.arch.setmaxregister_increase(self.registers_softmax)
                self.tmem_ready_barrier.arrive_and_wait()
                tmem = cute.arch.retrieve_tmem_ptr(Float32, 16, tmem_address)
                self.softmax_role(stage, tmem, qk_thr_mma, row_scale, row_stats, s_full, p_ready,
                                  stats_ready, stats_final, stats_free, problem, optional)
            else:
                cute.arch.setmaxregister_decrease(self.registers_other)
                self.tmem_ready_barrier.arrive_and_wait()
        if warp_idx >= self.correction_warp_ids[0] and warp_idx < self.mma_warp_id:
            cute.arch.setmaxregister_decrease(self.registers_correction)
            if warp_idx == self.correction_warp_ids[0]:
                cute.arch.alloc_tmem(self.tmem_columns_allocated, tmem_address)
            self.tmem_ready_barrier.arrive_and_wait()
            tmem = cute.arch.retrieve_tmem_ptr(Float32, 16, tmem_address)
            self.correction_role(pv_thr_mma, tmem, sO, sLSE, row_scale, row_stats,
                                 p_ready, stats_ready, stats_final, stats_free, o_full,
                                 epilogue_producer, problem, optional)
            # The correction warpgroup is the last TMEM reader: free it once all four warps are done.
            self.correction_barrier.arrive_and_wait()
            if warp_idx == self.correction_warp_ids[0]:
                cute.arch.relinquish_tmem_alloc_permit()
                cute.arch.dealloc_tmem(tmem, self.tmem_columns_allocated)
        self.protocol.check_finished()

    def make_pipeline(self, name: str, barrier_storage):
        """(producer, consumer) of the schedule's pipeline `name`, its barriers in `barrier_storage`."""
        description = self.schedule.pipeline(name)
        groups = dict(
            num_stages=description.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, description.producer_arrivals),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, description.consumer_arrivals),
            barrier_storage=barrier_storage.data_ptr(), defer_sync=True)
        if description.kind == pipeline_schedule.TMA_UMMA:
            return pipeline.PipelineTmaUmma.create(
                tx_count=description.tx_bytes, **groups).make_participants()
        return pipeline.PipelineAsync.create(**groups).make_participants()

    # ------------------------------------------------------------------------------------------
    # Work decomposition, walked identically by every role (fa4_jax.kernels.tile_scheduler, masking)
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def tile_coordinates(self, tile_index: Int32, problem):
        seqlen_q, seqlen_k, num_q_heads, batch, num_m_blocks = problem
        m_block, head, batch_index, _ = tile_scheduler.work_tile(
            tile_index, num_m_blocks, num_q_heads, batch, self.mask.causal, self.options.mirrored_tiles)
        return m_block, head, batch_index

    def head_batch_coordinate(self, head: Int32, batch_index: Int32):
        """Coordinate of query head `head` in the ((group, Hkv), B) mode of the tensor views."""
        group = self.options.group
        return ((head % group, head // group), batch_index)

    @cute.jit
    def tile_bounds(self, m_block: Int32, batch_index: Int32, problem, optional):
        """(row_start, q_len, kv_len, offset, first key block, end key block) of one CTA tile.

        row_start is the position row of the CTA's first query row (global when Q is split on
        sequence). The key range is never empty: a CTA whose rows see nothing still runs one fully
        masked block, so every role follows the same hand-off sequence and the row comes out as
        O = 0, LSE = -inf (or the sink logit).
        """
        row_start, q_len, kv_len, offset, first, end = masking.tile_extents(
            self.mask, m_block, batch_index, self.cta_rows, self.n_block, problem[0], problem[1],
            optional.q_seq_lengths if const_expr(self.mask.has_q_lengths) else None,
            optional.kv_seq_lengths if const_expr(self.options.has_kv_lengths) else None,
            optional.q_start if const_expr(self.options.has_q_start) else None, self.options.q_total)
        end = cutlass.max(end, first + 1)
        return row_start, q_len, kv_len, offset, first, end

    # ------------------------------------------------------------------------------------------
    # Load warp: Q once per tile, then K_0, (K_j, V_{j-1})..., V_last through the KV ring
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def load_role(self, qk_thr_mma, pv_thr_mma, tma_atom_q, tma_q, tma_atom_k, tma_k,
                  tma_atom_v, tma_v, sQ, sK, sV, q_producer, kv_producer, problem, optional):
        seqlen_q, seqlen_k, num_q_heads, batch, num_m_blocks = problem
        tSgQ = qk_thr_mma.partition_A(
            cute.flat_divide(tma_q, cute.select(self.qk_mma_tiler, mode=[0, 2])))
        tQsQ, tQgQ = cpasync.tma_partition(
            tma_atom_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 3),
            cute.group_modes(tSgQ, 0, 3))
        tSgK = qk_thr_mma.partition_B(
            cute.flat_divide(tma_k, cute.select(self.qk_mma_tiler, mode=[1, 2])))
        tKsK, tKgK = cpasync.tma_partition(
            tma_atom_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 3),
            cute.group_modes(tSgK, 0, 3))
        tOgV = pv_thr_mma.partition_B(
            cute.flat_divide(tma_v, cute.select(self.pv_mma_tiler, mode=[1, 2])))
        tVsV, tVgV = cpasync.tma_partition(
            tma_atom_v, 0, cute.make_layout(1), cute.group_modes(sV, 0, 3),
            cute.group_modes(tOgV, 0, 3))

        self.protocol.begin("load")
        num_tiles = tile_scheduler.walked_tiles(num_m_blocks, num_q_heads, batch, self.options.mirrored_tiles)
        tile_index = tile_scheduler.first_tile(cute.arch.block_idx()[0], self.options.mirrored_tiles)
        self.protocol.loop("load", "tiles")
        while tile_index < num_tiles:
            m_block, head, batch_index = self.tile_coordinates(tile_index, problem)
            head_batch = self.head_batch_coordinate(head, batch_index)
            n_min, n_max = self.tile_bounds(m_block, batch_index, problem, optional)[4:]
            tQgQ_tile = tQgQ[None, None, 0, head_batch]
            tKgK_tile = tKgK[None, None, 0, head_batch]
            tVgV_tile = tVgV[None, 0, None, head_batch]
            for stage in cutlass.range_constexpr(self.q_stage):
                self.protocol.expect("load", ACQUIRE, "load_q")
                handle = q_producer.acquire_and_advance()
                cute.copy(tma_atom_q, tQgQ_tile[None, m_block * self.q_stage + stage],
                          tQsQ[None, handle.index], tma_bar_ptr=handle.barrier)
            self.protocol.expect("load", ACQUIRE, "load_kv")
            handle = kv_producer.acquire_and_advance()
            cute.copy(tma_atom_k, tKgK_tile[None, n_min], tKsK[None, handle.index],
                      tma_bar_ptr=handle.barrier)
            self.protocol.loop("load", "blocks")
            for n_block in cutlass.range(n_min + 1, n_max, unroll=1):
                self.protocol.expect("load", ACQUIRE, "load_kv")
                handle = kv_producer.acquire_and_advance()
                cute.copy(tma_atom_k, tKgK_tile[None, n_block], tKsK[None, handle.index],
                          tma_bar_ptr=handle.barrier)
                self.protocol.expect("load", ACQUIRE, "load_kv")
                handle = kv_producer.acquire_and_advance()
                cute.copy(tma_atom_v, tVgV_tile[None, n_block - 1], tVsV[None, handle.index],
                          tma_bar_ptr=handle.barrier)
            self.protocol.end("load", "blocks")
            self.protocol.expect("load", ACQUIRE, "load_kv")
            handle = kv_producer.acquire_and_advance()
            cute.copy(tma_atom_v, tVgV_tile[None, n_max - 1], tVsV[None, handle.index],
                      tma_bar_ptr=handle.barrier)
            tile_index = tile_scheduler.next_tile(tile_index, cute.arch.grid_dim()[0], self.options.mirrored_tiles)
        self.protocol.end("load", "tiles")
        self.protocol.finish("load")

    # ------------------------------------------------------------------------------------------
    # MMA warp: PV_i(j-1) then QK_i(j) per query tile, all from one thread
    # ------------------------------------------------------------------------------------------
    def tmem_tensors(self, qk_thr_mma, pv_thr_mma, tmem, p_tmem_layout):
        s_layout = qk_thr_mma.make_fragment_C(
            qk_thr_mma.partition_shape_C(self.qk_mma_tiler[:2])).layout
        o_layout = pv_thr_mma.make_fragment_C(
            pv_thr_mma.partition_shape_C(self.pv_mma_tiler[:2])).layout
        tStS = [cute.make_tensor(tmem + offset, s_layout) for offset in self.tmem_s_offset]
        tOtO = [cute.make_tensor(tmem + offset, o_layout) for offset in self.tmem_o_offset]
        tOrP_shape = pv_thr_mma.make_fragment_A(
            cute.make_tensor(tmem, p_tmem_layout.outer))[None, None, None, 0]
        tOrP = [cute.make_tensor(cute.recast_ptr(tmem + offset, dtype=tOrP_shape.element_type),
                                 tOrP_shape.layout) for offset in self.tmem_p_offset]
        return tStS, tOtO, tOrP

    @cute.jit
    def gemm(self, tiled_mma, accumulator, a, b, accumulate):
        """accumulator (+)= a @ b over all k-blocks, issued by one elected thread of the MMA warp."""
        # A fresh atom per call: its ACCUMULATE field is per-call state, which must not leak into
        # the other roles' (shared) tiled MMA objects.
        atom = cute.make_mma_atom(tiled_mma.op)
        # A rolled loop: unrolled, the hoisted shared-memory descriptors of all k-blocks and both
        # query tiles outgrow the MMA warp's register budget.
        for k_block in cutlass.range(cute.size(a, mode=[2]), unroll=1):
            atom.set(tcgen05.Field.ACCUMULATE, accumulate or k_block != 0)
            cute.gemm(atom, accumulator, a[None, None, k_block], b[None, None, k_block],
                      accumulator)

    @cute.jit
    def mma_role(self, qk_tiled_mma, pv_tiled_mma, qk_thr_mma, pv_thr_mma, sQ, sK, sV, tmem,
                 p_tmem_layout, q_consumer, kv_consumer, s_full, p_ready, o_full, problem,
                 optional):
        seqlen_q, seqlen_k, num_q_heads, batch, num_m_blocks = problem
        tSrQ = qk_thr_mma.make_fragment_A(sQ)
        tSrK = qk_thr_mma.make_fragment_B(sK)
        tOrV = pv_thr_mma.make_fragment_B(sV)
        tStS, tOtO, tOrP = self.tmem_tensors(qk_thr_mma, pv_thr_mma, tmem, p_tmem_layout)

        self.protocol.begin("mma")
        p_ready_phase = Int32(0)
        num_tiles = tile_scheduler.walked_tiles(num_m_blocks, num_q_heads, batch, self.options.mirrored_tiles)
        tile_index = tile_scheduler.first_tile(cute.arch.block_idx()[0], self.options.mirrored_tiles)
        self.protocol.loop("mma", "tiles")
        while tile_index < num_tiles:
            m_block, head, batch_index = self.tile_coordinates(tile_index, problem)
            n_min, n_max = self.tile_bounds(m_block, batch_index, problem, optional)[4:]
            q_handles = []
            for stage in cutlass.range_constexpr(self.q_stage):
                self.protocol.expect("mma", CONSUMER_WAIT, "load_q")
                q_handles.append(q_consumer.wait_and_advance())
            self.protocol.expect("mma", CONSUMER_WAIT, "load_kv")
            k_handle = kv_consumer.wait_and_advance()
            for stage in cutlass.range_constexpr(self.q_stage):
                self.gemm(qk_tiled_mma, tStS[stage], tSrQ[None, None, None, q_handles[stage].index],
                          tSrK[None, None, None, k_handle.index], False)
                self.protocol.expect("mma", MMA_COMMIT, "s_full", stage)
                with cute.arch.elect_one():
                    tcgen05.commit(s_full + stage)
            self.protocol.expect("mma", RELEASE, "k")
            k_handle.release()
            self.protocol.loop("mma", "blocks")
            for n_block in cutlass.range(n_min + 1, n_max, unroll=1):
                self.protocol.expect("mma", CONSUMER_WAIT, "load_kv")
                k_handle = kv_consumer.wait_and_advance()
                self.protocol.expect("mma", CONSUMER_WAIT, "load_kv")
                v_handle = kv_consumer.wait_and_advance()
                for stage in cutlass.range_constexpr(self.q_stage):
                    self.protocol.expect("mma", WAIT, "p_ready", stage)
                    cute.arch.mbarrier_wait(p_ready + stage, p_ready_phase)
                    self.gemm(pv_tiled_mma, tOtO[stage], tOrP[stage],
                              tOrV[None, None, None, v_handle.index], n_block > n_min + 1)
                    self.gemm(qk_tiled_mma, tStS[stage],
                              tSrQ[None, None, None, q_handles[stage].index],
                              tSrK[None, None, None, k_handle.index], False)
                    self.protocol.expect("mma", MMA_COMMIT, "s_full", stage)
                    with cute.arch.elect_one():
                        tcgen05.commit(s_full + stage)
                self.protocol.expect("mma", FLIP, "p_ready_phase")
                p_ready_phase ^= 1
                self.protocol.expect("mma", RELEASE, "k")
                k_handle.release()
                self.protocol.expect("mma", RELEASE, "v")
                v_handle.release()
            self.protocol.end("mma", "blocks")
            self.protocol.expect("mma", CONSUMER_WAIT, "load_kv")
            v_handle = kv_consumer.wait_and_advance()
            for stage in cutlass.range_constexpr(self.q_stage):
                self.protocol.expect("mma", WAIT, "p_ready", stage)
                cute.arch.mbarrier_wait(p_ready + stage, p_ready_phase)
                self.gemm(pv_tiled_mma, tOtO[stage], tOrP[stage],
                          tOrV[None, None, None, v_handle.index], n_max - n_min > 1)
                self.protocol.expect("mma", MMA_COMMIT, "o_full", stage)
                with cute.arch.elect_one():
                    tcgen05.commit(o_full + stage)
            self.protocol.expect("mma", FLIP, "p_ready_phase")
            p_ready_phase ^= 1
            self.protocol.expect("mma", RELEASE, "v")
            v_handle.release()
            for stage, handle in enumerate(q_handles):
                self.protocol.expect("mma", RELEASE, f"q{stage}")
                handle.release()
            tile_index = tile_scheduler.next_tile(tile_index, cute.arch.grid_dim()[0], self.options.mirrored_tiles)
        self.protocol.end("mma", "tiles")
        self.protocol.finish("mma")

    # ------------------------------------------------------------------------------------------
    # Softmax warpgroups: S (TMEM) -> registers -> mask, online softmax -> P (TMEM), a row per thread
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def softmax_role(self, stage: Int32, tmem, qk_thr_mma, row_scale, row_stats, s_full, p_ready,
                     stats_ready, stats_final, stats_free, problem, optional):
        seqlen_q, seqlen_k, num_q_heads, batch, num_m_blocks = problem
        mSinks, mQSegmentIds, mKVSegmentIds = optional.sinks, optional.q_segment_ids, optional.kv_segment_ids
        row = cute.arch.thread_idx()[0] % ROWS_PER_TILE
        s_layout = qk_thr_mma.make_fragment_C(
            qk_thr_mma.partition_shape_C(self.qk_mma_tiler[:2])).layout
        tStS = cute.make_tensor(tmem + stage * self.n_block, s_layout)
        tScS = qk_thr_mma.partition_C(cute.make_identity_tensor(self.qk_mma_tiler[:2]))
        tiled_load = tcgen05.make_tmem_copy(cute.make_copy_atom(
            tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(32)), Float32), tStS)
        thr_load = tiled_load.get_slice(row)
        tLtS = thr_load.partition_S(tStS)
        tLcS = thr_load.partition_D(tScS)
        # The thread's scores and their coordinates as the (rows, cols) = (1, n_block) views the
        # shared softmax and mask code take.
        row_view = cute.make_layout((1, self.n_block))
        coords_mn = cute.make_tensor(tLcS.iterator, cute.composition(tLcS.layout, row_view))
        # P: the row's n_block 16-bit values packed into n_block / 2 32-bit columns over S's second
        # half, which the softmax has already read.
        p_columns = self.n_block // 2
        tStP = cute.make_tensor(tmem + stage * self.n_block + self.n_block // 2, cute.composition(
            s_layout, cute.make_layout((ROWS_PER_TILE, p_columns))))
        tScP = cute.make_tensor(tScS.iterator, cute.composition(
            tScS.layout, cute.make_layout((ROWS_PER_TILE, p_columns))))
        tiled_store = tcgen05.make_tmem_copy(cute.make_copy_atom(
            tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(16)), Float32), tStP)
        thr_store = tiled_store.get_slice(row)
        tSTtP = thr_store.partition_D(tStP)
        tSTcP = thr_store.partition_S(tScP)

        row_max, row_sum = online_softmax.OnlineSoftmax.new_state(1)
        scale_rows = cute.make_rmem_tensor(1, Float32)
        lse_rows = cute.make_rmem_tensor(1, Float32)
        output_scale = cute.make_rmem_tensor(1, Float32)
        # One copy of this code runs every query tile's softmax (`stage` is dynamic): it is checked
        # against softmax0's program, which differs from the others' only in the stage.
        self.protocol.begin("softmax0")
        s_full_phase = Int32(0)
        stats_free_phase = Int32(1)  # the first tile has no previous row_stats to wait for
        num_tiles = tile_scheduler.walked_tiles(num_m_blocks, num_q_heads, batch, self.options.mirrored_tiles)
        tile_index = tile_scheduler.first_tile(cute.arch.block_idx()[0], self.options.mirrored_tiles)
        self.protocol.loop("softmax0", "tiles")
        while tile_index < num_tiles:
            m_block, head, batch_index = self.tile_coordinates(tile_index, problem)
            row_start, q_len, kv_len, offset, n_min, n_max = self.tile_bounds(
                m_block, batch_index, problem, optional)
            stage_row_start = row_start + stage * ROWS_PER_TILE
            local_row_start = m_block * self.cta_rows + stage * ROWS_PER_TILE
            q_segments = None
            kv_segments = None
            if const_expr(self.mask.has_segments):
                q_segments = mQSegmentIds[batch_index, None]
                kv_segments = mKVSegmentIds[batch_index, None]
            online_softmax.OnlineSoftmax.reset(row_max, row_sum)
            self.protocol.loop("softmax0", "blocks")
            for n_block in cutlass.range(n_min, n_max, unroll=1):
                self.protocol.expect("softmax0", WAIT, "s_full", stage)
                cute.arch.mbarrier_wait(s_full + stage, s_full_phase)
                self.protocol.expect("softmax0", FLIP, "s_full_phase")
                s_full_phase ^= 1
                tLrS = cute.make_rmem_tensor(tLcS.shape, Float32)
                cute.copy(tiled_load, tLtS, tLrS)
                cute.arch.fence_view_async_tmem_load()
                scores_mn = cute.make_tensor(tLrS.iterator, row_view)
                if const_expr(self.options.softcap is not None):
                    apply_softcap(tLrS, self.options.softcap, self.options.scale)
                if masking.block_is_partial(self.mask, n_block, stage_row_start, ROWS_PER_TILE,
                                            self.n_block, kv_len, q_len, offset):
                    masking.apply_mask(scores_mn, coords_mn, self.mask, stage_row_start,
                                       n_block * self.n_block, kv_len, q_len, offset,
                                       local_row_start, q_segments, kv_segments)
                    self.softmax_on_mufu.step(scores_mn, row_max, row_sum, scale_rows)
                    self.hand_over_p(tLrS, tiled_store, tSTtP, tSTcP, scale_rows, row_scale, row,
                                     stage, stats_ready, p_ready)
                else:
                    self.softmax.step(scores_mn, row_max, row_sum, scale_rows)
                    self.hand_over_p(tLrS, tiled_store, tSTtP, tSTcP, scale_rows, row_scale, row,
                                     stage, stats_ready, p_ready)
            self.protocol.end("softmax0", "blocks")
            sink_logit = None
            if const_expr(self.options.has_sinks):
                sink_logit = Float32(mSinks[head])
            self.softmax.finalize(row_max, row_sum, sink_logit, lse_rows, output_scale)
            self.protocol.expect("softmax0", WAIT, "stats_free", stage)
            cute.arch.mbarrier_wait(stats_free + stage, stats_free_phase)
            self.protocol.expect("softmax0", FLIP, "stats_free_phase")
            stats_free_phase ^= 1
            row_stats[row, 0, stage] = output_scale[0]
            row_stats[row, 1, stage] = lse_rows[0]
            self.protocol.expect("softmax0", ARRIVE, "stats_final", stage)
            cute.arch.mbarrier_arrive(stats_final + stage)
            tile_index = tile_scheduler.next_tile(tile_index, cute.arch.grid_dim()[0], self.options.mirrored_tiles)
        self.protocol.end("softmax0", "tiles")
        self.protocol.finish("softmax0")

    @cute.jit
    def hand_over_p(self, tLrS, tiled_store, tSTtP, tSTcP, scale_rows, row_scale, row, stage,
                    stats_ready, p_ready):
        """Publish the row's rescale factor to the correction warpgroup, then P into TMEM for the MMA.

        Called inside each branch of the softmax (masked / unmasked block) rather than after their
        join, where ptxas would have to reconcile two register assignments of the row's scores."""
        row_scale[row, stage] = scale_rows[0]
        self.protocol.expect("softmax0", ARRIVE, "stats_ready", stage)
        cute.arch.mbarrier_arrive(stats_ready + stage)
        # Convert and store P a 32-score chunk at a time, so each chunk's fp32 registers die as soon
        # as its packed half is in TMEM.
        for k in cutlass.range_constexpr(cute.size(tLrS, mode=[1])):
            scores = tLrS[None, k, None, None]
            packed = cute.make_rmem_tensor(tSTcP[None, None, k].shape, Float32)
            cute.make_tensor(cute.recast_ptr(packed.iterator, dtype=self.dtype),
                             scores.layout).store(scores.load().to(self.dtype))
            cute.copy(tiled_store, packed, tSTtP[None, None, k])
        cute.arch.fence_view_async_tmem_store()
        self.protocol.expect("softmax0", ARRIVE, "p_ready", stage)
        cute.arch.mbarrier_arrive(p_ready + stage)

    # ------------------------------------------------------------------------------------------
    # Correction warpgroup: rescale O_i in TMEM when a row's max moved, then normalise O into smem
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def correction_role(self, pv_thr_mma, tmem, sO, sLSE, row_scale, row_stats, p_ready,
                        stats_ready, stats_final, stats_free, o_full, epilogue_producer, problem,
                        optional):
        seqlen_q, seqlen_k, num_q_heads, batch, num_m_blocks = problem
        row = cute.arch.thread_idx()[0] % ROWS_PER_TILE
        o_layout = pv_thr_mma.make_fragment_C(
            pv_thr_mma.partition_shape_C(self.pv_mma_tiler[:2])).layout
        tOtO = [cute.make_tensor(tmem + offset, o_layout) for offset in self.tmem_o_offset]

        # Rescale in 16-column slices so a slice's load, multiply and store stay in registers.
        slice_columns = 16
        tOtO_slice = cute.make_tensor(tmem, cute.composition(
            o_layout, cute.make_layout((ROWS_PER_TILE, slice_columns))))
        tiled_slice_load = tcgen05.make_tmem_copy(cute.make_copy_atom(
            tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(slice_columns)), Float32), tOtO_slice)
        tiled_slice_store = tcgen05.make_tmem_copy(cute.make_copy_atom(
            tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(slice_columns)), Float32), tOtO_slice)
        tSLtO = tiled_slice_load.get_slice(row).partition_S(tOtO_slice)
        tOcO = pv_thr_mma.partition_C(cute.make_identity_tensor(self.pv_mma_tiler[:2]))
        tSLcO = tiled_slice_load.get_slice(row).partition_D(cute.make_tensor(
            tOcO.iterator, cute.composition(tOcO.layout,
                                            cute.make_layout((ROWS_PER_TILE, slice_columns)))))
        tSStO = tiled_slice_store.get_slice(row).partition_D(tOtO_slice)
        scale_rows = cute.make_rmem_tensor(1, Float32)

        self.protocol.begin("correction")
        stats_phase = Int32(0)
        final_phase = Int32(0)
        num_tiles = tile_scheduler.walked_tiles(num_m_blocks, num_q_heads, batch, self.options.mirrored_tiles)
        tile_index = tile_scheduler.first_tile(cute.arch.block_idx()[0], self.options.mirrored_tiles)
        self.protocol.loop("correction", "tiles")
        while tile_index < num_tiles:
            m_block, head, batch_index = self.tile_coordinates(tile_index, problem)
            n_min, n_max = self.tile_bounds(m_block, batch_index, problem, optional)[4:]
            self.protocol.loop("correction", "blocks")
            for step in cutlass.range(n_max - n_min, unroll=1):
                for stage in cutlass.range_constexpr(self.q_stage):
                    self.protocol.expect("correction", WAIT, "stats_ready", stage)
                    cute.arch.mbarrier_wait(stats_ready + stage, stats_phase)
                    scale_rows[0] = row_scale[row, stage]
                    # The first block's PV overwrites O, so there is nothing to rescale yet; later,
                    # a warp touches O only when one of its rows moved its max (lazy rescaling).
                    if step > 0 and cute.arch.vote_any_sync(scale_rows[0] != 1.0):
                        for k in cutlass.range_constexpr(self.head_dim // slice_columns):
                            column = self.tmem_o_offset[stage] + k * slice_columns
                            values = cute.make_rmem_tensor(tSLcO.shape, Float32)
                            cute.copy(tiled_slice_load, cute.make_tensor(
                                tSLtO.iterator + column, tSLtO.layout), values)
                            cute.arch.fence_view_async_tmem_load()
                            online_softmax.rescale_rows(
                                cute.make_tensor(values.iterator,
                                                 cute.make_layout((1, slice_columns))),
                                scale_rows, False)
                            cute.copy(tiled_slice_store, values, cute.make_tensor(
                                tSStO.iterator + column, tSStO.layout))
                        cute.arch.fence_view_async_tmem_store()
                    self.protocol.expect("correction", ARRIVE, "p_ready", stage)
                    cute.arch.mbarrier_arrive(p_ready + stage)
                self.protocol.expect("correction", FLIP, "stats_phase")
                stats_phase ^= 1
            self.protocol.end("correction", "blocks")
            for stage in cutlass.range_constexpr(self.q_stage):
                self.protocol.expect("correction", WAIT, "stats_final", stage)
                cute.arch.mbarrier_wait(stats_final + stage, final_phase)
                output_scale = row_stats[row, 0, stage]
                lse = row_stats[row, 1, stage]
                self.protocol.expect("correction", ARRIVE, "stats_free", stage)
                cute.arch.mbarrier_arrive(stats_free + stage)
                self.protocol.expect("correction", WAIT, "o_full", stage)
                cute.arch.mbarrier_wait(o_full + stage, final_phase)
                self.protocol.expect("correction", ACQUIRE, "epilogue")
                handle = epilogue_producer.acquire_and_advance()
                self.write_output_tile(pv_thr_mma, tOtO[stage], sO[None, None, handle.index],
                                       output_scale, row)
                sLSE[row, handle.index] = lse
                cute.arch.fence_view_async_shared()
                self.protocol.expect("correction", COMMIT, "o")
                handle.commit()
            self.protocol.expect("correction", FLIP, "final_phase")
            final_phase ^= 1
            tile_index = tile_scheduler.next_tile(tile_index, cute.arch.grid_dim()[0], self.options.mirrored_tiles)
        self.protocol.end("correction", "tiles")
        self.protocol.finish("correction")

    @cute.jit
    def write_output_tile(self, pv_thr_mma, tOtO, sO_stage, output_scale, row):
        """O (TMEM, fp32) * output_scale -> output dtype -> shared memory, in 32-byte column slices."""
        columns = 32 * 8 // self.o_dtype.width
        slice_shape = cute.make_layout((ROWS_PER_TILE, columns))
        tOtO_slices = cute.logical_divide(tOtO, slice_shape)
        tOcO_slices = cute.logical_divide(
            pv_thr_mma.partition_C(cute.make_identity_tensor(self.pv_mma_tiler[:2])), slice_shape)
        tOsO_slices = cute.logical_divide(pv_thr_mma.partition_C(sO_stage), slice_shape)
        load_atom = sm100_utils.get_tmem_load_op(
            self.pv_mma_tiler, self.o_layout, self.o_dtype, Float32,
            (ROWS_PER_TILE, columns), use_2cta_instrs=False)
        tiled_load = tcgen05.make_tmem_copy(load_atom, tOtO_slices[(None, None), 0])
        thr_load = tiled_load.get_slice(row)
        tLtO = thr_load.partition_S(tOtO_slices[(None, None), None])
        tLsO = thr_load.partition_D(tOsO_slices[(None, None), None])
        tLcO = thr_load.partition_D(tOcO_slices[(None, None), None])
        tiled_smem_store = cute.make_tiled_copy_D(
            sm100_utils.get_smem_store_op(self.o_layout, self.o_dtype, Float32, tiled_load),
            tiled_load)
        for k in cutlass.range_constexpr(self.head_dim // columns):
            values = cute.make_rmem_tensor(tLcO[None, 0, 0, k].shape, Float32)
            cute.copy(tiled_load, tLtO[None, 0, 0, k], values)
            cute.arch.fence_view_async_tmem_load()
            narrow = cute.make_rmem_tensor(values.shape, self.o_dtype)
            narrow.store((values.load() * output_scale).to(self.o_dtype))
            cute.copy(tiled_smem_store, narrow, tLsO[None, 0, 0, k])

    # ------------------------------------------------------------------------------------------
    # Epilogue warp: TMA store of each normalised O tile, LSE rows to global memory
    # ------------------------------------------------------------------------------------------
    @cute.jit
    def epilogue_role(self, tma_atom_o, tma_o, sO, sLSE, mLSE, epilogue_consumer, problem):
        seqlen_q, seqlen_k, num_q_heads, batch, num_m_blocks = problem
        lane = cute.arch.lane_idx()
        gO = cute.flat_divide(tma_o, (ROWS_PER_TILE, self.head_dim))
        self.protocol.begin("epilogue")
        num_tiles = tile_scheduler.walked_tiles(num_m_blocks, num_q_heads, batch, self.options.mirrored_tiles)
        tile_index = tile_scheduler.first_tile(cute.arch.block_idx()[0], self.options.mirrored_tiles)
        self.protocol.loop("epilogue", "tiles")
        while tile_index < num_tiles:
            m_block, head, batch_index = self.tile_coordinates(tile_index, problem)
            gO_tile = gO[None, None, None, 0, self.head_batch_coordinate(head, batch_index)]
            tOsO, tOgO = cpasync.tma_partition(
                tma_atom_o, 0, cute.make_layout(1), cute.group_modes(sO, 0, 2),
                cute.group_modes(gO_tile, 0, 2))
            for stage in cutlass.range_constexpr(self.q_stage):
                self.protocol.expect("epilogue", CONSUMER_WAIT, "epilogue")
                handle = epilogue_consumer.wait_and_advance()
                # One lane issues the bulk store (every lane would store the tile again). The buffer
                # is free once all 32 lanes released it, the last being that lane after its wait.
                with cute.arch.elect_one():
                    cute.copy(tma_atom_o, tOsO[None, handle.index],
                              tOgO[None, m_block * self.q_stage + stage])
                    cute.arch.cp_async_bulk_commit_group()
                tile_row = m_block * self.cta_rows + stage * ROWS_PER_TILE
                for r in cutlass.range_constexpr(ROWS_PER_TILE // THREADS_PER_WARP):
                    local_row = r * THREADS_PER_WARP + lane
                    if tile_row + local_row < seqlen_q:
                        mLSE[batch_index, head, tile_row + local_row] = sLSE[local_row, handle.index]
                with cute.arch.elect_one():
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                self.protocol.expect("epilogue", RELEASE, "o")
                handle.release()
            tile_index = tile_scheduler.next_tile(tile_index, cute.arch.grid_dim()[0], self.options.mirrored_tiles)
        self.protocol.end("epilogue", "tiles")
        self.protocol.finish("epilogue")


# --------------------------------------------------------------------------------------------------
# The kernel module's face (what fa4_jax/lowering/cuda.py calls on compute capability 10.x).

def unsupported_reason(config: AttentionConfig, problem: host.Problem) -> Optional[str]:
    """None when this kernel computes `config` exactly; otherwise what it cannot take, for the user."""
    reason = host.kernel_unsupported_reason("sm100", config, problem, SUPPORTED_HEAD_DIMS)
    if reason is not None:
        return reason
    if config.has_q_start and (config.has_q_seq_lengths or config.has_kv_seq_lengths or config.has_segment_ids):
        return ("the sm100 kernel does not combine a sequence-sharded query (q_start) with sequence lengths "
                "or segment ids")
    if config.has_q_start:
        # As in the sm90 forward: the path compiles (tests/test_kernel_compile_sm100.py) but has never
        # run on a GPU, so sequence-sharded queries take the reference until it has.
        return "the sm100 kernel's sequence-sharded query path (q_start) is not yet verified on a GPU"
    return None


def options(config: AttentionConfig, problem: host.Problem, sm_count: Optional[int] = None,
            **overrides) -> KernelOptions:
    """The static kernel configuration for one call, with `overrides` (KernelOptions fields, for tests
    and tuning sweeps) on top; also what the compile tests build."""
    q_stage, _ = _tile_shape(problem.head_dim)
    mirrored = config.causal and tile_scheduler.mirrors_whole_units(problem.q_len, q_stage * ROWS_PER_TILE)
    overrides = {"mirrored_tiles": mirrored, **overrides}
    return KernelOptions(
        dtype_name=problem.dtype,
        head_dim=problem.head_dim,
        group=problem.group,
        scale=float(config.scale),
        mask=masking.MaskShape.from_config(config),
        softcap=None if config.softcap is None else float(config.softcap),
        has_sinks=config.has_sinks,
        has_kv_lengths=config.has_kv_seq_lengths,
        has_q_start=config.has_q_start,
        q_total=config.q_total if config.has_q_start else None,
        sm_count=host.sm_count(DEFAULT_SM_COUNT) if sm_count is None else sm_count,
        **overrides,
    )


@functools.lru_cache(maxsize=None)
def _kernel(options: KernelOptions) -> Sm100ForwardKernel:
    return Sm100ForwardKernel(options)


def run(options: KernelOptions, query, key, value, optional: dict):
    """(out [B, Sq, Hq, D] in the query dtype, lse [B, Hq, Sq] float32), traceable under jax.jit."""
    return host.launch_forward(_kernel(options), options, query, key, value, optional)
