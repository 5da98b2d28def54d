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
- Where the splits merge (`DecodeOptions.combine`; with "last_cta" or "cluster" one split writes the
  final O and LSE itself):
  - "kernel" (the default since it was measured): each split writes its normalised partial O (fp32, only
    the tile's real rows) and LSE, and one small CuTe kernel of our own merges them with the sinks
    (decode_combine.py: a thread per (row, 4-column chunk), every split's loads in flight at once).
    Measured on an H100 (rev 88d2e81, CUPTI per kernel, B = 1, 32 / 8 heads, D 128, Sq 1): at 1k the
    split kernel 4.00 us and the merge 1.73 (5.73 in all, against 7.94 with XLA's three-kernel merge;
    predicted 5.5-6.0), at 8k 9.57 + 2.02 = 11.58 (13.63; predicted 11.0-11.7); B = 1 1k Sq 4 8.51 ->
    6.18, B = 8 1k 12.27 -> 10.93; never slower through the API on the B = 1 / 8 rows up to 32k
    (docs/kernels.md, "Decode: the combine as one kernel").
  - "xla": the same partials merged by `combine_partials` in XLA (`xla_merge`: in stages, which XLA emits
    as three kernels of ~1.2-1.6 us each, or as one variadic reduction, measured slower still).
  - "last_cta" (measured ~1 us slower than the XLA pass, below): each split writes its partial, fences
    (device scope), and one thread adds 1 to the (batch, head tile)'s int32 counter with an acq_rel
    atomic; the CTA that sees splits - 1 is the last, zeroes the counter again, and merges every
    split's partial (just written, so read from L2) with the sinks into the final O (output dtype,
    [B, Sq, Hq, Dv]) and LSE [B, Hq, Sq]. The counters come zeroed from XLA (aliased in and out, so the
    kernel owns the buffer).
  - "cluster" (measured no faster at B = 1 and 25-45 % slower at B = 8; docs/kernels.md): the splits
    of one (batch, head tile) are one thread-block cluster (so at most MAX_CLUSTER_SPLITS of them). Each keeps its partial in its own shared memory;
    after a cluster barrier (release / acquire) every CTA merges a share of the (row, 8-column chunk)
    items, reading all the splits' partials through distributed shared memory, and writes them to the
    final O and LSE; a second barrier keeps each CTA's shared memory alive until the others have read
    it. No partial reaches global memory, no counter, no second kernel: the XLA pass is one more
    launch (~2 us of the 7.4 us step at B = 1, 1k) and the last CTA's merge a chain of L2 round trips.

  Why (B = 1, Hq / Hkv = 32 / 8, D = 128, bf16; benchmarks/results/decode_h200.json, rev d309c5e): K/V
  is 4 KiB per token (8 heads x 2 x 128 x 2 bytes): 4 MiB at 1k, 32 MiB at 8k, 128 MiB at 32k, i.e.
  1.2 / 9.9 / 39 us at 3.4 TB/s. Measured with the XLA combine: 17.9 / 26.1 / 55.8 us, so ~16-17 us
  that no read explains. The old layout wrote a partial per (split, warp) over all 16 rows: at 8k
  8 heads x 33 splits x 4 warps x 16 x 128 x 4 bytes = 8.7 MB out and back in (a quarter of the K/V
  read), then the XLA pass's kernels. Now a split's partial is its real rows only (4 at one token:
  2 KB a head), 0.5 MB at 8k, and there is one kernel. Predicted (to be measured; benchmarks/decode.py):
  B = 1: 1k 5-6.5 us (Pallas 9.2; 1.5x needs <= 6.1), 8k 12-14 us (2.4-2.8 TB/s, 72-83 % of copy),
  32k 36-43 us (3.1-3.7 TB/s), 128k 125-140 us; B = 8: 1k 12-15 us (was 23.6), 8k and up a few us
  under the old times.
  Measured (H200, rev 3e740c2, decode_h200.json, Sq = 1, page 16; fused / XLA combine): B = 1: 1k
  8.2 / 7.4 us (Pallas 9.2), 8k 15.4 / 14.3 us (2.2 / 2.4 TB/s of 3.37 copy), 32k 41.9 / 40.8, 128k
  133 / 132; B = 8: equal within 0.5 %. The gain is the split count and the warp merge (17.9 -> 7.4 us
  at 1k, 26.1 -> 14.3 at 8k); the last CTA's merge costs ~1 us more than the XLA pass, which the combine
  kernel (above) then beat by ~2 us at B = 1.
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
from fa4_jax.kernels.common import cluster_memory, masking, online_softmax
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
COMBINES = ("kernel", "xla", "last_cta", "cluster")
XLA_MERGES = ("staged", "variadic")
# The largest thread-block cluster sm_90 / sm_100 launch (16 needs the non-portable size, which the DSL
# allows on every kernel it builds); with 2 CTAs per SM one cluster of 16 spans 8 SMs of one GPC.
MAX_CLUSTER_SPLITS = 16


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
    combine: str = "kernel"   # where the splits merge: "kernel", "xla", "last_cta" or "cluster" (module docstring)
    rescale_threshold: float = 8.0
    # Load each key block's page numbers one block before its cp.async. A cp.async address needs its row's
    # block-table entry, so without it every block's issue waits for a table load (a DRAM or L2 round
    # trip) in the middle of the loop, and the prologue's stages wait for theirs one after another.
    # Measured on an H100 (c2332f0; docs/kernels.md, "Decode: page numbers one block ahead"): equal or
    # faster on all 24 rows, ~1 us at B = 1 8k and 1-2 us at B = 8 1k. False: the old order.
    page_lookahead: bool = True
    # How `combine_partials` merges the splits with combine="xla" (no change to the kernel): "staged", a max,
    # then sums, then a divide (XLA emits it as three kernels, ~1 us each at B = 1: ncu, H100, 17f1841), or
    # "variadic", one lax.reduce over the splits of (LSE, O) pairs whose combiner is the two-part softmax
    # merge. Measured slower on an H100 (rev 6f403c6: the one reduction alone 4.2 us, B = 1 1k 7.95 ->
    # 10.5 us; docs/kernels.md, "Decode: the XLA merge in one reduction"): kept off, for comparison.
    xla_merge: str = "staged"

    @property
    def rows(self) -> int:
        """Packed query rows per key/value head."""
        return self.q_len * self.group

    @property
    def writes_output(self) -> bool:
        """Whether the kernel writes the final O and LSE (else its partials, for `combine_partials` or the
        combine kernel)."""
        return self.combine in ("last_cta", "cluster")

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
        if self.xla_merge not in XLA_MERGES:
            raise ValueError(f"xla_merge must be one of {XLA_MERGES}; got {self.xla_merge!r}")
        if self.combine == "cluster" and self.num_splits > MAX_CLUSTER_SPLITS:
            raise ValueError(f"the cluster combine merges at most {MAX_CLUSTER_SPLITS} splits (one thread-block "
                             f"cluster); got {self.num_splits}")
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
                 mSemaphore: Optional[cute.Tensor], mPartialO: Optional[cute.Tensor],
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
        # The cluster combine: one cluster per (batch, head tile), its CTAs the splits (rank = split).
        cluster = {"cluster": [self.options.num_splits, 1, 1]} if self.options.combine == "cluster" else {}
        self.kernel(mQ, mK, mV, mBlockTables, mKVSeqLengths, mSinks, mSemaphore, mPartialO, mPartialLSE, mO, mLSE,
                    q_layout, kv_layout, tiled_load, load_atom, tiled_mma, SharedStorage).launch(
            grid=grid, block=[THREADS, 1, 1], stream=stream, **cluster)

    @cute.kernel
    def kernel(self, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mBlockTables: cute.Tensor,
               mKVSeqLengths: cute.Tensor, mSinks: Optional[cute.Tensor], mSemaphore: Optional[cute.Tensor],
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
        # no longer need: scratch O [warp, 16, D] fp32 over the K ring, LSE [warp, 16] over Q (and the
        # cluster combine's split partial: O [16, D] over the V ring, LSE in row WARPS of the LSE scratch).
        lse_rows = cute.make_rmem_tensor(num_rows, Float32)
        output_scale = cute.make_rmem_tensor(num_rows, Float32)
        self.softmax.finalize(row_max, row_sum, None, lse_rows, output_scale)
        online_softmax.rescale_rows(acc_o_mn, output_scale, False)
        cute.arch.sync_threads()   # every warp is done reading the ring
        warp_o = storage.s_k.get_tensor(cute.make_ordered_layout((WARPS, TILE_M, self.head_dim), order=(2, 1, 0)),
                                        dtype=Float32)
        scratch_lse = storage.s_q.get_tensor(cute.make_ordered_layout((WARPS + 1, TILE_M), order=(1, 0)),
                                             dtype=Float32)
        split_o = storage.s_v.get_tensor(cute.make_ordered_layout((TILE_M, self.head_dim), order=(1, 0)),
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
        combine, splits = self.options.combine, self.options.num_splits
        warp_lse = lambda w, row: scratch_lse[w, row]
        warp_chunk = lambda w, row, chunk: cute.local_tile(warp_o[w, row, None], (CHUNK,), (chunk,)).load()
        for p in cutlass.range_constexpr(-(-TILE_M // rows_per_pass)):
            row = p * rows_per_pass + tidx // chunks
            if row < rows_here:
                if cutlass.const_expr(self.options.writes_output and splits == 1):
                    lse = self.merge(warp_lse, warp_chunk, WARPS, row, chunk,
                                     self.sink(mSinks, head_kv, packed_start + row), values)
                    self.store_output(mO, mLSE, values, lse, batch_index, head_kv, packed_start + row, chunk)
                else:
                    lse = self.merge(warp_lse, warp_chunk, WARPS, row, chunk, None, values)
                    if cutlass.const_expr(combine == "cluster"):
                        cute.local_tile(split_o[row, None], (CHUNK,), (chunk,)).store(values.load())
                        if chunk == 0:
                            scratch_lse[WARPS, row] = lse
                    else:
                        g_o = cute.local_tile(mPartialO[batch_index, head_tile, split, row, None], (CHUNK,), (chunk,))
                        g_o.store(values.load())
                        if chunk == 0:
                            mPartialLSE[batch_index, head_tile, split, row] = lse

        if cutlass.const_expr(combine == "last_cta" and splits > 1):
            # The last CTA of this (batch, head tile) to arrive merges every split's partial (written
            # just before, so in L2). Release: each thread's partial stores are ordered before thread
            # 0's atomic by its own fence and the barrier; acquire: the atomic's and the fence after it.
            cute.arch.fence_acq_rel_gpu()
            cute.arch.sync_threads()
            arrived = storage.s_v.get_tensor(cute.make_layout(1), dtype=Int32)
            if tidx == 0:
                counter = cute.make_ptr(Int32, _element_address(mSemaphore, (batch_index, head_tile)),
                                        cute.AddressSpace.gmem, assumed_align=4)
                arrived[0] = cute.arch.atomic_add(counter, Int32(1), sem="acq_rel", scope="gpu")
            cute.arch.sync_threads()
            if arrived[0] == splits - 1:
                cute.arch.fence_acq_rel_gpu()
                if tidx == 0:
                    # Every split has arrived: zero the counter for the next call on this buffer.
                    mSemaphore[batch_index, head_tile] = Int32(0)
                split_o_global = mPartialO[batch_index, head_tile, None, None, None]
                split_lse_global = mPartialLSE[batch_index, head_tile, None, None]
                global_lse = lambda q, r: split_lse_global[q, r]
                global_chunk = lambda q, r, c: cute.local_tile(split_o_global[q, r, None], (CHUNK,), (c,)).load()
                for p in cutlass.range_constexpr(-(-TILE_M // rows_per_pass)):
                    row = p * rows_per_pass + tidx // chunks
                    if row < rows_here:
                        lse = self.merge(global_lse, global_chunk, splits, row, chunk,
                                         self.sink(mSinks, head_kv, packed_start + row), values)
                        self.store_output(mO, mLSE, values, lse, batch_index, head_kv, packed_start + row, chunk)

        if cutlass.const_expr(combine == "cluster" and splits > 1):
            # Every split's partial is in its CTA's shared memory once the cluster barrier completes (its
            # arrive releases this CTA's writes, its wait acquires the others'). The (row, chunk) items go
            # to CTA `item % splits` (the rank: the cluster spans the grid's split axis), so each CTA
            # merges a 1 / splits share, every split's part read through distributed shared memory.
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
            remote_lse = lambda q, r: cluster_memory.load_f32(scratch_lse.iterator + (WARPS * TILE_M + r), q)
            remote_chunk = lambda q, r, c: self.remote_chunk(split_o, q, r, c)
            for p in cutlass.range_constexpr(-(-TILE_M * chunks // (THREADS * splits))):
                item = (p * THREADS + tidx) * splits + split
                row = item // chunks
                if row < rows_here:
                    lse = self.merge(remote_lse, remote_chunk, splits, row, item % chunks,
                                     self.sink(mSinks, head_kv, packed_start + row), values)
                    self.store_output(mO, mLSE, values, lse, batch_index, head_kv, packed_start + row, item % chunks)
            # No CTA may exit (and free its shared memory) while another may still read its partial.
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    def remote_chunk(self, split_o: cute.Tensor, rank: Int32, row: Int32, chunk: Int32):
        """Columns [8 chunk, 8 chunk + 8) of row `row` of cluster rank `rank`'s split_o (fp32 [16, D] in
        its shared memory), as two 16-byte loads."""
        fragment = cute.make_rmem_tensor(CHUNK, Float32)
        start = split_o.iterator + (row * self.head_dim + chunk * CHUNK)
        for half in range(CHUNK // 4):   # plain Python loops: this helper is traced, not preprocessed
            quad = cluster_memory.load_f32x4(start + 4 * half, rank)
            for i in range(4):
                fragment[4 * half + i] = quad[i]
        return fragment.load()

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
        LSE of a row (natural log), part_chunk(p, row, chunk) the 8 values of its normalised partial O:
        a warp's in shared memory, a split's in global memory or in its CTA's shared memory."""
        top = -Float32.inf
        if cutlass.const_expr(sink is not None):
            top = sink
        # Unrolled wide so that many parts' loads are in flight at once: the last CTA's merge is a
        # chain of L2 round trips, one per unrolled group (32 splits: 1 + 4 of them).
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
    tuning sweeps: tile_n, num_stages, num_splits, combine) go on top of the defaults; with
    combine="cluster" the splits are chosen among at most MAX_CLUSTER_SPLITS (one cluster)."""
    page_size = problem.page_size if problem.page_size is not None else problem.kv_len
    tile_n, stages = _TILE_N_AND_STAGES[problem.head_dim]
    tile_n, stages = overrides.get("tile_n", tile_n), overrides.get("num_stages", stages)
    row_tiles = -(-problem.q_len * problem.group // TILE_M)
    per_cta = _shared_memory_bytes(problem.head_dim, tile_n, stages)
    # With a symbolic batch (jax.export) the splits are sized for one sequence: correct for any batch.
    batch = problem.batch if isinstance(problem.batch, int) else 1
    num_splits = choose_num_splits(batch, problem.kv_heads, row_tiles, problem.kv_len, tile_n,
                                   host.sm_count(DEFAULT_SM_COUNT) if sm_count is None else sm_count,
                                   max(1, SHARED_MEMORY_LIMIT // per_cta),
                                   MAX_CLUSTER_SPLITS if overrides.get("combine") == "cluster" else MAX_SPLITS)
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


def semaphore_shape(options: DecodeOptions, batch: int, kv_heads: int):
    """The last-CTA combine's arrival counters: one int32 per (batch, head tile), zero between calls."""
    return (batch, kv_heads * options.row_tiles)


def combine_options(options: DecodeOptions, has_sinks: bool) -> decode_combine.CombineOptions:
    """The combine kernel's options (its compile key) for merging the partials of `options`' kernel."""
    return decode_combine.CombineOptions(dtype_name=options.dtype_name, head_dim=options.head_dim,
                                         group=options.group, q_len=options.q_len, num_splits=options.num_splits,
                                         tile_rows=TILE_M, has_sinks=has_sinks)


def combine_partials(options: DecodeOptions, partial_o, partial_lse, sinks, batch: int, kv_heads: int):
    """Merge the split partials in XLA (the path with combine="xla"): out [B, Sq, Hq, D] float32,
    lse [B, Hq, Sq].

    lse = log(sum_p exp(lse_p) + exp(sink)); out = sum_p exp(lse_p - lse) O_p, a row whose every
    partial is -inf (and sink too) gets out 0, lse -inf; in stages or as one reduction (`options.xla_merge`).
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
    if options.xla_merge == "variadic":
        out, lse = _merge_in_one_reduction(lse_parts, o_parts, sink_rows)
    else:
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


def _merge_two(first, second):
    """The softmax merge of two (LSE, O) parts, elementwise: lse = log(e^a + e^b), O = e^(a - lse) O_a +
    e^(b - lse) O_b; two empty parts (-inf) merge to (-inf, 0). (-inf, 0) is its identity, and it is
    associative and commutative up to rounding, as a reduction's combiner must be."""
    (lse_a, o_a), (lse_b, o_b) = first, second
    top = jnp.maximum(lse_a, lse_b)
    shift = jnp.where(top == -jnp.inf, 0.0, top)
    weight_a, weight_b = jnp.exp(lse_a - shift), jnp.exp(lse_b - shift)
    total = weight_a + weight_b
    has_mass = total > 0
    safe_total = jnp.where(has_mass, total, 1.0)
    return (jnp.where(has_mass, shift + jnp.log(safe_total), -jnp.inf),
            (weight_a * o_a + weight_b * o_b) / safe_total)


def _merge_in_one_reduction(lse_parts, o_parts, sink_rows):
    """`_merge_in_stages`'s result from one variadic lax.reduce over the parts' axis (one kernel where the
    staged form is three): each part's LSE broadcast along D next to its O, the sink one more part of O 0."""
    lse_wide = jnp.broadcast_to(lse_parts[..., None], o_parts.shape)
    if sink_rows is not None:
        sink_part = jnp.broadcast_to(sink_rows[:, :, None, :, None],
                                     (o_parts.shape[0], o_parts.shape[1], 1) + o_parts.shape[3:])
        lse_wide = jnp.concatenate([lse_wide, sink_part], axis=2)
        o_parts = jnp.concatenate([o_parts, jnp.zeros_like(sink_part)], axis=2)
    lse, out = jax.lax.reduce((lse_wide, o_parts), (jnp.float32(-jnp.inf), jnp.float32(0.0)), _merge_two, (2,))
    return out, lse[..., 0]


def run(options: DecodeOptions, query, key_cache, value_cache, block_tables, kv_seq_lengths, sinks=None):
    """(out [B, Sq, Hq, D] in the query dtype, lse [B, Hq, Sq] float32), traceable under jax.jit."""
    batch, q_len, q_heads, _ = query.shape
    kv_heads = key_cache.shape[2]
    o_shape, lse_shape = partial_shapes(options, batch, kv_heads)
    partials = [jax.ShapeDtypeStruct(o_shape, jnp.float32), jax.ShapeDtypeStruct(lse_shape, jnp.float32)]
    final = [jax.ShapeDtypeStruct((batch, q_len, q_heads, options.head_dim), query.dtype),
             jax.ShapeDtypeStruct((batch, q_heads, q_len), jnp.float32)]
    # The kernel's operands: query, caches, tables, lengths, sinks, semaphore, then its outputs.
    arguments = [query, key_cache, value_cache, block_tables, kv_seq_lengths, None, None]
    aliases = None
    if not options.writes_output:   # "xla" and "kernel": the partials, merged below
        outputs = partials
    elif options.combine == "last_cta":
        # The counters are zeroed here and left zero by the kernel; aliased to an output so that
        # XLA hands the kernel a buffer of its own to count in.
        semaphore = jnp.zeros(semaphore_shape(options, batch, kv_heads), jnp.int32)
        arguments[5:] = [sinks, semaphore]
        aliases = {6: 0}
        outputs = [jax.ShapeDtypeStruct(semaphore.shape, jnp.int32), *partials, *final]
    else:   # "cluster": no counter and no partial in global memory (absent operands take no buffer)
        arguments[5:] = [sinks, None, None, None]
        outputs = final
    kernel = _kernel(options)
    results = host.call_kernel(kernel, tuple(arguments), tuple(outputs), (str(kernel), options), aliases)
    if options.writes_output:
        return results[-2], results[-1]
    if options.combine == "kernel":
        return decode_combine.run(combine_options(options, sinks is not None), results[0], results[1], sinks)
    out, lse = combine_partials(options, results[0], results[1], sinks, batch, kv_heads)
    return out.astype(query.dtype), lse


def fake_arguments(options: DecodeOptions, batch: int, kv_heads: int, num_blocks: int, max_blocks: int,
                   has_sinks: bool = False) -> list:
    """Fake tensors in the kernel's argument order, for compiling without a GPU: (query, key and value
    caches, block tables, lengths, sinks or None, semaphore or None, partial O or None, partial LSE or
    None[, out, lse])."""
    element = host.cutlass_dtype(options.dtype_name)
    q_heads = kv_heads * options.group
    o_shape, lse_shape = partial_shapes(options, batch, kv_heads)
    cache = (num_blocks, options.page_size, kv_heads, options.head_dim)
    writes_output, cluster = options.writes_output, options.combine == "cluster"
    arguments = [host.fake_tensor(element, (batch, options.q_len, q_heads, options.head_dim)),
                 host.fake_tensor(element, cache), host.fake_tensor(element, cache),
                 host.fake_tensor(cutlass.Int32, (batch, max_blocks)), host.fake_tensor(cutlass.Int32, (batch,)),
                 host.fake_tensor(Float32, (q_heads,)) if writes_output and has_sinks else None,
                 host.fake_tensor(cutlass.Int32, semaphore_shape(options, batch, kv_heads))
                 if options.combine == "last_cta" else None,
                 None if cluster else host.fake_tensor(Float32, o_shape),
                 None if cluster else host.fake_tensor(Float32, lse_shape)]
    if writes_output:
        arguments += [host.fake_tensor(element, (batch, options.q_len, q_heads, options.head_dim)),
                      host.fake_tensor(Float32, (batch, q_heads, options.q_len))]
    return arguments
