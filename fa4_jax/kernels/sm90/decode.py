"""Split-KV decode attention over a paged KV cache (flash-decoding), in CuTe DSL, and its JAX entry point.

The problem: a few new query tokens (Sq = 1 .. a few dozen) per sequence against a long KV cache,
stored in pages that `block_tables` maps to cache blocks. The work is reading K and V once; the
kernel is built to keep that read at the memory-bandwidth limit:

- GQA packing: the Sq · G query rows (G = Hq / Hkv) of one key/value head share one 16-row tile
  (row = position * G + head in group), so every K/V byte read serves all G heads. More rows take more
  row tiles (the extra reads hit L2).
- Split-KV: when batch · Hkv · row tiles CTAs cannot fill the GPU, each sequence's key blocks are
  split across `num_splits` CTAs (`choose_num_splits`, below). Within a CTA each of the 4 warps owns a
  quarter of every key block and keeps its own online softmax, so no warp waits on another in the
  key loop; at the end the 4 warps merge their (O, LSE) through shared memory (the K/V ring is free
  by then) into the split's one.
- Where the splits merge (`DecodeOptions.combine`); with one split (batch · Hkv · row tiles CTAs already
  fill the GPU) there is nothing to merge, and the kernel writes the final O (output dtype) and LSE itself:
  - "kernel" (the default since it was measured): each split writes its normalised partial O (fp32, only
    the tile's real rows) and LSE, and one small CuTe kernel of our own merges them with the sinks
    (decode_combine.py: a thread per (row, 4-column chunk), every split's loads in flight at once).
    Measured on an H100 (rev 88d2e81, CUPTI per kernel, B = 1, 32 / 8 heads, D 128, Sq 1): at 1k the
    split kernel 4.00 us and the merge 1.73 (5.73 in all, against 7.94 with XLA's three-kernel merge;
    predicted 5.5-6.0), at 8k 9.57 + 2.02 = 11.58 (13.63; predicted 11.0-11.7); B = 1 1k Sq 4 8.51 ->
    6.18, B = 8 1k 12.27 -> 10.93; never slower through the API on the B = 1 / 8 rows up to 32k
    (docs/kernels.md, "Decode: the combine as one kernel").
  - "xla": the same partials merged by `combine_partials` in XLA (a max, the weights' sum, the weighted
    sum: three kernels of ~1.2-1.6 us each at B = 1), kept as the kernel's yardstick.
  Three more merges were built, measured slower and deleted (docs/kernels.md has their numbers): the
  last CTA of each (batch, head tile) merging behind an arrival counter (~1 us slower than the XLA
  pass), the splits as one thread-block cluster merging through distributed shared memory (no faster
  at B = 1, 25-45 % slower at B = 8), and the XLA merge as one variadic reduction (slower still).

  Why the partial is small: K/V is 4 KiB per token at 32 / 8 heads, D 128 (4 MiB at 1k: ~1.2 us at
  3.4 TB/s), so at B = 1 the step is launches and partials, not the read. A split's partial is its
  tile's real rows only (4 at one token: 2 KB a head, 0.5 MB at 8k); the first layout, a partial per
  (split, warp) over all 16 rows, moved 8.7 MB at 8k, a quarter of the K/V read (docs/kernels.md).
- Pages through cp.async with per-row addresses: a token's page comes from the block table, its
  address is computed per 16-byte chunk, so any page size works (1 .. the whole sequence; the
  contiguous-cache form of `fa4_jax.attention` is one page per sequence). Rows past the sequence's
  length are clamped to its last token, so no table entry past the length is read and no
  uninitialised cache slot reaches P V. `num_stages` key blocks are in flight (multistage
  cp.async ring, one barrier per block).
- Tensor cores through mma.sync (m16n8k16) with ldmatrix from swizzled shared memory, not wgmma:
  wgmma's smallest M is 64 rows per warpgroup, four times the 16 packed rows of a decode step, and
  decode is bound by memory, not by the tensor cores. mma.sync, ldmatrix and cp.async are the same
  on sm_90 and sm_100, so this one kernel compiles for both.
- Masking (causal among the new tokens, window: key blocks outside it are never loaded), softcap
  and the online softmax are the shared building blocks of kernels/common.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import jax
import jax.numpy as jnp
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import cpasync, warp
from cutlass.memory import SmemAllocator

from fa4_jax.config import AttentionConfig
from fa4_jax.kernels import host
from fa4_jax.kernels.common import masking, online_softmax
from fa4_jax.kernels.common.softcap import apply_softcap
from fa4_jax.kernels.sm90 import DEFAULT_SM_COUNT, decode_combine, wgmma

SUPPORTED_HEAD_DIMS = (64, 128, 256)
THREADS = 128
WARPS = THREADS // 32
TILE_M = 16              # packed query rows per CTA: one mma.sync M
MAX_SPLITS = 128
MIN_BLOCKS_PER_SPLIT = 1  # key blocks a split reads at least (choose_num_splits says why one is enough)
SHARED_MEMORY_LIMIT = 227 * 1024
# (key block, stages) per head dim: 96 KB of K/V stages at D = 64 / 128, so two CTAs share an SM
# (8 warps, 2 x 64 KB of cp.async in flight per SM); one at D = 256.
_TILE_N_AND_STAGES = {64: (128, 3), 128: (64, 3), 256: (64, 2)}
CHUNK = 8                # elements per 16-byte cp.async
COMBINES = ("kernel", "xla")


@dataclasses.dataclass(frozen=True)
class DecodeOptions:
    """Everything static about one compiled decode kernel (hashable: the compile key)."""

    dtype_name: str
    head_dim: int
    group: int                # query heads per key/value head
    q_len: int
    page_size: int
    scale: float
    mask: masking.MaskShape
    softcap: Optional[float]
    num_splits: int
    tile_n: int               # keys per block (each warp takes tile_n / 4)
    num_stages: int           # key blocks in the cp.async ring (num_stages - 1 in flight during compute)
    combine: str = "kernel"   # where the splits merge: "kernel" or "xla" (module docstring)
    rescale_threshold: float = 8.0
    # Load each key block's page numbers one block before its cp.async. A cp.async address needs its row's
    # block-table entry, so without it every block's issue waits for a table load (a DRAM or L2 round
    # trip) in the middle of the loop, and the prologue's stages wait for theirs one after another.
    # Measured on an H100 (c2332f0; docs/kernels.md, "Decode: page numbers one block ahead"): equal or
    # faster on all 24 rows, ~1 us at B = 1 8k and 1-2 us at B = 8 1k. False: the old order.
    page_lookahead: bool = True

    @property
    def rows(self) -> int:
        """Packed query rows per key/value head."""
        return self.q_len * self.group

    @property
    def writes_output(self) -> bool:
        """Whether the kernel writes the final O and LSE: with one split there is nothing to merge (else
        it writes its partials, for the combine kernel or `combine_partials`)."""
        return self.num_splits == 1

    @property
    def row_tiles(self) -> int:
        return -(-self.rows // TILE_M)

    def shared_memory_bytes(self) -> int:
        return _shared_memory_bytes(self.head_dim, self.tile_n, self.num_stages)

    def check(self):
        """Raise ValueError when these options cannot make a kernel."""
        if self.tile_n % (16 * WARPS) or self.num_stages < 2:
            raise ValueError(f"tile_n must be a multiple of {16 * WARPS} (16 keys per warp per MMA k block) and "
                             f"num_stages >= 2; got {self.tile_n}, {self.num_stages}")
        if self.combine not in COMBINES:
            raise ValueError(f"combine must be one of {COMBINES}; got {self.combine!r}")
        if self.shared_memory_bytes() > SHARED_MEMORY_LIMIT:
            raise ValueError(f"{self.shared_memory_bytes()} bytes of shared memory needed, {SHARED_MEMORY_LIMIT} "
                             "available")


def _shared_memory_bytes(head_dim: int, tile_n: int, num_stages: int) -> int:
    """Q tile and the K / V rings (2-byte elements), each 1024-byte aligned."""
    return 2 * (TILE_M * head_dim + 2 * num_stages * tile_n * head_dim) + 3 * 1024


def shared_layouts(dtype, head_dim: int, tile_n: int, num_stages: int):
    """(Q [16, D], K / V ring [tile_n, D, stages]) shared-memory layouts: row-major, 128-byte swizzle.

    The swizzle XORs the 16-byte chunk index of a 128-byte row with the row index mod 8, so the 8 rows
    of one ldmatrix 8x8 matrix (same chunk, 8 rows) fall in distinct banks. The DSL applies a shared
    tensor's swizzle to the *byte* address (as CuTe's swizzle pointer does), so it must be the byte-unit
    Swizzle<3, 4, 3> of warpgroup.make_smem_layout_atom, not C++'s element-unit Swizzle<3, 3, 3> for
    16-bit types: on bytes that one XORs bit 3 with bit 6, so chunks 4..7 of every 128-byte row start 8
    bytes off and their 16-byte cp.async destinations and ldmatrix row addresses are misaligned (the H200
    run of rev 82798e2 stopped with CUDA_ERROR_MISALIGNED_ADDRESS on every case). The layouts are built by
    wgmma.k_major_layout, the one home of the swizzled row-major tile; `tile_to_shape` puts the row
    blocks first, then the columns, then the stages.
    """
    return (wgmma.k_major_layout(dtype, TILE_M, head_dim),
            wgmma.k_major_layout(dtype, tile_n, head_dim, num_stages))


def choose_num_splits(batch: int, kv_heads: int, row_tiles: int, max_kv_len: int, tile_n: int,
                      sm_count: int, ctas_per_sm: int, max_splits: int = MAX_SPLITS) -> int:
    """How many CTAs share one sequence's key blocks (flash-decoding's num_splits).

    One split when batch · kv_heads · row_tiles CTAs already fill every SM's CTA slots; otherwise as
    many splits as fit in one wave of the slots (floor: one more would start a second, mostly empty
    wave, e.g. 5 x 64 CTAs on 264 slots), but no more than leaves MIN_BLOCKS_PER_SPLIT key blocks of
    the longest sequence per split and no more than `max_splits`; then as few splits as give each the
    same number of blocks (128 blocks on 33 splits is 4 a split: 32 splits, no idle CTA).

    Why one block per split is enough: a split's fixed costs (block table, Q and its first blocks in
    flight together, then its partial and the arrival) run in parallel with every other split's while
    the CTAs fit in one wave, and a combine reads one row-sized partial per split (B = 1, one
    token, 8 kv heads: 2 KB per split per head), so more splits cost the last CTA little next to what
    they spread: at B = 1 and 1k keys 16 blocks per head become 16 CTAs of one block (128 CTAs on 132
    SMs) instead of 8 of two (64 SMs idle). The table for the decode benchmark's shapes (Hkv 8, D 128,
    tile_n 64, 2 CTAs per SM on 132 SMs; q_len 1 and 4 are both one row tile) is BENCHMARK_SPLITS in
    tests/test_kernel_compile_decode.py.
    """
    ctas = batch * kv_heads * row_tiles
    slots = sm_count * ctas_per_sm
    if ctas >= slots:
        return 1
    blocks = -(-max_kv_len // tile_n)
    wanted = max(1, min(slots // max(ctas, 1), blocks // MIN_BLOCKS_PER_SPLIT, max_splits))
    per_split = -(-blocks // wanted)
    return max(1, -(-blocks // per_split))


def accumulator_mn(acc: cute.Tensor) -> cute.Tensor:
    """A thread's mma.sync accumulator ((2, 2), M, N) viewed as (rows, cols): mode 0 is (2 adjacent
    columns, 2 rows 8 apart), so rows are (mode0[1], M) and columns (mode0[0], N)."""
    compact = cute.make_layout(acc.layout.shape)
    rows_cols = cute.make_layout(
        ((compact.shape[0][1], compact.shape[1]), (compact.shape[0][0], compact.shape[2])),
        stride=((compact.stride[0][1], compact.stride[1]), (compact.stride[0][0], compact.stride[2])))
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, rows_cols))


def accumulator_as_operand_a(fragment: cute.Tensor) -> cute.Tensor:
    """The P fragment ((2, 2), M, N/8) (an S accumulator converted to 16 bits) as the mma.sync A
    operand ((2, 2, 2), M, N/16): one 16-wide k block of A is two 8-wide accumulator column blocks."""
    split = cute.logical_divide(fragment.layout, (None, None, 2))
    return cute.make_tensor(fragment.iterator, cute.make_layout(
        ((split.shape[0], split.shape[2][0]), split.shape[1], split.shape[2][1]),
        stride=((split.stride[0], split.stride[2][0]), split.stride[1], split.stride[2][1])))


def _element_address(tensor: cute.Tensor, coordinate):
    """The global address (Int64) of one element of `tensor`, in 64-bit arithmetic: a cache of
    B = 64 sequences of 128k tokens holds more than 2^31 elements."""
    offset = cutlass.Int64(0)
    for index, stride in zip(coordinate, tensor.layout.stride):
        offset = offset + cutlass.Int64(index) * cutlass.Int64(stride)
    return tensor.iterator.toint() + offset * (tensor.element_type.width // 8)


class Sm90DecodeKernel:
    """Split-KV paged decode for one static configuration (see the module docstring)."""

    def __str__(self):
        return "fa4_jax_sm90_decode"

    def __init__(self, options: DecodeOptions):
        options.check()
        self.options = options
        self.dtype = host.cutlass_dtype(options.dtype_name)
        self.head_dim = options.head_dim
        self.tile_n = options.tile_n
        self.num_stages = options.num_stages
        self.keys_per_warp = options.tile_n // WARPS
        self.group = options.group
        logit_scale = 1.0 if options.softcap is not None else options.scale
        self.softmax = online_softmax.OnlineSoftmax(
            logit_scale * online_softmax.LOG2_E, threads_per_row=4,
            rescale_threshold=options.rescale_threshold)

    @cute.jit
    def __call__(self, stream: cuda.CUstream, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
                 mBlockTables: cute.Tensor, mKVSeqLengths: cute.Tensor, mSinks: Optional[cute.Tensor],
                 mPartialO: Optional[cute.Tensor],
                 mPartialLSE: Optional[cute.Tensor], mO: Optional[cute.Tensor] = None,
                 mLSE: Optional[cute.Tensor] = None):
        q_layout, kv_layout = shared_layouts(self.dtype, self.head_dim, self.tile_n, self.num_stages)

        @cute.struct
        class SharedStorage:
            s_q: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(q_layout)], 1024]
            s_k: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(kv_layout)], 1024]
            s_v: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(kv_layout)], 1024]

        # cp.async of 16 bytes per thread; a row of D elements is D / 8 threads wide.
        load_atom = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL),
                                        self.dtype, num_bits_per_copy=128)
        chunks = self.head_dim // CHUNK
        load_threads = cute.make_ordered_layout((THREADS // chunks, chunks), order=(1, 0))
        tiled_load = cute.make_tiled_copy_tv(load_atom, load_threads, cute.make_layout((1, CHUNK)))
        # One warp's MMA; N = 16 per tile so ldmatrix.x4 loads a 16x16 B block.
        tiled_mma = cute.make_tiled_mma(warp.MmaF16BF16Op(self.dtype, Float32, (16, 8, 16)), (1, 1, 1),
                                        permutation_mnk=(16, 16, 16))
        grid = (self.options.num_splits, mK.shape[2] * self.options.row_tiles, mQ.shape[0])
        self.kernel(mQ, mK, mV, mBlockTables, mKVSeqLengths, mSinks, mPartialO, mPartialLSE, mO, mLSE,
                    q_layout, kv_layout, tiled_load, load_atom, tiled_mma, SharedStorage).launch(
            grid=grid, block=[THREADS, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mBlockTables: cute.Tensor,
               mKVSeqLengths: cute.Tensor, mSinks: Optional[cute.Tensor],
               mPartialO: Optional[cute.Tensor], mPartialLSE: Optional[cute.Tensor], mO: Optional[cute.Tensor],
               mLSE: Optional[cute.Tensor], q_layout: cute.ComposedLayout, kv_layout: cute.ComposedLayout,
               tiled_load: cute.TiledCopy, load_atom: cute.CopyAtom, tiled_mma: cute.TiledMma, SharedStorage: cutlass.Constexpr):
        tidx = cute.arch.thread_idx()[0]
        warp_index = cute.arch.make_warp_uniform(tidx // 32)
        lane = tidx % 32
        split, head_tile, batch_index = cute.arch.block_idx()
        head_kv = head_tile // self.options.row_tiles
        row_tile = head_tile % self.options.row_tiles

        storage = SmemAllocator().allocate(SharedStorage)
        sQ = storage.s_q.get_tensor(q_layout.outer, swizzle=q_layout.inner)
        sK = storage.s_k.get_tensor(kv_layout.outer, swizzle=kv_layout.inner)
        sV = storage.s_v.get_tensor(kv_layout.outer, swizzle=kv_layout.inner)
        # V^T (D, keys, stages): the B operand of P V, read with transposing ldmatrix.
        sVt = cute.composition(sV, cute.make_ordered_layout(
            (self.head_dim, self.tile_n, self.num_stages), order=(1, 0, 2)))

        # This CTA's rows and key blocks.
        q_len = self.options.q_len
        # Clamped here rather than by the caller: a clip in XLA is one more kernel per decode step
        # (~1.4 us at B = 1 and 1k keys, a sixth of the step). Past the table means the whole table.
        kv_len = cutlass.min(cutlass.max(mKVSeqLengths[batch_index], 0),
                             mBlockTables.shape[1] * self.options.page_size)
        offset = kv_len - q_len
        packed_start = row_tile * TILE_M
        rows_here = cutlass.min(TILE_M, self.options.rows - packed_start)
        position_first = packed_start // self.group
        positions = (packed_start + rows_here - 1) // self.group - position_first + 1
        first, end = masking.key_block_range(self.options.mask, position_first, positions, self.tile_n,
                                             kv_len, offset)
        per_split = (end - first + self.options.num_splits - 1) // self.options.num_splits
        split_first = first + split * per_split
        split_blocks = cutlass.max(cutlass.min(end - split_first, per_split), 0)

        # Q: the packed rows of this tile (rows past the last clamp to it; their results are dropped).
        thread_load = tiled_load.get_slice(tidx)
        t_q_smem = thread_load.partition_D(sQ)
        t_q_coords = thread_load.partition_S(cute.make_identity_tensor((TILE_M, self.head_dim)))
        for m in cutlass.range_constexpr(cute.size(t_q_smem, mode=[1])):
            packed = cutlass.min(packed_start + t_q_coords[0, m, 0][0], self.options.rows - 1)
            position = packed // self.group
            head = head_kv * self.group + packed % self.group
            for k in cutlass.range_constexpr(cute.size(t_q_smem, mode=[2])):
                address = _element_address(mQ, (batch_index, position, head, t_q_coords[0, m, k][1]))
                source = cute.make_tensor(cute.make_ptr(self.dtype, address, cute.AddressSpace.gmem, assumed_align=16),
                                          t_q_smem[None, m, k].layout)
                cute.copy(load_atom, source, t_q_smem[None, m, k])

        rows_per_thread = cute.size(thread_load.partition_D(sK[None, None, 0]), mode=[1])
        pages_ahead = cute.make_rmem_tensor(rows_per_thread, Int32)
        if cutlass.const_expr(self.options.page_lookahead):
            # Every prologue stage's page numbers and the next block's in one round trip, then the issues.
            pages = cute.make_rmem_tensor((rows_per_thread, self.num_stages - 1), Int32)
            for stage in cutlass.range_constexpr(self.num_stages - 1):
                if stage < split_blocks:
                    self.load_pages(mBlockTables, thread_load, batch_index, split_first + stage, kv_len,
                                    pages[None, stage])
            if self.num_stages - 1 < split_blocks:
                self.load_pages(mBlockTables, thread_load, batch_index, split_first + self.num_stages - 1,
                                kv_len, pages_ahead)
            for stage in cutlass.range_constexpr(self.num_stages - 1):
                if stage < split_blocks:
                    self.issue_block(mK, mV, sK, sV, thread_load, load_atom, head_kv, split_first + stage, stage,
                                     kv_len, pages[None, stage])
                cute.arch.cp_async_commit_group()
        else:
            for stage in cutlass.range_constexpr(self.num_stages - 1):
                if stage < split_blocks:
                    self.load_block(mK, mV, sK, sV, mBlockTables, thread_load, load_atom, batch_index, head_kv,
                                    split_first + stage, stage, kv_len)
                cute.arch.cp_async_commit_group()

        # Per-warp MMA state: this warp's keys of each block are [warp * keys_per_warp, ...).
        thread_mma = tiled_mma.get_slice(lane)
        frag_q = thread_mma.make_fragment_A(thread_mma.partition_A(sQ))
        s_k_warp = cute.local_tile(sK[None, None, 0], (self.keys_per_warp, self.head_dim), (0, 0))
        frag_k = thread_mma.make_fragment_B(thread_mma.partition_B(s_k_warp))
        s_vt_warp = cute.local_tile(sVt[None, None, 0], (self.head_dim, self.keys_per_warp), (0, 0))
        frag_vt = thread_mma.make_fragment_B(thread_mma.partition_B(s_vt_warp))
        acc_o = cute.make_rmem_tensor(thread_mma.partition_shape_C((TILE_M, self.head_dim)), Float32)
        acc_o.fill(0.0)
        acc_o_mn = accumulator_mn(acc_o)

        ldmatrix_q = cute.make_tiled_copy_A(
            cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype), tiled_mma)
        ldmatrix_k = cute.make_tiled_copy_B(
            cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype), tiled_mma)
        ldmatrix_v = cute.make_tiled_copy_B(
            cute.make_copy_atom(warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4), self.dtype), tiled_mma)
        thread_ldmatrix_q = ldmatrix_q.get_slice(lane)
        thread_ldmatrix_k = ldmatrix_k.get_slice(lane)
        thread_ldmatrix_v = ldmatrix_v.get_slice(lane)
        t_q_shared = thread_ldmatrix_q.partition_S(sQ)
        t_q_registers = thread_ldmatrix_q.retile(frag_q)
        t_k_registers = thread_ldmatrix_k.retile(frag_k)
        t_vt_registers = thread_ldmatrix_v.retile(frag_vt)

        coords_s = accumulator_mn(thread_mma.partition_C(cute.make_identity_tensor((TILE_M, self.keys_per_warp))))
        coords_o = accumulator_mn(thread_mma.partition_C(cute.make_identity_tensor((TILE_M, self.head_dim))))
        num_rows = cute.size(acc_o_mn, mode=[0])
        row_max, row_sum = online_softmax.OnlineSoftmax.new_state(num_rows)
        online_softmax.OnlineSoftmax.reset(row_max, row_sum)
        row_scale = cute.make_rmem_tensor(num_rows, Float32)

        for i in cutlass.range(split_blocks, unroll=1):
            # Block i has landed (and every warp is done with block i - 1, whose stage is reloaded next).
            cute.arch.cp_async_wait_group(self.num_stages - 2)
            cute.arch.sync_threads()
            ahead = i + self.num_stages - 1
            if ahead < split_blocks:
                if cutlass.const_expr(self.options.page_lookahead):
                    # Its page numbers came during the previous block; the next block's come during this one.
                    self.issue_block(mK, mV, sK, sV, thread_load, load_atom, head_kv, split_first + ahead,
                                     ahead % self.num_stages, kv_len, pages_ahead)
                    if ahead + 1 < split_blocks:
                        self.load_pages(mBlockTables, thread_load, batch_index, split_first + ahead + 1, kv_len,
                                        pages_ahead)
                else:
                    self.load_block(mK, mV, sK, sV, mBlockTables, thread_load, load_atom, batch_index, head_kv,
                                    split_first + ahead, ahead % self.num_stages, kv_len)
            cute.arch.cp_async_commit_group()

            stage = i % self.num_stages
            n_block = split_first + i
            t_k_shared = thread_ldmatrix_k.partition_S(cute.local_tile(
                sK[None, None, stage], (self.keys_per_warp, self.head_dim), (warp_index, 0)))
            t_vt_shared = thread_ldmatrix_v.partition_S(cute.local_tile(
                sVt[None, None, stage], (self.head_dim, self.keys_per_warp), (0, warp_index)))

            acc_s = cute.make_rmem_tensor(thread_mma.partition_shape_C((TILE_M, self.keys_per_warp)), Float32)
            acc_s.fill(0.0)
            for k in cutlass.range_constexpr(cute.size(frag_q, mode=[2])):
                cute.copy(ldmatrix_q, t_q_shared[None, None, k], t_q_registers[None, None, k])
                cute.copy(ldmatrix_k, t_k_shared[None, None, k], t_k_registers[None, None, k])
                cute.gemm(tiled_mma, acc_s, frag_q[None, None, k], frag_k[None, None, k], acc_s)

            if cutlass.const_expr(self.options.softcap is not None):
                apply_softcap(acc_s, self.options.softcap, self.options.scale)
            acc_s_mn = accumulator_mn(acc_s)
            if masking.block_is_partial(self.options.mask, n_block, position_first, positions, self.tile_n,
                                        kv_len, q_len, offset):
                masking.apply_mask(acc_s_mn, coords_s, self.options.mask, packed_start,
                                   n_block * self.tile_n + warp_index * self.keys_per_warp, kv_len, q_len,
                                   offset, packed_start, rows_per_position=self.group)
            self.softmax.step(acc_s_mn, row_max, row_sum, row_scale)
            online_softmax.rescale_rows(acc_o_mn, row_scale, True)

            probabilities = cute.make_rmem_tensor(acc_s.layout, self.dtype)
            probabilities.store(acc_s.load().to(self.dtype))
            frag_p = accumulator_as_operand_a(probabilities)
            for k in cutlass.range_constexpr(cute.size(frag_p, mode=[2])):
                cute.copy(ldmatrix_v, t_vt_shared[None, None, k], t_vt_registers[None, None, k])
                cute.gemm(tiled_mma, acc_o, frag_p[None, None, k], frag_vt[None, None, k], acc_o)
        cute.arch.cp_async_wait_group(0)

        # Merge the 4 warps' (O, LSE) into this split's, through shared memory that the K/V ring and Q
        # no longer need: scratch O [warp, 16, D] fp32 over the K ring, LSE [warp, 16] over Q.
        lse_rows = cute.make_rmem_tensor(num_rows, Float32)
        output_scale = cute.make_rmem_tensor(num_rows, Float32)
        self.softmax.finalize(row_max, row_sum, None, lse_rows, output_scale)
        online_softmax.rescale_rows(acc_o_mn, output_scale, False)
        cute.arch.sync_threads()   # every warp is done reading the ring
        warp_o = storage.s_k.get_tensor(cute.make_ordered_layout((WARPS, TILE_M, self.head_dim), order=(2, 1, 0)),
                                        dtype=Float32)
        scratch_lse = storage.s_q.get_tensor(cute.make_ordered_layout((WARPS, TILE_M), order=(1, 0)),
                                             dtype=Float32)
        t_warp_o = accumulator_mn(thread_mma.partition_C(warp_o[warp_index, None, None]))
        for r in cutlass.range_constexpr(num_rows):
            for c in cutlass.range_constexpr(cute.size(acc_o_mn, mode=[1])):
                t_warp_o[r, c] = acc_o_mn[r, c]
        if coords_o[0, 0][1] == 0:
            for r in cutlass.range_constexpr(num_rows):
                scratch_lse[warp_index, coords_o[r, 0][0]] = lse_rows[r]
        cute.arch.sync_threads()

        # Each thread then owns 8 columns of one row per pass; rows past the tile's last are skipped.
        chunks = self.head_dim // CHUNK
        rows_per_pass = THREADS // chunks
        chunk = tidx % chunks
        values = cute.make_rmem_tensor(CHUNK, Float32)
        warp_lse = lambda w, row: scratch_lse[w, row]
        warp_chunk = lambda w, row, chunk: cute.local_tile(warp_o[w, row, None], (CHUNK,), (chunk,)).load()
        for p in cutlass.range_constexpr(-(-TILE_M // rows_per_pass)):
            row = p * rows_per_pass + tidx // chunks
            if row < rows_here:
                if cutlass.const_expr(self.options.writes_output):
                    # One split: this CTA's is the whole softmax, the sinks' mass included.
                    lse = self.merge(warp_lse, warp_chunk, WARPS, row, chunk,
                                     self.sink(mSinks, head_kv, packed_start + row), values)
                    self.store_output(mO, mLSE, values, lse, batch_index, head_kv, packed_start + row, chunk)
                else:
                    lse = self.merge(warp_lse, warp_chunk, WARPS, row, chunk, None, values)
                    g_o = cute.local_tile(mPartialO[batch_index, head_tile, split, row, None], (CHUNK,), (chunk,))
                    g_o.store(values.load())
                    if chunk == 0:
                        mPartialLSE[batch_index, head_tile, split, row] = lse

    def sink(self, mSinks, head_kv, packed):
        """The sink logit of packed row `packed`'s query head, or None without sinks."""
        if mSinks is None:
            return None
        return mSinks[head_kv * self.group + packed % self.group]

    @cute.jit
    def merge(self, part_lse, part_chunk, num_parts: cutlass.Constexpr, row: Int32, chunk: Int32, sink,
              values: cute.Tensor):
        """values = columns [8 chunk, 8 chunk + 8) of row `row` of the softmax over every part's keys
        (and the sink): sum_p exp(lse_p - lse) O_p with lse = log(sum_p exp(lse_p) + exp(sink)).
        Returns lse; a row no part saw (and no sink) gets O 0 and lse -inf. part_lse(p, row) is part p's
        LSE of a row (natural log), part_chunk(p, row, chunk) the 8 values of its normalised partial O
        (the parts are the CTA's warps, in shared memory; the splits merge in decode_combine.py)."""
        top = -Float32.inf
        if cutlass.const_expr(sink is not None):
            top = sink
        # Unrolled (the four warps' loads in flight at once).
        for p in cutlass.range(num_parts, unroll=32):
            top = cute.arch.fmax(top, part_lse(p, row))
        shift = top * online_softmax.LOG2_E
        if top == -Float32.inf:
            shift = Float32(0.0)
        total = Float32(0.0)
        if cutlass.const_expr(sink is not None):
            total = cute.math.exp2(sink * online_softmax.LOG2_E - shift, fastmath=True)
        values.fill(0.0)
        for p in cutlass.range(num_parts, unroll=8):
            weight = cute.math.exp2(part_lse(p, row) * online_softmax.LOG2_E - shift, fastmath=True)
            total = total + weight
            values.store(values.load() + weight * part_chunk(p, row, chunk))
        lse = -Float32.inf
        scale = Float32(0.0)
        if total > 0.0:
            lse = (shift + cute.math.log2(total, fastmath=True)) * online_softmax.LN_2
            scale = cute.arch.rcp_approx(total)
        values.store(values.load() * scale)
        return lse

    @cute.jit
    def store_output(self, mO: cute.Tensor, mLSE: cute.Tensor, values: cute.Tensor, lse: Float32,
                     batch_index: Int32, head_kv: Int32, packed: Int32, chunk: Int32):
        """Packed row `packed` (position * G + head in group) of the final O (columns of `chunk`, in the
        output dtype) and its LSE."""
        position = packed // self.group
        head = head_kv * self.group + packed % self.group
        g_o = cute.local_tile(mO[batch_index, position, head, None], (CHUNK,), (chunk,))
        g_o.store(values.load().to(self.dtype))
        if chunk == 0:
            mLSE[batch_index, head, position] = lse

    @cute.jit
    def load_block(self, mK: cute.Tensor, mV: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor,
                   mBlockTables: cute.Tensor, thread_load: cute.TiledCopy, load_atom: cute.CopyAtom,
                   batch_index: Int32, head_kv: Int32, n_block: Int32, stage: Int32, kv_len: Int32):
        """cp.async of key block n_block's K and V rows into `stage`, each row from its own page, the page
        numbers loaded right before (`page_lookahead=False`).

        A row past the sequence's length is loaded from its last token instead: a valid address whose
        (finite) values the mask gives weight 0, and no block-table entry past the length is read.
        """
        pages = cute.make_rmem_tensor(cute.size(thread_load.partition_D(sK[None, None, stage]), mode=[1]), Int32)
        self.load_pages(mBlockTables, thread_load, batch_index, n_block, kv_len, pages)
        self.issue_block(mK, mV, sK, sV, thread_load, load_atom, head_kv, n_block, stage, kv_len, pages)

    @cute.jit
    def load_pages(self, mBlockTables: cute.Tensor, thread_load: cute.TiledCopy, batch_index: Int32,
                   n_block: Int32, kv_len: Int32, pages: cute.Tensor):
        """pages[m] = the cache block of this thread's row m of key block n_block (rows past the length:
        of its last token); `issue_block` issues the cp.async that needs them."""
        t_coords = thread_load.partition_S(cute.make_identity_tensor((self.tile_n, self.head_dim)))
        for m in cutlass.range_constexpr(cute.size(pages)):
            token = cutlass.min(n_block * self.tile_n + t_coords[0, m, 0][0], kv_len - 1)
            pages[m] = mBlockTables[batch_index, token // self.options.page_size]

    @cute.jit
    def issue_block(self, mK: cute.Tensor, mV: cute.Tensor, sK: cute.Tensor, sV: cute.Tensor,
                    thread_load: cute.TiledCopy, load_atom: cute.CopyAtom, head_kv: Int32, n_block: Int32,
                    stage: Int32, kv_len: Int32, pages: cute.Tensor):
        """cp.async of key block n_block's K and V rows into `stage`, from the page numbers `load_pages` gave
        (rows past the length from the last token)."""
        t_k_smem = thread_load.partition_D(sK[None, None, stage])
        t_v_smem = thread_load.partition_D(sV[None, None, stage])
        t_coords = thread_load.partition_S(cute.make_identity_tensor((self.tile_n, self.head_dim)))
        for m in cutlass.range_constexpr(cute.size(t_k_smem, mode=[1])):
            token = cutlass.min(n_block * self.tile_n + t_coords[0, m, 0][0], kv_len - 1)
            slot = token % self.options.page_size
            for k in cutlass.range_constexpr(cute.size(t_k_smem, mode=[2])):
                column = t_coords[0, m, k][1]
                for cache, t_smem in ((mK, t_k_smem), (mV, t_v_smem)):
                    address = _element_address(cache, (pages[m], slot, head_kv, column))
                    source = cute.make_tensor(
                        cute.make_ptr(self.dtype, address, cute.AddressSpace.gmem, assumed_align=16),
                        t_smem[None, m, k].layout)
                    cute.copy(load_atom, source, t_smem[None, m, k])


# --------------------------------------------------------------------------------------------------
# The kernel module's face (what fa4_jax/lowering/cuda.py calls).

def unsupported_reason(config: AttentionConfig, problem: host.Problem) -> Optional[str]:
    """None when the decode kernel computes `config` on `problem` exactly; otherwise why not.

    `problem.key` is the logical [B, pages * page_size, Hkv, D]; `problem.page_size` is None for a
    contiguous cache (one page per sequence)."""
    reason = host.kernel_unsupported_reason("sm90 decode", config, problem, SUPPORTED_HEAD_DIMS)
    if reason is not None:
        return reason
    if config.has_segment_ids or config.has_q_seq_lengths or config.has_q_start:
        return "the sm90 decode kernel takes no segment ids, query lengths or sequence-sharded queries"
    if problem.group * problem.q_len > MAX_DECODE_ROWS:
        return (f"the sm90 decode kernel is for short queries: q_len * (q_heads / kv_heads) = "
                f"{problem.q_len * problem.group} packed rows exceed {MAX_DECODE_ROWS}")
    # A symbolic batch (jax.export) is checked when the call runs: CUDA refuses a too large grid then.
    batch_too_large = isinstance(problem.batch, int) and problem.batch > host.MAX_GRID_Y_Z
    if problem.kv_heads * -(-problem.group * problem.q_len // TILE_M) > host.MAX_GRID_Y_Z or batch_too_large:
        return "the sm90 decode kernel's grid (key/value heads x row tiles, batch) exceeds CUDA's limits"
    return None


# Packed rows (q_len * group) up to which the decode kernel serves a call: beyond, the query is a
# prefill chunk, for which the forward kernel's 128-row tiles read K/V fewer times.
MAX_DECODE_ROWS = 64


def options(config: AttentionConfig, problem: host.Problem, sm_count: Optional[int] = None,
            **overrides) -> DecodeOptions:
    """The static kernel configuration for one call; `overrides` (DecodeOptions fields, for tests and
    tuning sweeps: tile_n, num_stages, num_splits, combine) go on top of the defaults."""
    page_size = problem.page_size if problem.page_size is not None else problem.kv_len
    tile_n, stages = _TILE_N_AND_STAGES[problem.head_dim]
    tile_n, stages = overrides.get("tile_n", tile_n), overrides.get("num_stages", stages)
    row_tiles = -(-problem.q_len * problem.group // TILE_M)
    per_cta = _shared_memory_bytes(problem.head_dim, tile_n, stages)
    # With a symbolic batch (jax.export) the splits are sized for one sequence: correct for any batch.
    batch = problem.batch if isinstance(problem.batch, int) else 1
    num_splits = choose_num_splits(batch, problem.kv_heads, row_tiles, problem.kv_len, tile_n,
                                   host.sm_count(DEFAULT_SM_COUNT) if sm_count is None else sm_count,
                                   max(1, SHARED_MEMORY_LIMIT // per_cta))
    fields = dict(dtype_name=problem.dtype, head_dim=problem.head_dim, group=problem.group, q_len=problem.q_len,
                  page_size=page_size, scale=float(config.scale), mask=masking.MaskShape.from_config(config),
                  softcap=None if config.softcap is None else float(config.softcap), num_splits=num_splits,
                  tile_n=tile_n, num_stages=stages)
    fields.update(overrides)
    return DecodeOptions(**fields)


@functools.lru_cache(maxsize=None)
def _kernel(options: DecodeOptions) -> Sm90DecodeKernel:
    return Sm90DecodeKernel(options)


def partial_shapes(options: DecodeOptions, batch: int, kv_heads: int):
    """Shapes of the per-split partials: O [B, Hkv * row tiles, splits, 16, D] and LSE [B, Hkv * row tiles,
    splits, 16] (float32; rows past the tile's last are not written)."""
    leading = (batch, kv_heads * options.row_tiles, options.num_splits, TILE_M)
    return leading + (options.head_dim,), leading


def combine_options(options: DecodeOptions, has_sinks: bool) -> decode_combine.CombineOptions:
    """The combine kernel's options (its compile key) for merging the partials of `options`' kernel."""
    return decode_combine.CombineOptions(dtype_name=options.dtype_name, head_dim=options.head_dim,
                                         group=options.group, q_len=options.q_len, num_splits=options.num_splits,
                                         tile_rows=TILE_M, has_sinks=has_sinks)


def combine_partials(options: DecodeOptions, partial_o, partial_lse, sinks, batch: int, kv_heads: int):
    """Merge the split partials in XLA (the path with combine="xla"): out [B, Sq, Hq, D] float32,
    lse [B, Hq, Sq].

    lse = log(sum_p exp(lse_p) + exp(sink)); out = sum_p exp(lse_p - lse) O_p, a row whose every
    partial is -inf (and sink too) gets out 0, lse -inf.
    """
    group, q_len, rows = options.group, options.q_len, options.rows
    parts = options.num_splits

    def by_row(x):   # [B, Hkv * T, P, 16, ...] -> [B, Hkv, P, rows, ...]
        x = x.reshape((batch, kv_heads, options.row_tiles, parts, TILE_M) + x.shape[4:])
        x = jnp.moveaxis(x, 2, 3).reshape((batch, kv_heads, parts, options.row_tiles * TILE_M) + x.shape[5:])
        return x[:, :, :, :rows]
    lse_parts, o_parts = by_row(partial_lse), by_row(partial_o)
    sink_rows = None
    if sinks is not None:
        sink_rows = jnp.tile(sinks.reshape(kv_heads, group), (1, q_len))[None]   # row = position * G + g
    out, lse = _merge_in_stages(lse_parts, o_parts, sink_rows)
    out = out.reshape(batch, kv_heads, q_len, group, -1).transpose(0, 2, 1, 3, 4)
    out = out.reshape(batch, q_len, kv_heads * group, -1)
    lse = lse.reshape(batch, kv_heads, q_len, group).transpose(0, 1, 3, 2).reshape(batch, kv_heads * group, q_len)
    return out, lse


def _merge_in_stages(lse_parts, o_parts, sink_rows):
    """(out [B, Hkv, rows, D], lse [B, Hkv, rows]) from the parts' [B, Hkv, P, rows(, D)]: the largest LSE,
    the weights against it, their sum, then the weighted sum of the parts."""
    top = lse_parts.max(axis=2)
    if sink_rows is not None:
        top = jnp.maximum(top, sink_rows)
    shift = jnp.where(jnp.isfinite(top), top, 0.0)
    weights = jnp.exp(lse_parts - shift[:, :, None])
    total = weights.sum(axis=2)
    if sink_rows is not None:
        total = total + jnp.exp(sink_rows - shift)
    has_mass = total > 0
    safe_total = jnp.where(has_mass, total, 1.0)
    out = jnp.einsum("bhpr,bhprd->bhrd", weights / safe_total[:, :, None], o_parts,
                     precision=jax.lax.Precision.HIGHEST)
    lse = jnp.where(has_mass, shift + jnp.log(safe_total), -jnp.inf)
    return out, lse


def run(options: DecodeOptions, query, key_cache, value_cache, block_tables, kv_seq_lengths, sinks=None):
    """(out [B, Sq, Hq, D] in the query dtype, lse [B, Hq, Sq] float32), traceable under jax.jit."""
    batch, q_len, q_heads, _ = query.shape
    kv_heads = key_cache.shape[2]
    o_shape, lse_shape = partial_shapes(options, batch, kv_heads)
    partials = [jax.ShapeDtypeStruct(o_shape, jnp.float32), jax.ShapeDtypeStruct(lse_shape, jnp.float32)]
    final = [jax.ShapeDtypeStruct((batch, q_len, q_heads, options.head_dim), query.dtype),
             jax.ShapeDtypeStruct((batch, q_heads, q_len), jnp.float32)]
    # The kernel's operands: query, caches, tables, lengths, sinks, then its outputs (absent operands take
    # no buffer). With one split it writes the final O and LSE, the sinks folded in; else its partials,
    # which the combine kernel (or XLA) merges with the sinks.
    if options.writes_output:
        arguments, outputs = [query, key_cache, value_cache, block_tables, kv_seq_lengths, sinks, None, None], final
    else:
        arguments, outputs = [query, key_cache, value_cache, block_tables, kv_seq_lengths, None], partials
    kernel = _kernel(options)
    results = host.call_kernel(kernel, tuple(arguments), tuple(outputs), (str(kernel), options))
    if options.writes_output:
        return results[-2], results[-1]
    if options.combine == "kernel":
        return decode_combine.run(combine_options(options, sinks is not None), results[0], results[1], sinks)
    out, lse = combine_partials(options, results[0], results[1], sinks, batch, kv_heads)
    return out.astype(query.dtype), lse


def fake_arguments(options: DecodeOptions, batch: int, kv_heads: int, num_blocks: int, max_blocks: int,
                   has_sinks: bool = False) -> list:
    """Fake tensors in the kernel's argument order, for compiling without a GPU: (query, key and value
    caches, block tables, lengths, then with one split: sinks or None, None, None, out, lse; else: None,
    partial O, partial LSE)."""
    element = host.cutlass_dtype(options.dtype_name)
    q_heads = kv_heads * options.group
    cache = (num_blocks, options.page_size, kv_heads, options.head_dim)
    arguments = [host.fake_tensor(element, (batch, options.q_len, q_heads, options.head_dim)),
                 host.fake_tensor(element, cache), host.fake_tensor(element, cache),
                 host.fake_tensor(cutlass.Int32, (batch, max_blocks)), host.fake_tensor(cutlass.Int32, (batch,))]
    if options.writes_output:
        return arguments + [host.fake_tensor(Float32, (q_heads,)) if has_sinks else None, None, None,
                            host.fake_tensor(element, (batch, options.q_len, q_heads, options.head_dim)),
                            host.fake_tensor(Float32, (batch, q_heads, options.q_len))]
    o_shape, lse_shape = partial_shapes(options, batch, kv_heads)
    return arguments + [None, host.fake_tensor(Float32, o_shape), host.fake_tensor(Float32, lse_shape)]
