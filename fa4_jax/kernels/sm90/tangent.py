"""Hopper (sm_90a) forward-mode tangent kernel in CuTe DSL, and its JAX entry points.

The tangent of attention, from the forward's saved O and LSE (P = exp(S - lse), no online softmax):

    t_S   = scale (t_Q K^T + Q t_K^T)            (times the softcap's slope 1 - tanh^2)
    t_lse = rowsum(P o t_S) + P_sink t_sink
    t_O   = P t_V + (P o t_S) V - t_lse o O

Design (one CTA = one 128-row query tile at a time, persistent over tiles, like the forward kernel):
- warpgroup 0, the producer: its first warp issues TMA loads of Q and t_Q once per tile (one stage,
  one barrier for both), then of (K, t_K) and (V, t_V) per key block into two `num_stages`-deep rings,
  each stage holding both tensors under one full/empty mbarrier pair (PipelineTmaAsync);
- warpgroups 1 and 2, the consumers, each own 64 query rows. Per key block: S = Q K^T and
  t_S = t_Q K^T + Q t_K^T (three wgmma from shared memory, two into one accumulator); P recomputed
  from the saved LSE in the exp2 domain with the mask and softcap of the backward
  (`common.backward_numerics`, the same arithmetic the backward kernels run); t_S scaled, times the
  softcap slope, times P, summed into the row's t_lse; P and P o t_S rounded to bf16/fp16 in
  registers; then t_O += P t_V + (P o t_S) V (two wgmma with A from registers, one accumulator);
- epilogue: t_lse reduced over the four threads of each row, plus the sink's term; t_O - t_lse o O
  with O read from global memory; t_O written in the input type, t_lse in float32.
- since P needs no running maximum, key blocks are walked in ascending order and no rescaling
  happens; blocks no row of the tile can see (causal, window, lengths) are never loaded.

Memory: O(S) (the operands, O and LSE); the score tiles live in registers.
Grouped-query attention maps query head h to key/value head h // (Hq / Hkv).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.memory import SmemAllocator

from fa4_jax.config import AttentionConfig
from fa4_jax.kernels import host
from fa4_jax.kernels.common import masking, tile_scheduler
from fa4_jax.kernels.common.backward_numerics import BackwardNumerics
from fa4_jax.kernels.common.dsl_idioms import advanced, select_modes
from fa4_jax.kernels.sm90 import DEFAULT_SM_COUNT, wgmma

SUPPORTED_HEAD_DIMS = (64, 128)
ROWS_PER_WARPGROUP = 64  # one wgmma M
CONSUMER_WARPGROUPS = 2
# (producer, consumer) registers per thread after setmaxnreg: 24 * 128 + 240 * 256 = 64512 <= 64K.
REGISTERS = (24, 240)
SHARED_MEMORY_LIMIT = 227 * 1024  # bytes per CTA on sm_90

# (key tile, pipeline stages) per head dim: each stage holds K, t_K, V and t_V, so at D = 128 a
# 64-key tile keeps two stages next to Q and t_Q (192 KiB); at D = 64 128 keys fit (160 KiB).
_TILE_N_AND_STAGES = {64: (128, 2), 128: (64, 2)}


@dataclasses.dataclass(frozen=True)
class TangentOptions:
    """Everything static about one compiled tangent kernel (hashable: it is the compile key)."""

    dtype_name: str            # "bfloat16" | "float16"
    head_dim: int
    v_head_dim: int
    group: int                 # query heads per key/value head
    scale: float
    mask: masking.MaskShape
    softcap: Optional[float]
    has_sinks: bool
    has_q_lengths: bool
    has_kv_lengths: bool
    has_q_start: bool
    q_total: Optional[int]
    sm_count: int
    # Causal: a query block and its mirror of one head back to back (tile_scheduler.mirrored_tile), the
    # forward's order (docs/sm90_forward_tuning.md); `options` takes it where the query-block count is
    # even, so no unit has an empty second tile.
    mirrored_tiles: bool = False

    @property
    def tile_m(self) -> int:
        return ROWS_PER_WARPGROUP * CONSUMER_WARPGROUPS

    @property
    def tile_n(self) -> int:
        return _TILE_N_AND_STAGES[self.head_dim][0]

    @property
    def num_stages(self) -> int:
        return _TILE_N_AND_STAGES[self.head_dim][1]

    def shared_memory_bytes(self) -> int:
        """Q, t_Q, and per stage K, t_K, V, t_V (each 1024-byte aligned), and the mbarriers."""
        def aligned(elements):
            return -(-2 * elements // 1024) * 1024
        barriers = 8 * (2 + 4 * self.num_stages)
        total = barriers + 2 * aligned(self.tile_m * self.head_dim)
        total += 2 * aligned(self.tile_n * self.head_dim * self.num_stages)
        total += 2 * aligned(self.tile_n * self.v_head_dim * self.num_stages)
        return total + 1024  # the first buffer's alignment after the barriers

    def check(self):
        """Raise ValueError when these options cannot make a kernel."""
        if self.head_dim not in _TILE_N_AND_STAGES or self.v_head_dim != self.head_dim:
            raise ValueError(f"the sm90 tangent kernel takes D = Dv in {SUPPORTED_HEAD_DIMS}, "
                             f"not {self.head_dim} / {self.v_head_dim}")
        if self.shared_memory_bytes() > SHARED_MEMORY_LIMIT:
            raise ValueError(f"{self.shared_memory_bytes()} bytes of shared memory needed, "
                             f"{SHARED_MEMORY_LIMIT} available")


def _shared_storage_struct(dtype, kv_stages: int, q_elements: int, k_elements: int, v_elements: int):
    """The CTA's shared storage: full/empty mbarrier pairs (one Q stage, `kv_stages` key and value
    stages), then Q, t_Q, K, t_K, V, t_V, each 1024-byte aligned for the 128-byte swizzle."""
    fields = {
        "q_barriers": cute.struct.MemRange[cutlass.Int64, 2],
        "k_barriers": cute.struct.MemRange[cutlass.Int64, 2 * kv_stages],
        "v_barriers": cute.struct.MemRange[cutlass.Int64, 2 * kv_stages],
        "s_q": cute.struct.Align[cute.struct.MemRange[dtype, q_elements], 1024],
        "s_tq": cute.struct.Align[cute.struct.MemRange[dtype, q_elements], 1024],
        "s_k": cute.struct.Align[cute.struct.MemRange[dtype, k_elements], 1024],
        "s_tk": cute.struct.Align[cute.struct.MemRange[dtype, k_elements], 1024],
        "s_v": cute.struct.Align[cute.struct.MemRange[dtype, v_elements], 1024],
        "s_tv": cute.struct.Align[cute.struct.MemRange[dtype, v_elements], 1024],
    }
    return cute.struct(type("TangentSharedStorage", (), {"__annotations__": fields}))


class Sm90TangentKernel:
    """Warp-specialised TMA + wgmma attention tangent (forward-mode AD) for one static configuration."""

    def __str__(self):
        # The compiled kernel's name in profiles (the DSL takes str(self)), fixed rather than the repr.
        return "fa4_jax_sm90_tangent"

    def __init__(self, options: TangentOptions):
        options.check()
        self.options = options
        self.dtype = host.cutlass_dtype(options.dtype_name)
        self.head_dim = options.head_dim
        self.v_head_dim = options.v_head_dim
        self.tile_m = options.tile_m
        self.tile_n = options.tile_n
        self.num_stages = options.num_stages
        self.mask = options.mask
        self.threads = wgmma.WARP_GROUP * (1 + CONSUMER_WARPGROUPS)
        self.consumer_threads = wgmma.WARP_GROUP * CONSUMER_WARPGROUPS
        self.producer_registers, self.consumer_registers = REGISTERS
        self.numerics = BackwardNumerics(options.mask, options.softcap, options.scale, self.tile_m, self.tile_n)

    # ----------------------------------------------------------------------------------------------
    # Host side: layouts, TMA atoms, shared storage, launch.
    @cute.jit
    def __call__(self, stream: cuda.CUstream, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
                 mO: cute.Tensor, mLSE: cute.Tensor, mTQ: cute.Tensor, mTK: cute.Tensor, mTV: cute.Tensor,
                 mSinks: Optional[cute.Tensor], mTSinks: Optional[cute.Tensor],
                 mQSegmentIds: Optional[cute.Tensor], mKVSegmentIds: Optional[cute.Tensor],
                 mQSeqLengths: Optional[cute.Tensor], mKVSeqLengths: Optional[cute.Tensor],
                 mQStart: Optional[cute.Tensor], mTO: cute.Tensor, mTLSE: cute.Tensor):
        # [B, S, H, D] -> (S, D, H, B): the tile modes first, as TMA and wgmma partitioning expect.
        mQ, mK, mV, mO, mTQ, mTK, mTV, mTO = [
            select_modes(t, [1, 3, 2, 0]) for t in (mQ, mK, mV, mO, mTQ, mTK, mTV, mTO)]
        mLSE, mTLSE = [select_modes(t, [2, 1, 0]) for t in (mLSE, mTLSE)]  # (S, Hq, B)

        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
            Float32, atom_layout_mnk=(CONSUMER_WARPGROUPS, 1, 1), tiler_mn=(64, self.tile_n))
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN,
            Float32, atom_layout_mnk=(CONSUMER_WARPGROUPS, 1, 1), tiler_mn=(64, self.v_head_dim),
            a_source=warpgroup.OperandSource.RMEM)

        q_layout = wgmma.k_major_layout(self.dtype, self.tile_m, self.head_dim)
        k_layout = wgmma.k_major_layout(self.dtype, self.tile_n, self.head_dim, self.num_stages)
        v_layout = wgmma.k_major_layout(self.dtype, self.tile_n, self.v_head_dim, self.num_stages)

        load_op = cpasync.CopyBulkTensorTileG2SOp()
        k_tile_layout = cute.select(k_layout, mode=[0, 1])
        v_tile_layout = cute.select(v_layout, mode=[0, 1])
        tma_q, tma_m_q = cpasync.make_tiled_tma_atom(load_op, mQ, q_layout, (self.tile_m, self.head_dim))
        tma_tq, tma_m_tq = cpasync.make_tiled_tma_atom(load_op, mTQ, q_layout, (self.tile_m, self.head_dim))
        tma_k, tma_m_k = cpasync.make_tiled_tma_atom(load_op, mK, k_tile_layout, (self.tile_n, self.head_dim))
        tma_tk, tma_m_tk = cpasync.make_tiled_tma_atom(load_op, mTK, k_tile_layout, (self.tile_n, self.head_dim))
        tma_v, tma_m_v = cpasync.make_tiled_tma_atom(load_op, mV, v_tile_layout, (self.tile_n, self.v_head_dim))
        tma_tv, tma_m_tv = cpasync.make_tiled_tma_atom(load_op, mTV, v_tile_layout, (self.tile_n, self.v_head_dim))
        # One barrier per stage counts the bytes of both tensors it holds.
        self.q_bytes = 2 * cute.size_in_bytes(self.dtype, q_layout)
        self.k_bytes = 2 * cute.size_in_bytes(self.dtype, k_tile_layout)
        self.v_bytes = 2 * cute.size_in_bytes(self.dtype, v_tile_layout)

        self.shared_storage = _shared_storage_struct(
            self.dtype, self.num_stages, cute.cosize(q_layout), cute.cosize(k_layout), cute.cosize(v_layout))

        num_m_blocks = (mQ.shape[0] + self.tile_m - 1) // self.tile_m
        units = tile_scheduler.work_units(num_m_blocks, mQ.shape[2], mQ.shape[3], self.options.mirrored_tiles)
        grid_size = cutlass.min(units, self.options.sm_count)

        self.kernel(
            tiled_mma_qk, tiled_mma_pv, tma_q, tma_m_q, tma_tq, tma_m_tq, tma_k, tma_m_k, tma_tk, tma_m_tk,
            tma_v, tma_m_v, tma_tv, tma_m_tv, mO, mLSE, mSinks, mTSinks, mQSegmentIds, mKVSegmentIds,
            mQSeqLengths, mKVSeqLengths, mQStart, mTO, mTLSE, q_layout, k_layout, v_layout,
        ).launch(grid=[grid_size, 1, 1], block=[self.threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    # ----------------------------------------------------------------------------------------------
    # Device side.
    @cute.kernel
    def kernel(self, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
               tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_tq: cute.CopyAtom, mTQ: cute.Tensor,
               tma_k: cute.CopyAtom, mK: cute.Tensor, tma_tk: cute.CopyAtom, mTK: cute.Tensor,
               tma_v: cute.CopyAtom, mV: cute.Tensor, tma_tv: cute.CopyAtom, mTV: cute.Tensor,
               mO: cute.Tensor, mLSE: cute.Tensor, mSinks: Optional[cute.Tensor], mTSinks: Optional[cute.Tensor],
               mQSegmentIds: Optional[cute.Tensor], mKVSegmentIds: Optional[cute.Tensor],
               mQSeqLengths: Optional[cute.Tensor], mKVSeqLengths: Optional[cute.Tensor],
               mQStart: Optional[cute.Tensor], mTO: cute.Tensor, mTLSE: cute.Tensor,
               q_layout: cute.ComposedLayout, k_layout: cute.ComposedLayout, v_layout: cute.ComposedLayout):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_q, tma_tq, tma_k, tma_tk, tma_v, tma_tv):
                cpasync.prefetch_descriptor(atom)

        storage = SmemAllocator().allocate(self.shared_storage)
        producer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        # Consumers release a stage once per warp (PipelineTmaAsync signals from one lane per warp).
        consumer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.consumer_threads // 32)
        pipeline_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.q_barriers.data_ptr(), num_stages=1, producer_group=producer_group,
            consumer_group=consumer_group, tx_count=self.q_bytes, defer_sync=True)
        pipeline_k = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.k_barriers.data_ptr(), num_stages=self.num_stages,
            producer_group=producer_group, consumer_group=consumer_group, tx_count=self.k_bytes,
            defer_sync=True)
        pipeline_v = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.v_barriers.data_ptr(), num_stages=self.num_stages,
            producer_group=producer_group, consumer_group=consumer_group, tx_count=self.v_bytes,
            defer_sync=True)
        cute.arch.mbarrier_init_fence()

        sQ = storage.s_q.get_tensor(q_layout.outer, swizzle=q_layout.inner)
        sTQ = storage.s_tq.get_tensor(q_layout.outer, swizzle=q_layout.inner)
        sK = storage.s_k.get_tensor(k_layout.outer, swizzle=k_layout.inner)
        sTK = storage.s_tk.get_tensor(k_layout.outer, swizzle=k_layout.inner)
        sV = storage.s_v.get_tensor(v_layout.outer, swizzle=v_layout.inner)
        sTV = storage.s_tv.get_tensor(v_layout.outer, swizzle=v_layout.inner)
        cute.arch.sync_threads()

        num_m_blocks = (mQ.shape[0] + self.tile_m - 1) // self.tile_m
        num_tiles = tile_scheduler.walked_tiles(num_m_blocks, mQ.shape[2], mQ.shape[3], self.options.mirrored_tiles)

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_registers)
            if warp_idx == 0:
                self.produce(tma_q, mQ, tma_tq, mTQ, tma_k, mK, tma_tk, mTK, tma_v, mV, tma_tv, mTV,
                             sQ, sTQ, sK, sTK, sV, sTV, pipeline_q, pipeline_k, pipeline_v,
                             mQSeqLengths, mKVSeqLengths, mQStart, num_m_blocks, num_tiles)
        else:
            cute.arch.setmaxregister_increase(self.consumer_registers)
            self.consume(tiled_mma_qk, tiled_mma_pv, mQ, mK, mO, mLSE, sQ, sTQ, sK, sTK, sV, sTV,
                         pipeline_q, pipeline_k, pipeline_v, mSinks, mTSinks, mQSegmentIds, mKVSegmentIds,
                         mQSeqLengths, mKVSeqLengths, mQStart, mTO, mTLSE, num_m_blocks, num_tiles)

    @cute.jit
    def tile_bounds(self, m_block: Int32, batch_index: Int32, q_len_static: Int32, kv_len_static: Int32,
                    mQSeqLengths: Optional[cute.Tensor], mKVSeqLengths: Optional[cute.Tensor],
                    mQStart: Optional[cute.Tensor]):
        """(row_start, q_len, kv_len, offset, first key block, end key block) of one tile."""
        return masking.tile_extents(self.mask, m_block, batch_index, self.tile_m, self.tile_n, q_len_static,
                                    kv_len_static, mQSeqLengths, mKVSeqLengths, mQStart, self.options.q_total)

    @cute.jit
    def produce(self, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_tq: cute.CopyAtom, mTQ: cute.Tensor,
                tma_k: cute.CopyAtom, mK: cute.Tensor, tma_tk: cute.CopyAtom, mTK: cute.Tensor,
                tma_v: cute.CopyAtom, mV: cute.Tensor, tma_tv: cute.CopyAtom, mTV: cute.Tensor,
                sQ: cute.Tensor, sTQ: cute.Tensor, sK: cute.Tensor, sTK: cute.Tensor, sV: cute.Tensor,
                sTV: cute.Tensor, pipeline_q, pipeline_k, pipeline_v,
                mQSeqLengths: Optional[cute.Tensor], mKVSeqLengths: Optional[cute.Tensor],
                mQStart: Optional[cute.Tensor], num_m_blocks: Int32, num_tiles: Int32):
        """Producer warp: TMA loads of (Q, t_Q) once per tile and of the visible key blocks' (K, t_K)
        and (V, t_V), first to last, in the order the consumers use them."""
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        tile = tile_scheduler.first_tile(cute.arch.block_idx()[0], self.options.mirrored_tiles)
        while tile < num_tiles:
            m_block, head, batch_index, _ = tile_scheduler.work_tile(
                tile, num_m_blocks, mQ.shape[2], mQ.shape[3], self.mask.causal, self.options.mirrored_tiles)
            head_kv = head // self.options.group
            _, _, _, _, first, end = self.tile_bounds(
                m_block, batch_index, mQ.shape[0], mK.shape[0], mQSeqLengths, mKVSeqLengths, mQStart)

            def partition(atom, tensor, shared, tile_shape, coordinate):
                g = cute.local_tile(tensor, tile_shape, coordinate)
                return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(shared, 0, 2),
                                             cute.group_modes(g, 0, 2))

            q_tile = (self.tile_m, self.head_dim)
            t_q_smem, t_q_gmem = partition(tma_q, mQ[None, None, head, batch_index], sQ, q_tile, (m_block, 0))
            t_tq_smem, t_tq_gmem = partition(tma_tq, mTQ[None, None, head, batch_index], sTQ, q_tile, (m_block, 0))
            k_tile = (self.tile_n, self.head_dim)
            t_k_smem, t_k_gmem = partition(tma_k, mK[None, None, head_kv, batch_index], sK, k_tile, (None, 0))
            t_tk_smem, t_tk_gmem = partition(tma_tk, mTK[None, None, head_kv, batch_index], sTK, k_tile, (None, 0))
            v_tile = (self.tile_n, self.v_head_dim)
            t_v_smem, t_v_gmem = partition(tma_v, mV[None, None, head_kv, batch_index], sV, v_tile, (None, 0))
            t_tv_smem, t_tv_gmem = partition(tma_tv, mTV[None, None, head_kv, batch_index], sTV, v_tile, (None, 0))

            pipeline_q.producer_acquire(q_state)
            q_barrier = pipeline_q.producer_get_barrier(q_state)
            cute.copy(tma_q, t_q_gmem, t_q_smem, tma_bar_ptr=q_barrier)
            cute.copy(tma_tq, t_tq_gmem, t_tq_smem, tma_bar_ptr=q_barrier)
            q_state = advanced(q_state)
            for n_block in cutlass.range(first, end, unroll=1):
                pipeline_k.producer_acquire(k_state)
                k_barrier = pipeline_k.producer_get_barrier(k_state)
                cute.copy(tma_k, t_k_gmem[None, n_block], t_k_smem[None, k_state.index], tma_bar_ptr=k_barrier)
                cute.copy(tma_tk, t_tk_gmem[None, n_block], t_tk_smem[None, k_state.index], tma_bar_ptr=k_barrier)
                k_state = advanced(k_state)
                pipeline_v.producer_acquire(v_state)
                v_barrier = pipeline_v.producer_get_barrier(v_state)
                cute.copy(tma_v, t_v_gmem[None, n_block], t_v_smem[None, v_state.index], tma_bar_ptr=v_barrier)
                cute.copy(tma_tv, t_tv_gmem[None, n_block], t_tv_smem[None, v_state.index], tma_bar_ptr=v_barrier)
                v_state = advanced(v_state)
            tile = tile_scheduler.next_tile(tile, cute.arch.grid_dim()[0], self.options.mirrored_tiles)

    @cute.jit
    def consume(self, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma, mQ: cute.Tensor,
                mK: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, sQ: cute.Tensor, sTQ: cute.Tensor,
                sK: cute.Tensor, sTK: cute.Tensor, sV: cute.Tensor, sTV: cute.Tensor,
                pipeline_q, pipeline_k, pipeline_v, mSinks: Optional[cute.Tensor], mTSinks: Optional[cute.Tensor],
                mQSegmentIds: Optional[cute.Tensor], mKVSegmentIds: Optional[cute.Tensor],
                mQSeqLengths: Optional[cute.Tensor], mKVSeqLengths: Optional[cute.Tensor],
                mQStart: Optional[cute.Tensor], mTO: cute.Tensor, mTLSE: cute.Tensor,
                num_m_blocks: Int32, num_tiles: Int32):
        """Consumer warpgroups: per key block S, t_S, P, P o t_S and t_O += P t_V + (P o t_S) V;
        then the epilogue t_O - t_lse o O."""
        tidx = cute.arch.thread_idx()[0] - wgmma.WARP_GROUP
        warpgroup_index = cute.arch.make_warp_uniform(tidx // wgmma.WARP_GROUP)
        thread_mma_qk = tiled_mma_qk.get_slice(tidx)
        thread_mma_pv = tiled_mma_pv.get_slice(tidx)
        warpgroup_mma_qk = tiled_mma_qk.get_slice(warpgroup_index * wgmma.WARP_GROUP)
        warpgroup_mma_pv = tiled_mma_pv.get_slice(warpgroup_index * wgmma.WARP_GROUP)

        # V^T views (Dv, tile_n, stages) of the K-major V and t_V buffers: the MN-major B operands.
        vt_layout = cute.make_ordered_layout((self.v_head_dim, self.tile_n, self.num_stages), order=(1, 0, 2))
        frag_q = warpgroup_mma_qk.make_fragment_A(warpgroup_mma_qk.partition_A(sQ))
        frag_tq = warpgroup_mma_qk.make_fragment_A(warpgroup_mma_qk.partition_A(sTQ))
        frag_k = warpgroup_mma_qk.make_fragment_B(warpgroup_mma_qk.partition_B(sK))
        frag_tk = warpgroup_mma_qk.make_fragment_B(warpgroup_mma_qk.partition_B(sTK))
        frag_vt = warpgroup_mma_pv.make_fragment_B(warpgroup_mma_pv.partition_B(cute.composition(sV, vt_layout)))
        frag_tvt = warpgroup_mma_pv.make_fragment_B(warpgroup_mma_pv.partition_B(cute.composition(sTV, vt_layout)))
        frag_p = warpgroup_mma_pv.make_fragment_A(warpgroup_mma_pv.partition_shape_A((self.tile_m, self.tile_n)))
        frag_pts = warpgroup_mma_pv.make_fragment_A(warpgroup_mma_pv.partition_shape_A((self.tile_m, self.tile_n)))
        acc_o = cute.make_rmem_tensor(warpgroup_mma_pv.partition_shape_C((self.tile_m, self.v_head_dim)), Float32)
        acc_o_mn = wgmma.accumulator_mn(acc_o)

        coords_s = wgmma.accumulator_mn(thread_mma_qk.partition_C(
            cute.make_identity_tensor((self.tile_m, self.tile_n))))
        coords_o = wgmma.accumulator_mn(thread_mma_pv.partition_C(
            cute.make_identity_tensor((self.tile_m, self.v_head_dim))))
        num_rows = cute.size(acc_o_mn, mode=[0])
        lse_rows = cute.make_rmem_tensor(num_rows, Float32)
        t_lse_rows = cute.make_rmem_tensor(num_rows, Float32)

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        tile = tile_scheduler.first_tile(cute.arch.block_idx()[0], self.options.mirrored_tiles)
        while tile < num_tiles:
            m_block, head, batch_index, _ = tile_scheduler.work_tile(
                tile, num_m_blocks, mQ.shape[2], mQ.shape[3], self.mask.causal, self.options.mirrored_tiles)
            row_start, q_len, kv_len, offset, first, end = self.tile_bounds(
                m_block, batch_index, mQ.shape[0], mK.shape[0], mQSeqLengths, mKVSeqLengths, mQStart)
            local_row_start = m_block * self.tile_m
            # The LSE (exp2 domain, +inf where nothing is visible) is padded to whole tiles: no bounds test.
            for r in cutlass.range_constexpr(num_rows):
                lse_rows[r] = mLSE[local_row_start + coords_s[r, 0][0], head, batch_index]
            t_lse_rows.fill(0.0)
            acc_o.fill(0.0)
            pipeline_q.consumer_wait(q_state)
            for n_block in cutlass.range(first, end, unroll=1):
                k_state, v_state = self.key_block(
                    n_block, tiled_mma_qk, tiled_mma_pv, frag_q, frag_tq, frag_k, frag_tk, frag_vt, frag_tvt,
                    frag_p, frag_pts, acc_o, coords_s, lse_rows, t_lse_rows, pipeline_k, pipeline_v, k_state,
                    v_state, row_start, local_row_start, kv_len, q_len, offset, mQSegmentIds, mKVSegmentIds,
                    batch_index)
            pipeline_q.consumer_release(q_state)
            q_state = advanced(q_state)
            self.epilogue(acc_o_mn, coords_o, lse_rows, t_lse_rows, mO, mTO, mTLSE, mSinks, mTSinks,
                          thread_mma_pv, m_block, head, batch_index)
            tile = tile_scheduler.next_tile(tile, cute.arch.grid_dim()[0], self.options.mirrored_tiles)

    @cute.jit
    def key_block(self, n_block: Int32, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
                  frag_q: cute.Tensor, frag_tq: cute.Tensor, frag_k: cute.Tensor, frag_tk: cute.Tensor,
                  frag_vt: cute.Tensor, frag_tvt: cute.Tensor, frag_p: cute.Tensor, frag_pts: cute.Tensor,
                  acc_o: cute.Tensor, coords_s: cute.Tensor, lse_rows: cute.Tensor, t_lse_rows: cute.Tensor,
                  pipeline_k, pipeline_v, k_state, v_state, row_start: Int32, local_row_start: Int32,
                  kv_len: Int32, q_len: Int32, offset: Int32, mQSegmentIds: Optional[cute.Tensor],
                  mKVSegmentIds: Optional[cute.Tensor], batch_index: Int32):
        """One key block's contribution to t_O and t_lse. Returns the advanced (k_state, v_state)."""
        acc_shape = tiled_mma_qk.get_slice(0).partition_shape_C((self.tile_m, self.tile_n))
        acc_s = cute.make_rmem_tensor(acc_shape, Float32)
        acc_ts = cute.make_rmem_tensor(acc_shape, Float32)
        pipeline_k.consumer_wait(k_state)
        warpgroup.fence()
        wgmma.gemm(tiled_mma_qk, acc_s, frag_q, frag_k[None, None, None, k_state.index], True)
        wgmma.gemm(tiled_mma_qk, acc_ts, frag_tq, frag_k[None, None, None, k_state.index], True)
        wgmma.gemm(tiled_mma_qk, acc_ts, frag_q, frag_tk[None, None, None, k_state.index], False)
        warpgroup.commit_group()
        warpgroup.wait_group(0)
        pipeline_k.consumer_release(k_state)

        scores = wgmma.accumulator_mn(acc_s)
        t_scores = wgmma.accumulator_mn(acc_ts)
        self.numerics.probabilities(acc_s, scores, coords_s, lse_rows, n_block, row_start, local_row_start,
                                    n_block * self.tile_n, kv_len, q_len, offset, mQSegmentIds, mKVSegmentIds,
                                    batch_index)
        for r in cutlass.range_constexpr(cute.size(scores, mode=[0])):
            row_total = Float32(0.0)
            for c in cutlass.range_constexpr(cute.size(scores, mode=[1])):
                slope = self.options.scale
                if cutlass.const_expr(self.options.softcap is not None):
                    slope = slope * self.numerics.softcap_slope(scores[r, c], lse_rows[r])
                weighted = scores[r, c] * (t_scores[r, c] * slope)
                t_scores[r, c] = weighted
                row_total += weighted
            t_lse_rows[r] = t_lse_rows[r] + row_total
        frag_p.store(wgmma.accumulator_as_operand_a(acc_s).load().to(self.dtype))
        frag_pts.store(wgmma.accumulator_as_operand_a(acc_ts).load().to(self.dtype))

        pipeline_v.consumer_wait(v_state)
        warpgroup.fence()
        wgmma.gemm(tiled_mma_pv, acc_o, frag_p, frag_tvt[None, None, None, v_state.index], False)
        wgmma.gemm(tiled_mma_pv, acc_o, frag_pts, frag_vt[None, None, None, v_state.index], False)
        warpgroup.commit_group()
        warpgroup.wait_group(0)
        pipeline_v.consumer_release(v_state)
        return advanced(k_state), advanced(v_state)

    @cute.jit
    def epilogue(self, acc_o_mn: cute.Tensor, coords_o: cute.Tensor, lse_rows: cute.Tensor,
                 t_lse_rows: cute.Tensor, mO: cute.Tensor, mTO: cute.Tensor, mTLSE: cute.Tensor,
                 mSinks: Optional[cute.Tensor], mTSinks: Optional[cute.Tensor], thread_mma_pv,
                 m_block: Int32, head: Int32, batch_index: Int32):
        """t_lse = rowsum(P o t_S) (+ P_sink t_sink) and t_O = acc - t_lse o O, written for the rows
        below Sq (t_lse from the one lane of each quad that holds column 0)."""
        for r in cutlass.range_constexpr(cute.size(t_lse_rows)):
            total = cute.arch.warp_reduction_sum(t_lse_rows[r], threads_in_group=4)
            if cutlass.const_expr(mSinks is not None):
                # P_sink = exp(sink - lse); lse_rows is +inf (P_sink = 0) on rows with no mass at all.
                sink_probability = cute.math.exp2(Float32(mSinks[head]) * host.LOG2_E - lse_rows[r],
                                                  fastmath=True)
                total = total + sink_probability * Float32(mTSinks[head])
            t_lse_rows[r] = total
        rows_left = mO.shape[0] - m_block * self.tile_m
        g_o = cute.local_tile(mO[None, None, head, batch_index], (self.tile_m, self.v_head_dim), (m_block, 0))
        g_to = cute.local_tile(mTO[None, None, head, batch_index], (self.tile_m, self.v_head_dim), (m_block, 0))
        t_g_o = wgmma.accumulator_mn(thread_mma_pv.partition_C(g_o))
        t_g_to = wgmma.accumulator_mn(thread_mma_pv.partition_C(g_to))
        for r in cutlass.range_constexpr(cute.size(acc_o_mn, mode=[0])):
            if coords_o[r, 0][0] < rows_left:
                for c in cutlass.range_constexpr(cute.size(acc_o_mn, mode=[1])):
                    value = acc_o_mn[r, c] - t_lse_rows[r] * Float32(t_g_o[r, c])
                    t_g_to[r, c] = value.to(self.dtype)
        if coords_o[0, 0][1] == 0:
            g_tlse = mTLSE[None, head, batch_index]
            for r in cutlass.range_constexpr(cute.size(t_lse_rows)):
                if coords_o[r, 0][0] < rows_left:
                    g_tlse[m_block * self.tile_m + coords_o[r, 0][0]] = t_lse_rows[r]


# --------------------------------------------------------------------------------------------------
# The kernel module's face (what fa4_jax/lowering/cuda.py calls).

def unsupported_reason(config: AttentionConfig, problem: host.Problem) -> Optional[str]:
    """None when this kernel computes the tangent of `config` exactly; otherwise what it cannot take."""
    reason = host.kernel_unsupported_reason("sm90 tangent", config, problem, SUPPORTED_HEAD_DIMS)
    if reason is not None:
        return reason
    return host.q_start_unsupported_reason("sm90 tangent", config)


def options(config: AttentionConfig, problem: host.Problem, sm_count: Optional[int] = None) -> TangentOptions:
    """The static kernel configuration for one call; also what the compile tests build."""
    return TangentOptions(
        dtype_name=problem.dtype,
        head_dim=problem.head_dim,
        v_head_dim=problem.v_head_dim,
        group=problem.group,
        scale=float(config.scale),
        mask=masking.MaskShape.from_config(config),
        softcap=None if config.softcap is None else float(config.softcap),
        has_sinks=config.has_sinks,
        has_q_lengths=config.has_q_seq_lengths,
        has_kv_lengths=config.has_kv_seq_lengths,
        has_q_start=config.has_q_start,
        q_total=config.q_total if config.has_q_start else None,
        sm_count=host.sm_count(DEFAULT_SM_COUNT) if sm_count is None else sm_count,
        mirrored_tiles=config.causal and tile_scheduler.mirrors_whole_units(
            problem.q_len, ROWS_PER_WARPGROUP * CONSUMER_WARPGROUPS),
    )


@functools.lru_cache(maxsize=None)
def _kernel(options: TangentOptions) -> Sm90TangentKernel:
    return Sm90TangentKernel(options)


def run(options: TangentOptions, query, key, value, out, lse, t_query, t_key, t_value, t_sinks, optional: dict):
    """(t_out [B, Sq, Hq, Dv] in the query dtype, t_lse [B, Hq, Sq] float32), traceable under jax.jit."""
    return host.launch_tangent(_kernel(options), options, query, key, value, out, lse, t_query, t_key, t_value,
                               t_sinks, optional)
