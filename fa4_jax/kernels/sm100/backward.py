"""Blackwell (sm_100a) attention backward: dQ, dK, dV with 2-CTA tcgen05 MMAs, in CuTe DSL.

One CTA pair (cluster 2x1) owns a key block of 2 x 128 keys of one KV head: CTA `rank` holds keys
[pair * 256 + rank * 128, + 128) of K and V in shared memory and their dK, dV accumulators in tensor
memory for the whole walk over the query blocks (128 rows) of every query head of the group (GQA: dK,
dV summed over the group by accumulation). Every tcgen05 instruction of the kernel is cta_group::2
(PTX allows no mix of cta_group::1 and ::2 in one kernel): the pair's MMA warp of the leader CTA
(rank 0) issues one MMA over both CTAs, each CTA supplying half of each operand from its own shared
memory, so each CTA loads and the tensor cores read half of the B operands:

  S^T  = K Q^T      M = 256 keys (each CTA its 128), N = 128 queries (each CTA loads 64 rows of Q)
  dP^T = V dO^T     likewise with V and dO
  dV  += P^T dO     A = P^T from TMEM (over S^T), B = dO as (d, queries): each CTA loads d / 2 columns
  dK  += dS^T Q     A = dS^T from TMEM (over dP^T), B = Q as (d, queries), d / 2 columns per CTA
  dQ   = dS K       M = 128 queries (each CTA 64), K = the pair's 256 keys: each CTA's A operand
                    (its 64 queries x 256 keys of dS) takes half its keys from the peer CTA, which
                    writes them into it through distributed shared memory; B = K as (d, keys), d / 2
                    columns per CTA. dQ (fp32) is added into the global accumulator with atomics
                    (half the atomics of one CTA per 128 keys: a pair adds once per 256 keys).

Warp roles (per CTA; the MMA warp issues only in the leader):
  warps 0-3   compute warpgroup: S^T, dP^T rows from TMEM (one key per thread), P from the stored
              LSE, dS = P (dP - dPsum) (the shared numerics of `common/backward_numerics.py`, which
              the sm90 backward runs on the H200), P^T and dS^T into TMEM, dS into the two CTAs'
              dQ operand buffers; at the end dK, dV from TMEM to global memory
  warps 4-7   dQ warpgroup: dQ from TMEM, atomic adds into the fp32 accumulator
  warp 8      MMA warp (leader CTA): every tcgen05.mma, signalled with multicast tcgen05.commit
  warp 9      load warp: TMA of this CTA's halves (K, V, K^T once; Q, dO in two forms per block)
  warps 10-11 idle (the register split is per warpgroup)

Tensor memory per CTA (512 columns x 128 lanes): S^T [0, 128) with P^T packed over its first half;
dP^T [128, 256) with dS^T over its first half, then dQ over the same columns (issued after dK, which
reads dS^T: tcgen05 runs in issue order); dV [256, 256 + d); dK [256 + d, 256 + 2 d). Hence head dims
up to 128 (192 / 256 would need 2 d + 256 > 512 columns; they fall back with a reason).

Shared memory holds one stage of Q / dO (in both forms): at D = 128 K, V, K^T, the stage and the dS
operand take 195 KiB, so the next block's loads wait for the current block's last MMA (two stages
would fit at D <= 96; not done yet). deterministic=True orders the dQ atomics by the turns of
`common/ordered_reduction.py` (pairs launched highest first, CTA 0 then CTA 1 of a pair).

The barrier protocol is stated once, in backward_schedule.py (the vocabulary of
common/pipeline_schedule.py, as the forward's forward_schedule.py): the kernel initialises its
mbarriers with the counts there, takes its TMA byte counts and every wait's phase from it, and checks
each role's waits, arrives and commits against the programs of both CTAs' copies of the role while it
is traced (`self.protocol`); tests/test_sm100_protocol.py replays it for both CTAs of a pair, and for
several pairs with the deterministic turns (deadlock, phase aliasing, arrival counts, buffer hazards,
arrivals landing after the pair exits), with planted bugs it catches.

No Blackwell GPU was available while writing it: it is compiled for sm_100a and inspected
(tests/test_kernel_compile_sm100_backward.py), not run.
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
from cutlass._mlir.dialects import nvvm
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.memory import SmemAllocator, TmemAllocator
from cutlass.tensor_utils import LayoutEnum

from fa4_jax.config import AttentionConfig
from fa4_jax.kernels import host
from fa4_jax.kernels.common import backward_numerics, masking, ordered_reduction, pipeline_schedule
from fa4_jax.kernels.common.pipeline_schedule import (
    ACQUIRE, ARRIVE, CONSUMER_WAIT, DRAIN, EXPECT_TX, FLIP, MMA_COMMIT, RELEASE, TURN_PASS, TURN_WAIT, WAIT)
from fa4_jax.kernels.sm100 import backward_schedule
from fa4_jax.kernels.sm100.backward_schedule import both, leader, own

SUPPORTED_HEAD_DIMS = (64, 96, 128)
THREADS_PER_WARP = 32
ROWS = backward_schedule.ROWS   # keys per CTA, query rows per block, TMEM lanes
PAIR_KEYS = 2 * ROWS            # keys per CTA pair
TMEM_COLUMNS = 512
SLICE = 32                      # columns per TMEM load in the compute warpgroup


# The kernel's mbarrier array (each CTA has all of them; both initialise them alike): the schedule's
# barriers by their name in one CTA, and each pipeline's full and empty barrier.
BARRIER_ARRAY = ("kv_full", "load_q.full", "load_q.empty", "s_full", "dp_full", "ds_ready", "dq_full",
                 "dq_empty", "dkv_full")


def barrier_counts(schedule: pipeline_schedule.Schedule) -> tuple:
    """The arrival count of each barrier of BARRIER_ARRAY, from the schedule (which names a barrier
    once per CTA that uses it: they must agree)."""
    counts = {}
    for barrier in schedule.barriers:
        local = barrier.name.split(".", 1)[1]
        assert barrier.stages == 1 and counts.setdefault(local, barrier.arrivals) == barrier.arrivals, barrier
    for description in schedule.pipelines:
        # The kernel's shared memory holds one stage of Q / dO (and its phases are one per block).
        assert description.stages == 1, description
        counts[description.name + ".full"] = description.producer_arrivals
        counts[description.name + ".empty"] = description.consumer_arrivals
    assert sorted(counts) == sorted(BARRIER_ARRAY), sorted(counts)
    return tuple(counts[name] for name in BARRIER_ARRAY)


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """Everything static about one compiled kernel (hashable: it is the compile key)."""

    dtype_name: str            # "bfloat16" | "float16"
    head_dim: int
    group: int                 # query heads per key/value head
    scale: float
    mask: masking.MaskShape
    softcap: Optional[float] = None
    has_kv_lengths: bool = False
    has_sinks: bool = False
    deterministic: bool = False
    # Read by host.run_backward, shared with the sm90 kernels: a CTA pair computes whole dK / dV (no
    # head splits).
    head_splits: int = 1


class Sm100BackwardKernel:
    """The 2-CTA backward kernel for one static configuration (`KernelOptions`)."""

    def __str__(self):
        # The DSL names the compiled kernel after str(self): a fixed name, so profiles show it.
        return "fa4_jax_sm100_backward"

    compute_warp_ids = (0, 1, 2, 3)
    dq_warp_ids = (4, 5, 6, 7)
    mma_warp_id = 8
    load_warp_id = 9
    threads_per_cta = 12 * THREADS_PER_WARP

    # setmaxnreg budget: 128 x (240 + 160 + 112) = 64 Ki registers. Every role changes its count (ptxas
    # launches 384 threads at 168), none to the launch value itself.
    registers_compute = 240
    registers_dq = 160
    registers_other = 112

    def __init__(self, options: KernelOptions):
        if options.head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"head_dim {options.head_dim} not in {SUPPORTED_HEAD_DIMS}")
        self.options = options
        self.head_dim = options.head_dim
        self.dtype = host.cutlass_dtype(options.dtype_name)
        self.mask = options.mask
        self.numerics = backward_numerics.BackwardNumerics(
            mask=options.mask, softcap=options.softcap, scale=options.scale, tile_m=ROWS, tile_n=PAIR_KEYS)
        d = self.head_dim
        self.s_tiler = (PAIR_KEYS, ROWS, d)          # S^T, dP^T: (keys, queries, d)
        self.dkv_tiler = (PAIR_KEYS, d, ROWS)        # dV, dK: (keys, d, queries)
        self.dq_tiler = (ROWS, d, PAIR_KEYS)         # dQ: (queries, d, keys)
        self.tmem_s = 0
        self.tmem_dp = ROWS
        self.tmem_dq = ROWS
        self.tmem_dv = 2 * ROWS
        self.tmem_dk = 2 * ROWS + d
        self.tmem_columns_used = 2 * ROWS + 2 * d
        assert self.tmem_columns_used <= TMEM_COLUMNS
        self.tmem_columns_allocated = TMEM_COLUMNS
        self.tmem_users = THREADS_PER_WARP * (len(self.compute_warp_ids) + len(self.dq_warp_ids) + 1)
        # Both CTAs' copies complete on the leader's barriers: it expects the pair's bytes.
        self.key_bytes, self.query_bytes = backward_schedule.pair_bytes(d, self.dtype.width // 8)
        self.schedule = backward_schedule.backward_schedule(self.key_bytes, self.query_bytes,
                                                            options.deterministic)
        assert self.schedule.pipeline("load_q").tx_bytes == self.query_bytes
        self.barrier_counts = barrier_counts(self.schedule)
        # Which phase variables of each role flip once per query block (the others never): `parity`.
        self.block_phases = {role.kernel_role: backward_schedule.block_phases(role)
                             for role in self.schedule.roles}
        self.protocol = pipeline_schedule.ProtocolTrace(self.schedule)

    # --------------------------------------------------------------------------------------------
    # Host side
    # --------------------------------------------------------------------------------------------
    @cute.jit
    def __call__(self, stream: cuda.CUstream, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
                 mdO: cute.Tensor, mLSE: cute.Tensor, mdPsum: cute.Tensor,
                 mQSegmentIds: Optional[cute.Tensor], mKVSegmentIds: Optional[cute.Tensor],
                 mQSeqLengths: Optional[cute.Tensor], mKVSeqLengths: Optional[cute.Tensor],
                 mQStart: Optional[cute.Tensor], mdQacc: cute.Tensor, mSemaphores: Optional[cute.Tensor],
                 mdK: cute.Tensor, mdV: cute.Tensor):
        batch, seqlen_q, num_q_heads, d = mQ.shape
        seqlen_k = mK.shape[1]
        num_kv_heads = mK.shape[2]

        def rows_major(t, heads):       # (rows, d, (heads, batch)): d contiguous (K-major operand)
            return cute.make_tensor(t.iterator, cute.make_layout(
                (t.shape[1], d, (heads, batch)), stride=(t.stride[1], 1, (t.stride[2], t.stride[0]))))

        def columns_major(t, heads):    # (d, rows, (heads, batch)): the same memory, MN-major operand
            return cute.make_tensor(t.iterator, cute.make_layout(
                (d, t.shape[1], (heads, batch)), stride=(1, t.stride[1], (t.stride[2], t.stride[0]))))

        q, do = rows_major(mQ, num_q_heads), rows_major(mdO, num_q_heads)
        q_t, do_t = columns_major(mQ, num_q_heads), columns_major(mdO, num_q_heads)
        k, v = rows_major(mK, num_kv_heads), rows_major(mV, num_kv_heads)
        k_t = columns_major(mK, num_kv_heads)

        cta_group = tcgen05.CtaGroup.TWO
        K, MN = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        s_mma = sm100_utils.make_trivial_tiled_mma(self.dtype, self.dtype, K, K, Float32, cta_group,
                                                   self.s_tiler[:2])
        dkv_mma = sm100_utils.make_trivial_tiled_mma(self.dtype, self.dtype, K, MN, Float32, cta_group,
                                                     self.dkv_tiler[:2], tcgen05.OperandSource.TMEM)
        dq_mma = sm100_utils.make_trivial_tiled_mma(self.dtype, self.dtype, MN, MN, Float32, cta_group,
                                                    self.dq_tiler[:2])

        k_layout = sm100_utils.make_smem_layout_a(s_mma, self.s_tiler, self.dtype, 1)
        q_rows_layout = sm100_utils.make_smem_layout_b(s_mma, self.s_tiler, self.dtype, 1)
        q_columns_layout = sm100_utils.make_smem_layout_b(dkv_mma, self.dkv_tiler, self.dtype, 1)
        k_columns_layout = sm100_utils.make_smem_layout_b(dq_mma, self.dq_tiler, self.dtype, 1)
        ds_layout = sm100_utils.make_smem_layout_a(dq_mma, self.dq_tiler, self.dtype, 1)
        p_tmem_layout = sm100_utils.make_smem_layout_a(dkv_mma, self.dkv_tiler, self.dtype, 1)

        cluster_layout_vmnk = cute.tiled_divide(cute.make_layout((2, 1, 1)), (s_mma.thr_id.shape,))
        load_op = cpasync.CopyBulkTensorTileG2SOp(cta_group)
        one = lambda layout: cute.select(layout, mode=[0, 1, 2])  # noqa: E731
        cluster = cluster_layout_vmnk.shape
        tma_atom_k, tma_k = cute.nvgpu.make_tiled_tma_atom_A(load_op, k, one(k_layout), self.s_tiler, s_mma,
                                                             cluster)
        tma_atom_v, tma_v = cute.nvgpu.make_tiled_tma_atom_A(load_op, v, one(k_layout), self.s_tiler, s_mma,
                                                             cluster)
        tma_atom_q, tma_q = cute.nvgpu.make_tiled_tma_atom_B(load_op, q, one(q_rows_layout), self.s_tiler,
                                                             s_mma, cluster)
        tma_atom_do, tma_do = cute.nvgpu.make_tiled_tma_atom_B(load_op, do, one(q_rows_layout), self.s_tiler,
                                                               s_mma, cluster)
        tma_atom_qt, tma_qt = cute.nvgpu.make_tiled_tma_atom_B(load_op, q_t, one(q_columns_layout),
                                                               self.dkv_tiler, dkv_mma, cluster)
        tma_atom_dot, tma_dot = cute.nvgpu.make_tiled_tma_atom_B(load_op, do_t, one(q_columns_layout),
                                                                 self.dkv_tiler, dkv_mma, cluster)
        tma_atom_kt, tma_kt = cute.nvgpu.make_tiled_tma_atom_B(load_op, k_t, one(k_columns_layout),
                                                               self.dq_tiler, dq_mma, cluster)
        # The schedule's byte counts (backward_schedule.pair_bytes) are what the pair's copies move.
        assert self.key_bytes == 2 * (2 * cute.size_in_bytes(self.dtype, one(k_layout))
                                      + cute.size_in_bytes(self.dtype, one(k_columns_layout)))
        assert self.query_bytes == 2 * 2 * (cute.size_in_bytes(self.dtype, one(q_rows_layout))
                                            + cute.size_in_bytes(self.dtype, one(q_columns_layout)))

        align = 1024

        @cute.struct
        class SharedStorage:
            barriers: cute.struct.MemRange[Int64, len(BARRIER_ARRAY)]
            tmem_dealloc_barrier: Int64
            tmem_address: Int32
            row_stats: cute.struct.MemRange[Float32, 2 * 2 * ROWS]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(k_layout)], align]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(k_layout)], align]
            sKt: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(k_columns_layout)], align]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(q_rows_layout)], align]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(q_rows_layout)], align]
            sQt: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(q_columns_layout)], align]
            sdOt: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(q_columns_layout)], align]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(ds_layout)], align]

        self.shared_storage = SharedStorage
        num_pairs = (seqlen_k + PAIR_KEYS - 1) // PAIR_KEYS
        self.kernel(
            s_mma, dkv_mma, dq_mma,
            tma_atom_k, tma_k, tma_atom_v, tma_v, tma_atom_kt, tma_kt,
            tma_atom_q, tma_q, tma_atom_do, tma_do, tma_atom_qt, tma_qt, tma_atom_dot, tma_dot,
            mLSE, mdPsum, mQSegmentIds, mKVSegmentIds, mQSeqLengths, mKVSeqLengths, mdQacc, mSemaphores,
            mdK, mdV,
            k_layout, q_rows_layout, q_columns_layout, k_columns_layout, ds_layout, p_tmem_layout,
            Int32(seqlen_q), Int32(seqlen_k),
        ).launch(grid=[2 * num_pairs, num_kv_heads, batch], block=[self.threads_per_cta, 1, 1],
                 cluster=[2, 1, 1], stream=stream, min_blocks_per_mp=1)

    # --------------------------------------------------------------------------------------------
    # Device side
    # --------------------------------------------------------------------------------------------
    @cute.kernel
    def kernel(self, s_mma: cute.TiledMma, dkv_mma: cute.TiledMma, dq_mma: cute.TiledMma,
               tma_atom_k: cute.CopyAtom, tma_k: cute.Tensor, tma_atom_v: cute.CopyAtom, tma_v: cute.Tensor,
               tma_atom_kt: cute.CopyAtom, tma_kt: cute.Tensor,
               tma_atom_q: cute.CopyAtom, tma_q: cute.Tensor, tma_atom_do: cute.CopyAtom, tma_do: cute.Tensor,
               tma_atom_qt: cute.CopyAtom, tma_qt: cute.Tensor, tma_atom_dot: cute.CopyAtom,
               tma_dot: cute.Tensor,
               mLSE: cute.Tensor, mdPsum: cute.Tensor, mQSegmentIds: Optional[cute.Tensor],
               mKVSegmentIds: Optional[cute.Tensor], mQSeqLengths: Optional[cute.Tensor],
               mKVSeqLengths: Optional[cute.Tensor], mdQacc: cute.Tensor, mSemaphores: Optional[cute.Tensor],
               mdK: cute.Tensor, mdV: cute.Tensor, k_layout: cute.ComposedLayout, q_rows_layout: cute.ComposedLayout,
               q_columns_layout: cute.ComposedLayout, k_columns_layout: cute.ComposedLayout,
               ds_layout: cute.ComposedLayout, p_tmem_layout: cute.ComposedLayout,
               seqlen_q: Int32, seqlen_k: Int32):
        self.protocol.start()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        pair = cute.arch.block_idx()[0] // 2
        if const_expr(self.options.deterministic):
            pair = cute.arch.grid_dim()[0] // 2 - 1 - pair      # launched in dQ turn order
        kv_head = cute.arch.block_idx()[1]
        batch = cute.arch.block_idx()[2]
        if warp_idx == self.load_warp_id:
            for atom in (tma_atom_k, tma_atom_v, tma_atom_kt, tma_atom_q, tma_atom_do, tma_atom_qt,
                         tma_atom_dot):
                cpasync.prefetch_descriptor(atom)

        storage = SmemAllocator().allocate(self.shared_storage)
        barriers = storage.barriers.data_ptr()
        if warp_idx == self.mma_warp_id:
            with cute.arch.elect_one():
                for index, count in enumerate(self.barrier_counts):
                    cute.arch.mbarrier_init(barriers + index, count)
        tmem_allocator = TmemAllocator(
            storage.tmem_address.ptr,
            barrier_for_retrieve=pipeline.NamedBarrier(barrier_id=1, num_threads=self.tmem_users),
            allocator_warp_id=self.compute_warp_ids[0], is_two_cta=True,
            two_cta_tmem_dealloc_mbar_ptr=storage.tmem_dealloc_barrier.ptr)
        # Every barrier is initialised in both CTAs before either signals the other's.
        cute.arch.mbarrier_init_fence()
        cute.arch.cluster_arrive_relaxed()
        cute.arch.cluster_wait()

        sK = storage.sK.get_tensor(k_layout.outer, swizzle=k_layout.inner)
        sV = storage.sV.get_tensor(k_layout.outer, swizzle=k_layout.inner)
        sKt = storage.sKt.get_tensor(k_columns_layout.outer, swizzle=k_columns_layout.inner)
        sQ = storage.sQ.get_tensor(q_rows_layout.outer, swizzle=q_rows_layout.inner)
        sdO = storage.sdO.get_tensor(q_rows_layout.outer, swizzle=q_rows_layout.inner)
        sQt = storage.sQt.get_tensor(q_columns_layout.outer, swizzle=q_columns_layout.inner)
        sdOt = storage.sdOt.get_tensor(q_columns_layout.outer, swizzle=q_columns_layout.inner)
        sdS = storage.sdS.get_tensor(ds_layout.outer, swizzle=ds_layout.inner)
        row_stats = storage.row_stats.get_tensor(cute.make_layout((ROWS, 2, 2)))

        # The walk: every query head of the group, each over the query blocks the pair's keys see.
        q_len, kv_len, offset = masking.batch_extents(
            batch, seqlen_q, seqlen_k, mQSeqLengths if const_expr(self.mask.has_q_lengths) else None,
            mKVSeqLengths if const_expr(self.options.has_kv_lengths) else None)
        num_m_blocks = (seqlen_q + ROWS - 1) // ROWS
        m_lo, m_hi = masking.query_block_range(self.mask, pair, ROWS, PAIR_KEYS, kv_len, offset, num_m_blocks)
        walk = (m_lo, cutlass.max(m_hi - m_lo, 0), kv_head, batch)

        if warp_idx == self.load_warp_id:
            cute.arch.setmaxregister_decrease(self.registers_other)
            self.load_role(s_mma, dkv_mma, dq_mma, rank, pair, walk, barriers,
                           tma_atom_k, tma_k, tma_atom_v, tma_v, tma_atom_kt, tma_kt,
                           tma_atom_q, tma_q, tma_atom_do, tma_do, tma_atom_qt, tma_qt, tma_atom_dot, tma_dot,
                           sK, sV, sKt, sQ, sdO, sQt, sdOt)
        if warp_idx == self.mma_warp_id:
            cute.arch.setmaxregister_decrease(self.registers_other)
            tmem_allocator.wait_for_alloc()
            tmem = tmem_allocator.retrieve_ptr(Float32)
            if rank == 0:
                self.mma_role(s_mma, dkv_mma, dq_mma, walk, barriers, tmem, p_tmem_layout,
                              sK, sV, sKt, sQ, sdO, sQt, sdOt, sdS)
        if warp_idx == self.mma_warp_id + 2 or warp_idx == self.mma_warp_id + 3:
            cute.arch.setmaxregister_decrease(self.registers_other)
        if warp_idx >= self.dq_warp_ids[0] and warp_idx < self.mma_warp_id:
            cute.arch.setmaxregister_decrease(self.registers_dq)
            tmem_allocator.wait_for_alloc()
            tmem = tmem_allocator.retrieve_ptr(Float32)
            self.dq_role(dq_mma, rank, pair, walk, barriers, tmem, mdQacc, mSemaphores, kv_len, offset)
            pipeline.NamedBarrier(barrier_id=3, num_threads=8 * THREADS_PER_WARP).arrive()
        if warp_idx < self.dq_warp_ids[0]:
            cute.arch.setmaxregister_increase(self.registers_compute)
            tmem_allocator.allocate(self.tmem_columns_allocated)
            tmem_allocator.wait_for_alloc()
            tmem = tmem_allocator.retrieve_ptr(Float32)
            self.compute_role(s_mma, dq_mma, rank, pair, walk, barriers, tmem, sdS, row_stats, mLSE, mdPsum, mQSegmentIds,
                              mKVSegmentIds, q_len, kv_len, offset, mdK, mdV)
            # The dQ warpgroup reads TMEM until its last block: free it once both groups are done.
            pipeline.NamedBarrier(barrier_id=3, num_threads=8 * THREADS_PER_WARP).arrive_and_wait()
            tmem_allocator.relinquish_alloc_permit()
            tmem_allocator.free(tmem, self.tmem_columns_allocated)
        # Neither CTA leaves while the other may still write its shared memory or barriers.
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
        self.protocol.check_finished()

    # --------------------------------------------------------------------------------------------
    # Protocol helpers: every synchronisation step of a role goes through one of these, which reports
    # it to `self.protocol` (checked against the schedule's programs of both CTAs' copies of the role)
    # and issues it. Barriers are named as in BARRIER_ARRAY; `role` is the kernel's role name.
    # --------------------------------------------------------------------------------------------
    def barrier(self, barriers, name: str):
        return barriers + BARRIER_ARRAY.index(name)

    def parity(self, role: str, phase: str, flips, initial: Optional[int] = None):
        """The phase a wait of `role` uses: its phase variable `phase` (as the schedule names it, with
        the schedule's initial value, or a pipeline participant's `initial`) after `flips` flips. A
        backward role flips each phase once per query block or never (`block_phases`), so in block
        `it` of the walk a flipped phase is its initial value flipped `it` times: `flips` is `it`
        (the walk's length after the loop), or None for a phase never flipped."""
        if initial is None:
            initial = self.schedule.role("cta0." + role).initial_phase(phase)
            assert self.block_phases[role][phase] == (flips is not None), (role, phase)
        if flips is None:
            return initial
        if initial == 1:
            return (flips & 1) ^ 1
        return flips & 1

    def flip(self, role: str, phase: str):
        """The end of a query block for `role`'s phase variable `phase`: no code, since `parity`
        computes its value from the block count."""
        self.protocol.expect(role, FLIP, phase)

    @cute.jit
    def wait(self, role: cutlass.Constexpr, barriers, name: cutlass.Constexpr, phase: cutlass.Constexpr,
             flips):
        """Wait on this CTA's barrier `name` with `role`'s phase variable `phase` (see `parity`)."""
        self.protocol.expect(role, WAIT, own(name), 0)
        cute.arch.mbarrier_wait(self.barrier(barriers, name), self.parity(role, phase, flips))

    @cute.jit
    def expect_pair_bytes(self, role: cutlass.Constexpr, barriers, name: cutlass.Constexpr,
                          tx_bytes: cutlass.Constexpr, rank):
        """The leader arrives on its `name` expecting both CTAs' TMA bytes (the copies of both complete
        there); the peer's copy of the role does nothing (the schedule's `Leader`: traced once, as the
        branch on the rank is)."""
        self.protocol.expect(role, EXPECT_TX, leader(name), 0)
        with cute.arch.elect_one():
            if rank == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(self.barrier(barriers, name), tx_bytes)

    @cute.jit
    def commit_to_pair(self, role: cutlass.Constexpr, barriers, name: cutlass.Constexpr):
        """MMA warp: arrive on `name` in both CTAs once every MMA issued so far has completed."""
        self.protocol.expect(role, MMA_COMMIT, both(name), 0)
        with cute.arch.elect_one():
            tcgen05.commit(self.barrier(barriers, name), Int32(0b11), tcgen05.CtaGroup.TWO)

    @cute.jit
    def arrive_on_leader(self, role: cutlass.Constexpr, barriers, name: cutlass.Constexpr):
        """Every thread of a role in both CTAs: arrive on the leader CTA's `name` (cluster scope, so
        this thread's earlier shared-memory writes, local or remote, are visible to its waiter)."""
        self.protocol.expect(role, ARRIVE, leader(name), 0)
        cute.arch.mbarrier_arrive(self.barrier(barriers, name), Int32(0), scope=nvvm.MemScopeKind.CLUSTER)

    # The one-stage Q / dO pipeline (schedule: load_q), on raw barriers: its slot is always 0 and a
    # participant's phase flips with every block (producers start at phase 1, as cutlass.pipeline).
    @cute.jit
    def acquire(self, role: cutlass.Constexpr, barriers, name: cutlass.Constexpr, count, rank):
        """Producer: wait for this CTA's slot to be released, then the leader expects the slot's bytes
        of both CTAs on its full barrier."""
        self.protocol.expect(role, ACQUIRE, name)
        cute.arch.mbarrier_wait(self.barrier(barriers, name + ".empty"), self.parity(role, name, count, 1))
        with cute.arch.elect_one():
            if rank == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(self.barrier(barriers, name + ".full"),
                                                        self.schedule.pipeline(name).tx_bytes)

    @cute.jit
    def drain(self, role: cutlass.Constexpr, barriers, name: cutlass.Constexpr, count):
        """Producer's tail: the last slot's release (a commit multicast into this CTA) has landed."""
        self.protocol.expect(role, DRAIN, name)
        cute.arch.mbarrier_wait(self.barrier(barriers, name + ".empty"), self.parity(role, name, count, 1))

    @cute.jit
    def consumer_wait(self, role: cutlass.Constexpr, barriers, name: cutlass.Constexpr, count):
        self.protocol.expect(role, CONSUMER_WAIT, name)
        cute.arch.mbarrier_wait(self.barrier(barriers, name + ".full"), self.parity(role, name, count, 0))

    @cute.jit
    def release(self, role: cutlass.Constexpr, barriers, name: cutlass.Constexpr, handle: cutlass.Constexpr):
        """MMA warp: the slot is free in both CTAs once the MMAs issued so far (its readers) are done."""
        self.protocol.expect(role, RELEASE, handle)
        with cute.arch.elect_one():
            tcgen05.commit(self.barrier(barriers, name + ".empty"), Int32(0b11), tcgen05.CtaGroup.TWO)

    # --------------------------------------------------------------------------------------------
    # Load warp
    # --------------------------------------------------------------------------------------------
    @cute.jit
    def load_role(self, s_mma, dkv_mma, dq_mma, rank, pair, walk, barriers,
                  tma_atom_k, tma_k, tma_atom_v, tma_v, tma_atom_kt, tma_kt,
                  tma_atom_q, tma_q, tma_atom_do, tma_do, tma_atom_qt, tma_qt, tma_atom_dot, tma_dot,
                  sK, sV, sKt, sQ, sdO, sQt, sdOt):
        m_lo, m_count, kv_head, batch = walk
        s_thr = s_mma.get_slice(rank)
        dkv_thr = dkv_mma.get_slice(rank)
        dq_thr = dq_mma.get_slice(rank)

        def partition(atom, gmem, smem, tiler, thr, operand):
            tiled = cute.flat_divide(gmem, cute.select(tiler, mode=[0, 2] if operand == "A" else [1, 2]))
            parts = thr.partition_A(tiled) if operand == "A" else thr.partition_B(tiled)
            return cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(smem, 0, 3),
                                         cute.group_modes(parts, 0, 3))

        tKsK, tKgK = partition(tma_atom_k, tma_k, sK, self.s_tiler, s_thr, "A")
        tVsV, tVgV = partition(tma_atom_v, tma_v, sV, self.s_tiler, s_thr, "A")
        tKtsKt, tKtgKt = partition(tma_atom_kt, tma_kt, sKt, self.dq_tiler, dq_thr, "B")
        tQsQ, tQgQ = partition(tma_atom_q, tma_q, sQ, self.s_tiler, s_thr, "B")
        tOsdO, tOgdO = partition(tma_atom_do, tma_do, sdO, self.s_tiler, s_thr, "B")
        tQtsQt, tQtgQt = partition(tma_atom_qt, tma_qt, sQt, self.dkv_tiler, dkv_thr, "B")
        tOtsdOt, tOtgdOt = partition(tma_atom_dot, tma_dot, sdOt, self.dkv_tiler, dkv_thr, "B")

        kv_coordinate = (kv_head, batch)
        self.protocol.begin("load")
        full = self.barrier(barriers, "kv_full")
        self.expect_pair_bytes("load", barriers, "kv_full", self.key_bytes, rank)
        cute.copy(tma_atom_k, tKgK[None, pair, 0, kv_coordinate], tKsK[None, 0], tma_bar_ptr=full)
        cute.copy(tma_atom_v, tVgV[None, pair, 0, kv_coordinate], tVsV[None, 0], tma_bar_ptr=full)
        cute.copy(tma_atom_kt, tKtgKt[None, 0, pair, kv_coordinate], tKtsKt[None, 0], tma_bar_ptr=full)

        full = self.barrier(barriers, "load_q.full")
        self.protocol.loop("load", "blocks")
        for it in cutlass.range(m_count * self.options.group, unroll=1):
            q_head, m_block = self.query_block(it, walk)
            coordinate = (q_head, batch)
            self.acquire("load", barriers, "load_q", it, rank)
            cute.copy(tma_atom_q, tQgQ[None, m_block, 0, coordinate], tQsQ[None, 0], tma_bar_ptr=full)
            cute.copy(tma_atom_do, tOgdO[None, m_block, 0, coordinate], tOsdO[None, 0], tma_bar_ptr=full)
            cute.copy(tma_atom_qt, tQtgQt[None, 0, m_block, coordinate], tQtsQt[None, 0], tma_bar_ptr=full)
            cute.copy(tma_atom_dot, tOtgdOt[None, 0, m_block, coordinate], tOtsdOt[None, 0], tma_bar_ptr=full)
        self.protocol.end("load", "blocks")
        self.drain("load", barriers, "load_q", m_count * self.options.group)
        self.protocol.finish("load")

    @cute.jit
    def query_block(self, it, walk):
        """(query head, query block) of step `it` of the walk: the group's heads in turn, each over the
        query blocks [m_lo, m_lo + m_count) that the pair's keys see (masking.query_block_range)."""
        m_lo, m_count, kv_head, batch = walk
        return kv_head * self.options.group + it // m_count, m_lo + it % m_count

    # --------------------------------------------------------------------------------------------
    # MMA warp (leader CTA only)
    # --------------------------------------------------------------------------------------------
    @cute.jit
    def gemm(self, tiled_mma, accumulator, a, b, accumulate):
        """accumulator (+)= a @ b over all k-blocks (one elected thread issues)."""
        atom = cute.make_mma_atom(tiled_mma.op)
        for k_block in cutlass.range(cute.size(a, mode=[2]), unroll=1):
            atom.set(tcgen05.Field.ACCUMULATE, accumulate or k_block != 0)
            cute.gemm(atom, accumulator, a[None, None, k_block], b[None, None, k_block], accumulator)

    @cute.jit
    def mma_role(self, s_mma, dkv_mma, dq_mma, walk, barriers, tmem, p_tmem_layout,
                 sK, sV, sKt, sQ, sdO, sQt, sdOt, sdS):
        m_lo, m_count, kv_head, batch = walk
        s_thr = s_mma.get_slice(0)
        dkv_thr = dkv_mma.get_slice(0)
        dq_thr = dq_mma.get_slice(0)
        tSrK = s_mma.make_fragment_A(sK)[None, None, None, 0]
        tSrV = s_mma.make_fragment_A(sV)[None, None, None, 0]
        tSrQ = s_mma.make_fragment_B(sQ)[None, None, None, 0]
        tSrdO = s_mma.make_fragment_B(sdO)[None, None, None, 0]
        tKrQt = dkv_mma.make_fragment_B(sQt)[None, None, None, 0]
        tVrdOt = dkv_mma.make_fragment_B(sdOt)[None, None, None, 0]
        tQrdS = dq_mma.make_fragment_A(sdS)[None, None, None, 0]
        tQrKt = dq_mma.make_fragment_B(sKt)[None, None, None, 0]

        s_layout = s_thr.make_fragment_C(s_thr.partition_shape_C(self.s_tiler[:2])).layout
        dkv_layout = dkv_thr.make_fragment_C(dkv_thr.partition_shape_C(self.dkv_tiler[:2])).layout
        dq_layout = dq_thr.make_fragment_C(dq_thr.partition_shape_C(self.dq_tiler[:2])).layout
        tStS = cute.make_tensor(tmem + self.tmem_s, s_layout)
        tStdP = cute.make_tensor(tmem + self.tmem_dp, s_layout)
        tVtdV = cute.make_tensor(tmem + self.tmem_dv, dkv_layout)
        tKtdK = cute.make_tensor(tmem + self.tmem_dk, dkv_layout)
        tQtdQ = cute.make_tensor(tmem + self.tmem_dq, dq_layout)
        a_from_tmem = dkv_thr.make_fragment_A(cute.make_tensor(tmem, p_tmem_layout.outer))[None, None, None, 0]
        tVrP = cute.make_tensor(cute.recast_ptr(tmem + self.tmem_s, dtype=a_from_tmem.element_type),
                                a_from_tmem.layout)
        tKrdS = cute.make_tensor(cute.recast_ptr(tmem + self.tmem_dp, dtype=a_from_tmem.element_type),
                                 a_from_tmem.layout)

        # The TMEM plan of the module docstring, checked where the accumulator layouts are known.
        for accumulator, columns in ((tStS, self.tmem_dp - self.tmem_s), (tQtdQ, self.tmem_dv - self.tmem_dq),
                                     (tVtdV, self.tmem_dk - self.tmem_dv)):
            assert tcgen05.find_tmem_tensor_col_offset(accumulator) <= columns, (accumulator, columns)
        self.protocol.begin("mma")
        self.wait("mma", barriers, "kv_full", "kv_phase", None)
        self.protocol.loop("mma", "blocks")
        for it in cutlass.range(m_count * self.options.group, unroll=1):
            self.consumer_wait("mma", barriers, "load_q", it)
            self.gemm(s_mma, tStS, tSrK, tSrQ, False)
            self.commit_to_pair("mma", barriers, "s_full")
            # dP^T overwrites the previous block's dQ: the dQ warps of both CTAs must have read it.
            self.wait("mma", barriers, "dq_empty", "dq_empty_phase", it)
            self.gemm(s_mma, tStdP, tSrV, tSrdO, False)
            self.commit_to_pair("mma", barriers, "dp_full")
            self.wait("mma", barriers, "ds_ready", "ds_phase", it)
            self.gemm(dkv_mma, tVtdV, tVrP, tVrdOt, it > 0)
            self.gemm(dkv_mma, tKtdK, tKrdS, tKrQt, it > 0)
            self.gemm(dq_mma, tQtdQ, tQrdS, tQrKt, False)
            self.commit_to_pair("mma", barriers, "dq_full")
            self.release("mma", barriers, "load_q", "q")
            self.flip("mma", "dq_empty_phase")
            self.flip("mma", "ds_phase")
        self.protocol.end("mma", "blocks")
        self.commit_to_pair("mma", barriers, "dkv_full")
        self.protocol.finish("mma")

    # --------------------------------------------------------------------------------------------
    # Compute warpgroup: P, dS per key row; P^T, dS^T into TMEM; dS into both CTAs' dQ operands
    # --------------------------------------------------------------------------------------------
    @cute.jit
    def compute_role(self, s_mma, dq_mma, rank, pair, walk, barriers, tmem, sdS, row_stats, mLSE, mdPsum, mQSegmentIds,
                     mKVSegmentIds, q_len, kv_len, offset, mdK, mdV):
        m_lo, m_count, kv_head, batch = walk
        row = cute.arch.thread_idx()[0] % ROWS       # this thread's key row = TMEM lane
        key_local = rank * ROWS + row                # its key within the pair's block
        key_base = pair * PAIR_KEYS
        s_thr = s_mma.get_slice(rank)
        # This CTA's 128 x 128 share of S^T (and dP^T, dV, dK: the same lanes) in SLICE-column pieces.
        s_layout = s_thr.make_fragment_C(s_thr.partition_shape_C(self.s_tiler[:2])).layout
        slice_tmem = cute.make_tensor(tmem, cute.composition(s_layout, cute.make_layout((ROWS, SLICE))))
        packed_tmem = cute.make_tensor(tmem, cute.composition(s_layout, cute.make_layout((ROWS, SLICE // 2))))
        tiled_load = tcgen05.make_tmem_copy(cute.make_copy_atom(
            tcgen05.copy.Ld32x32bOp(tcgen05.copy.Repetition(SLICE)), Float32), slice_tmem)
        tiled_store = tcgen05.make_tmem_copy(cute.make_copy_atom(
            tcgen05.copy.St32x32bOp(tcgen05.copy.Repetition(SLICE // 2)), Float32), packed_tmem)
        thr_load = tiled_load.get_slice(row)
        thr_store = tiled_store.get_slice(row)
        tLt = thr_load.partition_S(slice_tmem)
        tSt = thr_store.partition_D(packed_tmem)
        coordinates = cute.make_identity_tensor((ROWS, SLICE))
        loaded_shape = thr_load.partition_D(coordinates).shape
        stored_shape = thr_store.partition_S(cute.make_identity_tensor((ROWS, SLICE // 2))).shape
        # What the code below assumes of these copies, checked on one thread at trace time: thread t
        # loads (stores) TMEM lane t, consecutive columns in order. With the MMA's own partition of the
        # pair's S^T (rank r holds keys [128 r, 128 r + 128) on lanes 0-127) that makes t this CTA's key t.
        probe = 5
        for copy, columns, side in ((tiled_load, SLICE, "D"), (tiled_store, SLICE // 2, "S")):
            thread = copy.get_slice(probe)
            seen = (thread.partition_D if side == "D" else thread.partition_S)(
                cute.make_identity_tensor((ROWS, columns)))
            assert [seen[i] for i in range(columns)] == [(probe, c) for c in range(columns)], columns
        for cta in (0, 1):
            first = s_mma.get_slice(cta).partition_C(cute.make_identity_tensor(self.s_tiler[:2]))[0]
            assert first == (cta * ROWS, 0), first
        stats_barrier = pipeline.NamedBarrier(barrier_id=2, num_threads=ROWS)
        # dS for the dQ operand: this thread's key, the 64 queries of CTA `half`'s share (the dQ MMA's
        # A rows of CTA r are queries [64 r, 64 r + 64), checked below).
        peer = rank ^ 1
        ds_row = sdS[((None, key_local % 16), 0, key_local // 16, 0)]
        for cta in (0, 1):
            first = dq_mma.get_slice(cta).partition_A(cute.make_identity_tensor(
                cute.select(self.dq_tiler, mode=[0, 2])))[0]
            assert first == (cta * ROWS // 2, 0), first
        ds_row_peer = cute.make_tensor(cute.arch.map_dsmem_ptr(ds_row.iterator, peer), ds_row.layout)
        chunk_coordinates = cute.make_identity_tensor((SLICE, 1))

        self.protocol.begin("compute")
        self.protocol.loop("compute", "blocks")
        for it in cutlass.range(m_count * self.options.group, unroll=1):
            q_head, m_block = self.query_block(it, walk)
            row_start = m_block * ROWS
            # This block's LSE and dPsum, one row per thread, through shared memory to every thread.
            buffer = it % 2
            row_stats[row, 0, buffer] = mLSE[batch, q_head, row_start + row]
            row_stats[row, 1, buffer] = mdPsum[batch, q_head, row_start + row]
            stats_barrier.arrive_and_wait()
            self.wait("compute", barriers, "s_full", "phase", it)
            self.wait("compute", barriers, "dp_full", "phase", it)
            for k in cutlass.range_constexpr(ROWS // SLICE):
                loaded_scores = cute.make_rmem_tensor(loaded_shape, Float32)
                loaded_grads = cute.make_rmem_tensor(loaded_shape, Float32)
                cute.copy(tiled_load, cute.make_tensor(tLt.iterator + self.tmem_s + k * SLICE, tLt.layout),
                          loaded_scores)
                cute.copy(tiled_load, cute.make_tensor(tLt.iterator + self.tmem_dp + k * SLICE, tLt.layout),
                          loaded_grads)
                cute.arch.fence_view_async_tmem_load()
                scores = cute.make_tensor(loaded_scores.iterator, cute.make_layout(SLICE))
                grads = cute.make_tensor(loaded_grads.iterator, cute.make_layout(SLICE))
                lse = cute.make_rmem_tensor(cute.make_layout(SLICE), Float32)
                dpsum = cute.make_rmem_tensor(cute.make_layout(SLICE), Float32)
                for j in cutlass.range_constexpr(SLICE):
                    lse[j] = row_stats[k * SLICE + j, 0, buffer]
                    dpsum[j] = row_stats[k * SLICE + j, 1, buffer]
                # The chunk as the (queries, keys) = (SLICE, 1) view the shared numerics take.
                scores_qk = cute.make_tensor(scores.iterator, cute.make_layout((SLICE, 1)))
                grads_qk = cute.make_tensor(grads.iterator, cute.make_layout((SLICE, 1)))
                coords = cute.domain_offset((k * SLICE, 0), chunk_coordinates)
                self.numerics.probabilities(
                    scores, scores_qk, coords, lse, pair, row_start, row_start, key_base + key_local, kv_len,
                    q_len, offset, mQSegmentIds, mKVSegmentIds, batch)
                self.numerics.ds_over_dp(scores_qk, grads_qk, dpsum, lse)
                # P^T and dS^T (16-bit pairs) over the chunk's first half of S^T and dP^T columns.
                self.store_packed(scores, tiled_store, tSt, stored_shape, self.tmem_s + k * SLICE // 2)
                self.store_packed(grads, tiled_store, tSt, stored_shape, self.tmem_dp + k * SLICE // 2)
                # dS for the dQ MMA: queries [0, 64) belong to CTA 0's operand, [64, 128) to CTA 1's.
                narrow = cute.make_rmem_tensor(cute.make_layout(SLICE), self.dtype)
                narrow.store(grads.load().to(self.dtype))
                half = k * SLICE // (ROWS // 2)
                column = (k * SLICE) % (ROWS // 2)
                target = cute.local_tile(ds_row, (SLICE,), (column // SLICE,))
                target_peer = cute.local_tile(ds_row_peer, (SLICE,), (column // SLICE,))
                if half == rank:
                    cute.autovec_copy(narrow, target)
                else:
                    cute.autovec_copy(narrow, target_peer)
            cute.arch.fence_view_async_tmem_store()
            # The dQ MMA reads dS through the async proxy, in this CTA and the peer.
            cute.arch.fence_proxy("async.shared", space="cluster")
            self.arrive_on_leader("compute", barriers, "ds_ready")
            self.flip("compute", "phase")
        self.protocol.end("compute", "blocks")
        self.wait("compute", barriers, "dkv_full", "dkv_phase", None)
        self.store_dkv(tiled_load, tLt, loaded_shape, m_count > 0, pair, rank, row, kv_head, batch, mdK, mdV)
        self.protocol.finish("compute")

    @cute.jit
    def store_packed(self, values, tiled_store, tSt, stored_shape, column):
        """`values` (SLICE fp32) rounded to 16 bits, two per 32-bit TMEM column, at `column`."""
        packed = cute.make_rmem_tensor(stored_shape, Float32)
        cute.make_tensor(cute.recast_ptr(packed.iterator, dtype=self.dtype), cute.make_layout(SLICE)).store(
            values.load().to(self.dtype))
        cute.copy(tiled_store, packed, cute.make_tensor(tSt.iterator + column, tSt.layout))

    @cute.jit
    def store_dkv(self, tiled_load, tLt, loaded_shape, visited, pair, rank, row, kv_head, batch, mdK, mdV):
        """dK (times the softmax scale) and dV of this thread's key row, TMEM -> global memory; zeros
        when no query sees the pair's keys (`visited` False: the MMAs never wrote the accumulators)."""
        key = pair * PAIR_KEYS + rank * ROWS + row
        if key < mdK.shape[1]:
            for k in cutlass.range_constexpr(self.head_dim // SLICE):
                for source, target, factor in ((self.tmem_dk, mdK, self.options.scale), (self.tmem_dv, mdV, 1.0)):
                    loaded = cute.make_rmem_tensor(loaded_shape, Float32)
                    cute.copy(tiled_load, cute.make_tensor(tLt.iterator + source + k * SLICE, tLt.layout), loaded)
                    cute.arch.fence_view_async_tmem_load()
                    values = cute.make_tensor(loaded.iterator, cute.make_layout(SLICE))
                    if not visited:
                        values.fill(0.0)
                    narrow = cute.make_rmem_tensor(cute.make_layout(SLICE), self.dtype)
                    narrow.store((values.load() * factor).to(self.dtype))
                    cute.autovec_copy(narrow, cute.local_tile(target[batch, key, kv_head, None], (SLICE,), (k,)))

    # --------------------------------------------------------------------------------------------
    # dQ warpgroup: dQ (this CTA's 64 query rows) from TMEM, atomic adds into the fp32 accumulator
    # --------------------------------------------------------------------------------------------
    @cute.jit
    def dq_role(self, dq_mma, rank, pair, walk, barriers, tmem, mdQacc, mSemaphores, kv_len, offset):
        """Deterministic: the pairs that visit a query block add in a fixed order, highest pair first
        (`common/ordered_reduction.py`'s turns, as the sm90 kernels), CTA 0 of a pair before CTA 1
        (their 64-row halves are disjoint; one counter per 128-row block serves both)."""
        m_lo, m_count, kv_head, batch = walk
        thread = cute.arch.thread_idx()[0] % ROWS
        dq_threads = pipeline.NamedBarrier(barrier_id=4, num_threads=ROWS)
        dq_thr = dq_mma.get_slice(rank)
        dq_layout = dq_thr.make_fragment_C(dq_thr.partition_shape_C(self.dq_tiler[:2])).layout
        tQtdQ = cute.make_tensor(tmem + self.tmem_dq, dq_layout)
        load_atom = sm100_utils.get_tmem_load_op(
            (ROWS // 2, self.head_dim, PAIR_KEYS), LayoutEnum.ROW_MAJOR, Float32, Float32,
            (ROWS // 2, self.head_dim), use_2cta_instrs=True)
        tiled_load = tcgen05.make_tmem_copy(load_atom, tQtdQ)
        thr_load = tiled_load.get_slice(thread)
        tLtdQ = thr_load.partition_S(tQtdQ)
        tLcdQ = thr_load.partition_D(dq_thr.partition_C(cute.make_identity_tensor(self.dq_tiler[:2])))
        self.protocol.begin("dq")
        self.protocol.loop("dq", "blocks")
        for it in cutlass.range(m_count * self.options.group, unroll=1):
            q_head, m_block = self.query_block(it, walk)
            self.wait("dq", barriers, "dq_full", "phase", it)
            values = cute.make_rmem_tensor(tLcdQ.shape, Float32)
            cute.copy(tiled_load, tLtdQ, values)
            cute.arch.fence_view_async_tmem_load()
            self.arrive_on_leader("dq", barriers, "dq_empty")
            flag = None
            if const_expr(self.options.deterministic):
                turn = ordered_reduction.key_block_turn(self.mask, pair, m_block * ROWS, ROWS, PAIR_KEYS, kv_len,
                                                        offset, highest_first=True)
                self.protocol.expect("dq", TURN_WAIT, backward_schedule.TURN_COUNTER)
                flag = ordered_reduction.wait_for_turn(mSemaphores, (batch, q_head, m_block), 2 * turn + rank,
                                                       cute.arch.lane_idx())
            rows = mdQacc[batch, None, q_head, None]
            for e in cutlass.range_constexpr(cute.size(values)):
                q_row = tLcdQ[e][0]
                column = tLcdQ[e][1]
                target = rows.iterator + cute.crd2idx((m_block * ROWS + q_row, column), rows.layout)
                cute.arch.red(target, values[e], op="add", dtype=Float32, sem="relaxed", scope="gpu")
            if const_expr(self.options.deterministic):
                self.protocol.expect("dq", TURN_PASS, backward_schedule.TURN_COUNTER)
                ordered_reduction.finish_atomic_adds(flag, thread, dq_threads)
            self.flip("dq", "phase")
        self.protocol.end("dq", "blocks")
        self.protocol.finish("dq")


# ------------------------------------------------------------------------------------------------
# The kernel module's face (what fa4_jax/lowering/cuda.py calls on compute capability 10.x)
# ------------------------------------------------------------------------------------------------

# The launcher's optional inputs after dPsum, by name (absent ones None): the sm90 backward's order.
OPTIONAL_INPUTS = ("q_segment_ids", "kv_segment_ids", "q_seq_lengths", "kv_seq_lengths", "q_start")


def unsupported_reason(config: AttentionConfig, problem: host.Problem) -> Optional[str]:
    """None when this kernel computes `config` exactly; otherwise what it cannot take."""
    reason = (host.kernel_unsupported_reason("sm100 backward", config, problem, SUPPORTED_HEAD_DIMS)
              or host.grid_unsupported_reason("sm100 backward", problem))
    if reason is not None:
        return reason
    if config.has_q_start:
        return "the sm100 backward does not yet take a sequence-sharded query (q_start)"
    return None


def options(config: AttentionConfig, problem: host.Problem) -> KernelOptions:
    """The static kernel configuration for one call."""
    return KernelOptions(
        dtype_name=problem.dtype, head_dim=problem.head_dim, group=problem.group, scale=float(config.scale),
        mask=masking.MaskShape.from_config(config),
        softcap=None if config.softcap is None else float(config.softcap),
        has_kv_lengths=config.has_kv_seq_lengths, has_sinks=config.has_sinks,
        deterministic=config.deterministic)


def dq_accumulator_shape(batch, padded_rows, q_heads, head_dim):
    """The fp32 dQ accumulator: [B, Sq padded to whole 128-row query blocks, Hq, D]."""
    return (batch, padded_rows, q_heads, head_dim)


def _dq_rows(dq_accum, q_len):
    return dq_accum[:, :q_len]


def fake_arguments(config: AttentionConfig, shape, dtype_name: str) -> list:
    """Fake tensors in the launcher's order, for compiling without a GPU. shape = (B, Sq, Sk, Hq, Hkv, D)."""
    return host.backward_fake_arguments(config, shape, dtype_name, OPTIONAL_INPUTS, dq_accumulator_shape, ROWS)


@functools.lru_cache(maxsize=None)
def _kernel(options: KernelOptions) -> Sm100BackwardKernel:
    return Sm100BackwardKernel(options)


def run(options: KernelOptions, query, key, value, out, lse, d_out, d_lse, optional: dict):
    """(dq, dk, dv, dsinks or None) for one attention call; traceable JAX."""
    return host.run_backward(_kernel(options), options, query, key, value, out, lse, d_out, d_lse, optional,
                             OPTIONAL_INPUTS, dq_accumulator_shape, _dq_rows, ROWS)
