"""Hopper (sm_90a) attention forward kernel in CuTe DSL, and its JAX entry points.

Design (one CTA = one 128-row query tile at a time, persistent over tiles):
- warpgroup 0, the producer: after giving registers back (setmaxnreg), its first warp issues TMA
  loads: the Q tile once per work tile, then K and V blocks into a `num_stages`-deep ring of shared
  memory buffers, each guarded by a full/empty mbarrier pair (PipelineTmaAsync);
- warpgroups 1 and 2, the consumers, each own 64 query rows: S = Q K^T with wgmma from shared memory,
  masking of partial key blocks only, online softmax in the exp2 domain (scale folded into one FMA,
  lazy rescaling), P converted to bf16/fp16 in registers, O += P V with wgmma taking A from
  registers; then O is normalised and written, with LSE [B, Hq, Sq] in float32.
- key blocks are walked from the last visible one down to the first; blocks that no query row of the
  tile can see (causal, window, lengths) are never loaded.
- the persistent grid walks tiles through fa4_jax.kernels.tile_scheduler (causal: mirrored units, a
  query block and its mirror of one head back to back).
- packed variable-length sequences (attention_varlen, `KernelOptions.packed`): B = 1 and the tiles
  are tile_scheduler.packed_item's slots over (sequence, query block, head), the sequence found at run
  time from cu_seqlens (one compile serves every packing); Q, K, V tiles are TMA loads from the
  sequence's own first row (a domain offset of the TMA coordinates), keys past the sequence's end
  are masked like a padded batch's, and O / LSE go out by per-row stores clipped at the sequence's
  end (the TMA-store epilogue would write into the next sequence). Slots past a sequence's last block
  are skipped by both roles.

Grouped-query attention maps query head h to key/value head h // (Hq / Hkv).

Head dims: D = Dv in SUPPORTED_HEAD_DIMS, and DeepSeek MLA's D = 192 with Dv = 128
(EXTRA_HEAD_DIM_PAIRS): V, the P V MMA, the O accumulator and the epilogue are sized by Dv throughout,
Q, K and Q K^T by D, so MLA runs at its own dims (1.2x fewer FLOPs than padding V to 192, and a third
less V traffic and V buffer).

D = 80 (Phi-2-class models) runs at its own dims too, instead of zero-padded to 96 (1.2x the FLOPs and
padded copies of Q, K, V): Q K^T is m64n128k16 and P V m64n80k16 wgmma. Its rows are 160 bytes, which
no 64- or 128-byte swizzle atom tiles, so `wgmma.k_major_layout` (the widest atom that divides the
row, hopper_helpers.get_smem_layout_atom) gives Q, K, V and the O staging buffer the 32-byte swizzle
(Swizzle<1,4,3> on byte addresses, atoms of 8 rows x 16 columns) where D = 96 takes the 64-byte and
D = 128 the 128-byte one. Every 8-row x 16-byte core matrix, as wgmma reads it (K-major for Q and K,
MN-major for V through `transpose_view`) and stmatrix writes it, still falls on 8 distinct 16-byte bank
groups: no bank conflicts (docs/sm90_forward_tuning.md, "D = 80 without padding"). What the narrow
atom costs is TMA boxes: a 128 x 80 tile loads as 5 boxes of 16 columns (32-byte rows, one sector
each; D = 96 takes 3, D = 128 2) and each warpgroup's O stores as 5. TMA, wgmma and stmatrix all take
the layout from the same object, so the swizzle choice changes speed, never values.

Tuning options (KernelOptions). The field defaults are the first H200-verified configuration;
`options` picks, per head dim, mask and query length, the combination that measured fastest
(benchmarks/results/forward_variants_h200.json, docs/sm90_forward_tuning.md):
- consumer_warpgroups=3: a 192-row query tile, three consumers taking turns on the tensor cores;
- q_stages=2: two Q buffers, so the next tile's Q loads while this tile computes;
- early_q_release: Q's buffer is released after the tile's last Q K^T (not after its last P V and
  the softmax before it), so the next tile's Q load starts one block earlier (any head dim, no
  extra shared memory);
- split_masked_loop: the key loop runs as up to three loops (masked blocks, blocks with no masking
  code, masked blocks) instead of deciding per block at run time (where it decides, ptxas waits for the
  in-flight P V before the softmax instead of running the two together: docs/sm90_forward_tuning.md,
  "Seventh round");
- schedule_first_block: a tile's first Q K^T also takes its turn at the ping-pong barriers, so the
  consumers start a tile half a step apart instead of all doing their first softmax at once;
- tma_store: O goes registers -> shared memory (stmatrix) -> global memory by TMA store, per
  warpgroup, the store running on while the next tile computes;
- store_chunks: the TMA-store epilogue writes O in this many column chunks through one buffer of
  Dv / store_chunks columns per warpgroup (a 32 KB buffer at D = 256, which fits next to Q, K, V
  where the full 64 KB does not);
- pingpong_max_head_dim: the largest head dim that uses the ping-pong scheduler barriers;
- zigzag_tiles: the persistent CTAs take their tiles in alternating order, wave by wave
  (tile_scheduler.zigzag_tile), so with longest-first causal tiles no CTA gets the longest tile of
  every wave;
- mirrored_tiles (causal, not packed): each CTA runs a query block and its mirror of the same head back
  to back (tile_scheduler.mirrored_tile), work units of equal length in head order, instead of the
  longest-first order over all heads (whose waves read a different head's K / V per CTA from DRAM);
  zigzag_tiles does not apply to it;
- key_block: keys per K / V block instead of the head dim's default (D = 192: 96 -> 112 fills the
  shared memory FA3 fills there, 16 % fewer blocks per tile for the same per-block overheads);
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
from cutlass.tensor_utils import LayoutEnum

from fa4_jax.config import AttentionConfig
from fa4_jax.kernels import host
from fa4_jax.kernels.common import masking, online_softmax, tile_scheduler
from fa4_jax.kernels.common.dsl_idioms import advanced, select_modes
from fa4_jax.kernels.common.softcap import apply_softcap
from fa4_jax.kernels.sm90 import DEFAULT_SM_COUNT, wgmma

SUPPORTED_HEAD_DIMS = (64, 80, 96, 128, 192, 256)
# (D, Dv) pairs taken besides D = Dv (fa4_jax/lowering/cuda.py's route lists the same): DeepSeek MLA.
# The key tile and stages are D's (_TILE_N_AND_STAGES).
EXTRA_HEAD_DIM_PAIRS = ((192, 128),)
ROWS_PER_WARPGROUP = 64  # one wgmma M
# (producer, consumer) registers per thread after setmaxnreg, by number of consumer warpgroups: the
# total stays within the 64K register file (24 * 128 + 240 * 256 = 24 * 128 + 160 * 384 = 64512).
REGISTERS = {2: (24, 240), 3: (24, 160)}
SHARED_MEMORY_LIMIT = 227 * 1024  # bytes per CTA on sm_90
SCHEDULER_BARRIER = 1  # named barriers 1.. (one per consumer warpgroup; 0 is __syncthreads)
EPILOGUE_BARRIER = 4   # named barriers 4..6: one per consumer warpgroup, for the TMA-store epilogue

# (key tile, pipeline stages) per head dim, sized to fit 227 KiB of shared memory and 240 registers.
# D = 80 takes D = 96's (141 KB with the Q double buffer and the O buffer; unmeasured beyond that).
_TILE_N_AND_STAGES = {64: (128, 3), 80: (128, 2), 96: (128, 2), 128: (128, 2), 192: (96, 2), 256: (64, 2)}


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """Everything static about one compiled kernel (hashable: it is the compile key)."""

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
    num_sequences: Optional[int]  # packed variable-length sequences: N (cu_seqlens of N + 1); None: not packed
    sm_count: int
    rescale_threshold: float = 8.0
    poly_exp2_every: int = 0
    # Tuning options (module docstring); the defaults are the GPU-verified configuration.
    consumer_warpgroups: int = 2
    q_stages: int = 1
    tma_store: bool = False
    store_chunks: int = 1
    pingpong_max_head_dim: int = 128
    early_q_release: bool = False
    split_masked_loop: bool = False
    schedule_first_block: bool = False
    zigzag_tiles: bool = False
    mirrored_tiles: bool = False
    key_block: int = 0  # keys per K/V block; 0: the head dim's default (_TILE_N_AND_STAGES)

    @property
    def tile_m(self) -> int:
        return ROWS_PER_WARPGROUP * self.consumer_warpgroups

    @property
    def packed(self) -> bool:
        return self.num_sequences is not None

    @property
    def tile_n(self) -> int:
        return self.key_block or _TILE_N_AND_STAGES[self.head_dim][0]

    @property
    def num_stages(self) -> int:
        return _TILE_N_AND_STAGES[self.head_dim][1]

    def shared_memory_bytes(self) -> int:
        """Shared memory one CTA needs: Q, K, V (and O) buffers, each 1024-byte aligned, and mbarriers."""
        def aligned(elements):
            return -(-2 * elements // 1024) * 1024
        barriers = 8 * (2 * self.q_stages + 4 * self.num_stages)
        total = barriers + aligned(self.tile_m * self.head_dim * self.q_stages)
        total += aligned(self.tile_n * self.head_dim * self.num_stages)
        total += aligned(self.tile_n * self.v_head_dim * self.num_stages)
        if self.tma_store:
            total += aligned(self.tile_m * self.v_head_dim // self.store_chunks)
        return total + 1024  # the first buffer's alignment after the barriers

    def check(self):
        """Raise ValueError when these options cannot make a kernel (registers, wgmma shape, shared memory)."""
        if self.consumer_warpgroups not in REGISTERS:
            raise ValueError(f"consumer_warpgroups must be one of {sorted(REGISTERS)}")
        if self.consumer_warpgroups == 3 and self.v_head_dim > 64:
            # 160 registers per consumer thread: ptxas spills from Dv = 96 on (seen with ptxas 13.0).
            raise ValueError("three consumer warpgroups fit in registers only for value head dims <= 64")
        if self.store_chunks > 1 and self.v_head_dim % (64 * self.store_chunks):
            raise ValueError(f"store_chunks {self.store_chunks}: each chunk must be a multiple of 64 columns "
                             f"(one 128-byte swizzle atom) of Dv = {self.v_head_dim}")
        if self.key_block and (self.key_block % 16 or not 16 <= self.key_block <= 256):
            # The key block is P V's K dimension (k16 steps) and Q K^T's N (at most 256).
            raise ValueError(f"key_block {self.key_block} must be a multiple of 16 in [16, 256]")
        if self.q_stages not in (1, 2):
            raise ValueError("q_stages must be 1 or 2")
        if self.packed and self.tma_store:
            # The TMA unit clips a store at the array's end only: a tile's rows past its sequence's
            # end would overwrite the next sequence's rows.
            raise ValueError("packed sequences store O with per-row predicated stores, not the TMA-store epilogue")
        if self.packed and self.mirrored_tiles:
            # The mirror of a query block is M - 1 - m of a static M; a packed sequence's blocks are slots.
            raise ValueError("mirrored_tiles walks the query blocks of the static Sq; packed sequences take "
                             "their slots in sequence order")
        if self.shared_memory_bytes() > SHARED_MEMORY_LIMIT:
            raise ValueError(f"{self.shared_memory_bytes()} bytes of shared memory needed, "
                             f"{SHARED_MEMORY_LIMIT} available")


# The measured winners (H200, docs/sm90_forward_tuning.md), applied by `options`.
# D = 64: three consumer warpgroups with every pipeline option ("wg3-all", 1.06-1.17x cuDNN).
THREE_WARPGROUPS = {"consumer_warpgroups": 3, "q_stages": 2, "tma_store": True, "early_q_release": True,
                    "split_masked_loop": True, "schedule_first_block": True}
# D = 64 causal short queries (and D = 64 with a softcap, window or segments), and D = 96 / 128:
# Q double buffer + TMA-store epilogue ("q2-tma"), with the split key loop where `_measured_overrides` says.
# D = 80 takes the same sets as 96 / 128 (`_measured_overrides`, head_dim <= 128), not measured at 80 itself.
Q_DOUBLE_BUFFER_TMA_STORE = {"q_stages": 2, "tma_store": True}
# D = 256 causal: the TMA-store epilogue in two column chunks with early Q release
# ("early-q-store-chunks", 0.75 -> 0.88x cuDNN at S = 1k, 0.91 -> 1.01x at 2k) and, for D = 128 and
# 256 causal, the zigzag tile order (D = 256 4k: 0.99 -> 1.11x, D = 128 4k: 1.00 -> 1.08x, 2k +1 %).
LARGE_HEAD_CAUSAL = {"pingpong_max_head_dim": 256, "tma_store": True, "store_chunks": 2,
                     "early_q_release": True, "zigzag_tiles": True}
# D = 256 full: causal's set less the zigzag order (ninth round, an H100, rev 3e69f08: 1k 0.95 -> 1.14x cuDNN,
# 2k 1.01 -> 1.12x). Without the ping-pong barriers it measured the same (1.14 / 1.12x); one set for both masks.
LARGE_HEAD_FULL = {key: value for key, value in LARGE_HEAD_CAUSAL.items() if key != "zigzag_tiles"}
# D = 192 (fourth sweep, rev 74443c7): ping-pong turns and the TMA-store epilogue in three 64-column
# chunks with early Q release (full 2k: 0.99 -> 1.05x cuDNN), with the zigzag order and the split key
# loop when causal (2k 0.85 -> 0.96x, 8k 0.97 -> 1.10x). MLA's Dv = 128 takes the same sets with MLA's
# blocks and store chunks on top (`_measured_overrides`).
D192 = {"pingpong_max_head_dim": 256, "tma_store": True, "store_chunks": 3, "early_q_release": True}
# MLA (D = 192, Dv = 128) on top of D = 192's sets: 128-key blocks with the O store in two 64-column
# chunks (Q 48 KB, K 2 x 48 KB, V 2 x 32 KB, O 16 KB: 225 of the 227 KB). Measured as candidate mla-n128
# in two sweeps (H100, rev 6d8d911 and 4db1efb): full 8k +3.5 % both times, causal 2k +0.3 % then +10.5 %
# (the second on the mirrored tile order); docs/sm90_forward_tuning.md. Not for packed sequences yet.
MLA = {"key_block": 128, "store_chunks": 2}
D192_CAUSAL = dict(D192, zigzag_tiles=True, split_masked_loop=True)
# D = 64 causal: two consumer warpgroups below this query length, three from it. With the all-pairs order
# wg3-all was 8 % slower than q2-tma at Sq = 1024 and 8 % faster at 2048 (cut 1472); with the mirrored order
# and the split key loop two groups were 5 % faster at 2048 and three 10 % faster at 4096 (ninth round, an
# H100, rev 3e69f08): the cut at the geometric middle of 2048 and 4096, rounded up to a multiple of 64.
THREE_WARPGROUPS_MIN_CAUSAL_Q_LEN = 2944

# Candidate tunings on top of `options`, measured against it by `benchmarks/attention.py
# --variants` and checked against the oracle by tests/test_sm90_forward.py (docs/sm90_forward_tuning.md
# has the predictions): name -> (KernelOptions overrides, head dims, causal settings) it is meant for;
# a head dim is D (with Dv = D) or a (D, Dv) pair (`candidate_head_dim_pairs`).
TUNING_CANDIDATES: dict = {
    # D = 192: 112-key blocks (FA3's 128 x 112 tile, 222 KB of shared memory) on top of ping-pong; no room
    # for the TMA-store buffer next to them. Full 8k +1 % over the 96-key blocks, causal 2k -9 % (the
    # fourth sweep): kept to be measured against the promoted set.
    "d192-n112-pingpong": ({"key_block": 112, "pingpong_max_head_dim": 256, "tma_store": False, "store_chunks": 1},
                           (192,), (False,)),
    # D = 64: every 4th / 8th score of a row exponentiated on the FMA pipe (common/exp2_polynomial.py,
    # now a floor by rounded add: no conversion-pipe instruction). At D = 64 a score costs 256 MMA
    # FLOPs, 16 scores per clock per SM, exactly MUFU's exp2 rate, so the exp2 unit is as busy as the
    # tensor cores; a quarter of the scores moved off it leaves it 25 % of slack.
    "d64-poly4": ({"poly_exp2_every": 4}, (64,), (False, True)),
    "d64-poly8": ({"poly_exp2_every": 8}, (64,), (False, True)),
    # Causal: the longest-first order over all (batch, head) pairs (with the zigzag waves where tuned), as
    # before `options` chose the mirrored order: kept as the baseline it is measured against
    # (docs/sm90_forward_tuning.md, fifth round).
    "all-pairs-order": ({"mirrored_tiles": False}, (64, 128, 192, 256, (192, 128)), (True,)),
    # D = 64 causal: the warp-group count on the other side of THREE_WARPGROUPS_MIN_CAUSAL_Q_LEN (each is
    # the default on one side, so each is a no-op on the other). The cut was measured with the
    # all-pairs order (three groups 8 % slower at 1k, 8 % faster at 2k); the mirrored order changes what
    # a tile waits for, and hopper_vs_peers read D = 64 causal 2k 4 % slower with it (0.98 -> 0.94x). Two
    # groups take the split key loop as the short default does since the seventh round; the one loop in two
    # groups was 2 % faster than three groups at 2k there (an H100).
    "d64-causal-two-warpgroups": ({"consumer_warpgroups": 2, "early_q_release": False, "split_masked_loop": True,
                                   "schedule_first_block": False}, (64,), (True,)),
    "d64-causal-three-warpgroups": (dict(THREE_WARPGROUPS), (64,), (True,)),
}


def candidate_head_dim_pairs(head_dims) -> tuple:
    """A TUNING_CANDIDATES entry's head dims as (D, Dv) pairs."""
    return tuple(head_dim if isinstance(head_dim, tuple) else (head_dim, head_dim) for head_dim in head_dims)


def _shared_storage_struct(dtype, q_stages: int, kv_stages: int, q_elements: int, k_elements: int,
                           v_elements: int, o_elements: Optional[int]):
    """The CTA's shared storage: a full/empty mbarrier pair per pipeline stage, then the Q, K, V (and,
    with the TMA-store epilogue, O) buffers, each 1024-byte aligned for the 128-byte swizzle."""
    fields = {
        "q_barriers": cute.struct.MemRange[cutlass.Int64, 2 * q_stages],
        "k_barriers": cute.struct.MemRange[cutlass.Int64, 2 * kv_stages],
        "v_barriers": cute.struct.MemRange[cutlass.Int64, 2 * kv_stages],
        "s_q": cute.struct.Align[cute.struct.MemRange[dtype, q_elements], 1024],
        "s_k": cute.struct.Align[cute.struct.MemRange[dtype, k_elements], 1024],
        "s_v": cute.struct.Align[cute.struct.MemRange[dtype, v_elements], 1024],
    }
    if o_elements is not None:
        fields["s_o"] = cute.struct.Align[cute.struct.MemRange[dtype, o_elements], 1024]
    return cute.struct(type("SharedStorage", (), {"__annotations__": fields}))


class Sm90ForwardKernel:
    """Warp-specialised TMA + wgmma attention forward for one static configuration."""

    def __str__(self):
        # The DSL names the compiled kernel after str(self): a fixed name instead of the default
        # repr (module path and address), so profiles show it and moving the class renames nothing.
        return "fa4_jax_sm90_forward"

    def __init__(self, options: KernelOptions):
        options.check()
        self.options = options
        self.dtype = host.cutlass_dtype(options.dtype_name)
        self.head_dim = options.head_dim
        self.v_head_dim = options.v_head_dim
        self.consumer_warpgroups = options.consumer_warpgroups
        self.tile_m = options.tile_m
        self.tile_n = options.tile_n
        self.num_stages = options.num_stages
        self.q_stages = options.q_stages
        self.store_columns = options.v_head_dim // options.store_chunks
        self.mask = options.mask
        self.threads = wgmma.WARP_GROUP * (1 + self.consumer_warpgroups)
        self.consumer_threads = wgmma.WARP_GROUP * self.consumer_warpgroups
        self.producer_registers, self.consumer_registers = REGISTERS[self.consumer_warpgroups]
        self.pingpong = options.head_dim <= options.pingpong_max_head_dim
        # With segments every block is masked: there is no unmasked middle to split off.
        self.split_masked_loop = options.split_masked_loop and not options.mask.has_segments
        # Only a right reach makes the visible key range end earlier for a tile's first rows.
        # With a softcap the logits are capped before the softmax, so the exp2 scale is just log2(e).
        logit_scale = 1.0 if options.softcap is not None else options.scale
        self.scale_log2 = logit_scale * online_softmax.LOG2_E
        self.softmax = online_softmax.OnlineSoftmax(
            self.scale_log2, rescale_threshold=options.rescale_threshold,
            poly_exp2_every=options.poly_exp2_every)

    # ----------------------------------------------------------------------------------------------
    # Host side: layouts, TMA atoms, shared storage, launch.
    @cute.jit
    def __call__(self, stream: cuda.CUstream, mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor,
                 mSinks: Optional[cute.Tensor], mQSegmentIds: Optional[cute.Tensor],
                 mKVSegmentIds: Optional[cute.Tensor], mQSeqLengths: Optional[cute.Tensor],
                 mKVSeqLengths: Optional[cute.Tensor], mQStart: Optional[cute.Tensor],
                 mCuSeqlensQ: Optional[cute.Tensor], mCuSeqlensK: Optional[cute.Tensor],
                 mO: cute.Tensor, mLSE: cute.Tensor):
        # [B, S, H, D] -> (S, D, H, B): the tile modes first, as TMA and wgmma partitioning expect.
        mQ, mK, mV, mO = [select_modes(t, [1, 3, 2, 0]) for t in (mQ, mK, mV, mO)]
        mLSE = select_modes(mLSE, [2, 1, 0])  # (Sq, Hq, B)
        mQSegmentIds = None if cutlass.const_expr(mQSegmentIds is None) else select_modes(mQSegmentIds, [1, 0])
        mKVSegmentIds = None if cutlass.const_expr(mKVSegmentIds is None) else select_modes(mKVSegmentIds, [1, 0])

        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.K,
            Float32, atom_layout_mnk=(self.consumer_warpgroups, 1, 1), tiler_mn=(64, self.tile_n))
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN,
            Float32, atom_layout_mnk=(self.consumer_warpgroups, 1, 1), tiler_mn=(64, self.v_head_dim),
            a_source=warpgroup.OperandSource.RMEM)

        q_layout = wgmma.k_major_layout(self.dtype, self.tile_m, self.head_dim,
                                None if cutlass.const_expr(self.q_stages == 1) else self.q_stages)
        k_layout = wgmma.k_major_layout(self.dtype, self.tile_n, self.head_dim, self.num_stages)
        v_layout = wgmma.k_major_layout(self.dtype, self.tile_n, self.v_head_dim, self.num_stages)

        load_op = cpasync.CopyBulkTensorTileG2SOp()
        q_tile_layout = q_layout if cutlass.const_expr(self.q_stages == 1) else cute.select(q_layout, mode=[0, 1])
        tma_q, tma_m_q = cpasync.make_tiled_tma_atom(load_op, mQ, q_tile_layout, (self.tile_m, self.head_dim))
        tma_k, tma_m_k = cpasync.make_tiled_tma_atom(
            load_op, mK, cute.select(k_layout, mode=[0, 1]), (self.tile_n, self.head_dim))
        tma_v, tma_m_v = cpasync.make_tiled_tma_atom(
            load_op, mV, cute.select(v_layout, mode=[0, 1]), (self.tile_n, self.v_head_dim))
        self.q_bytes = cute.size_in_bytes(self.dtype, q_tile_layout)
        self.k_bytes = cute.size_in_bytes(self.dtype, cute.select(k_layout, mode=[0, 1]))
        self.v_bytes = cute.size_in_bytes(self.dtype, cute.select(v_layout, mode=[0, 1]))

        # TMA-store epilogue: one (64, Dv) shared buffer and one TMA store per consumer warpgroup, and a
        # one-warpgroup MMA whose C partition says where each thread's O values sit in that buffer.
        o_layout = None
        tma_o = None
        tma_m_o = None
        tiled_mma_epilogue = None
        if cutlass.const_expr(self.options.tma_store):
            o_layout = wgmma.k_major_layout(self.dtype, ROWS_PER_WARPGROUP, self.store_columns, self.consumer_warpgroups)
            tma_o, tma_m_o = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), mO, cute.select(o_layout, mode=[0, 1]),
                (ROWS_PER_WARPGROUP, self.store_columns))
            tiled_mma_epilogue = sm90_utils.make_trivial_tiled_mma(
                self.dtype, self.dtype, cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN,
                Float32, atom_layout_mnk=(1, 1, 1), tiler_mn=(64, self.store_columns),
                a_source=warpgroup.OperandSource.RMEM)

        self.shared_storage = _shared_storage_struct(
            self.dtype, self.q_stages, self.num_stages, cute.cosize(q_layout), cute.cosize(k_layout),
            cute.cosize(v_layout), None if cutlass.const_expr(o_layout is None) else cute.cosize(o_layout))

        num_m_blocks = self.query_blocks(mQ)
        grid_size = cutlass.min(
            tile_scheduler.work_units(num_m_blocks, mQ.shape[2], mQ.shape[3], self.options.mirrored_tiles),
            self.options.sm_count)

        self.kernel(
            tiled_mma_qk, tiled_mma_pv, tma_q, tma_m_q, tma_k, tma_m_k, tma_v, tma_m_v,
            mO, mLSE, mSinks, mQSegmentIds, mKVSegmentIds, mQSeqLengths, mKVSeqLengths, mQStart,
            mCuSeqlensQ, mCuSeqlensK, q_layout, k_layout, v_layout, tiled_mma_epilogue, tma_o, tma_m_o, o_layout,
        ).launch(grid=[grid_size, 1, 1], block=[self.threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    # ----------------------------------------------------------------------------------------------
    # Device side.
    @cute.kernel
    def kernel(self, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
               tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_k: cute.CopyAtom, mK: cute.Tensor,
               tma_v: cute.CopyAtom, mV: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor,
               mSinks: Optional[cute.Tensor], mQSegmentIds: Optional[cute.Tensor],
               mKVSegmentIds: Optional[cute.Tensor], mQSeqLengths: Optional[cute.Tensor],
               mKVSeqLengths: Optional[cute.Tensor], mQStart: Optional[cute.Tensor],
               mCuSeqlensQ: Optional[cute.Tensor], mCuSeqlensK: Optional[cute.Tensor],
               q_layout: cute.ComposedLayout, k_layout: cute.ComposedLayout, v_layout: cute.ComposedLayout,
               tiled_mma_epilogue: Optional[cute.TiledMma], tma_o: Optional[cute.CopyAtom],
               mO_tma: Optional[cute.Tensor], o_layout: Optional[cute.ComposedLayout]):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_q, tma_k, tma_v):
                cpasync.prefetch_descriptor(atom)
            if cutlass.const_expr(tma_o is not None):
                cpasync.prefetch_descriptor(tma_o)

        storage = SmemAllocator().allocate(self.shared_storage)
        producer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
        # Consumers release a stage once per warp (PipelineTmaAsync signals from one lane per warp).
        consumer_group = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.consumer_threads // 32)
        pipeline_q = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.q_barriers.data_ptr(), num_stages=self.q_stages, producer_group=producer_group,
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
        sK = storage.s_k.get_tensor(k_layout.outer, swizzle=k_layout.inner)
        sV = storage.s_v.get_tensor(v_layout.outer, swizzle=v_layout.inner)
        sO = None
        if cutlass.const_expr(o_layout is not None):
            sO = storage.s_o.get_tensor(o_layout.outer, swizzle=o_layout.inner)
        cute.arch.sync_threads()

        num_m_blocks = self.query_blocks(mQ)
        num_tiles = tile_scheduler.walked_tiles(num_m_blocks, mQ.shape[2], mQ.shape[3], self.options.mirrored_tiles)
        lengths = (mQSeqLengths, mKVSeqLengths, mQStart, mCuSeqlensQ, mCuSeqlensK)

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_registers)
            if warp_idx == 0:
                self.produce(tma_q, mQ, tma_k, mK, tma_v, mV, sQ, sK, sV,
                             pipeline_q, pipeline_k, pipeline_v, lengths, num_m_blocks, num_tiles)
        else:
            cute.arch.setmaxregister_increase(self.consumer_registers)
            self.consume(tiled_mma_qk, tiled_mma_pv, mQ, mK, mO, mLSE, sQ, sK, sV,
                         pipeline_q, pipeline_k, pipeline_v, mSinks, mQSegmentIds, mKVSegmentIds,
                         lengths, num_m_blocks, num_tiles, tiled_mma_epilogue, tma_o, mO_tma, sO)

    @cute.jit
    def next_tile(self, tile: Int32, wave: Int32) -> Int32:
        """This CTA's tile in persistent wave `wave`, after `tile` (producer and consumers walk the same
        sequence, from tile_scheduler.first_tile)."""
        next_tile = tile_scheduler.next_tile(tile, cute.arch.grid_dim()[0], self.options.mirrored_tiles)
        if cutlass.const_expr(self.options.zigzag_tiles and not self.options.mirrored_tiles):
            next_tile = tile_scheduler.zigzag_tile(wave, cute.arch.block_idx()[0], cute.arch.grid_dim()[0])
        return next_tile

    def query_blocks(self, mQ: cute.Tensor):
        """Query-block work items per (head, batch element): the tiles of Sq, or with packed sequences
        the static slot count of tile_scheduler.packed_item (some slots hold no rows)."""
        if cutlass.const_expr(self.options.packed):
            return tile_scheduler.packed_slots_per_head(self.options.num_sequences, mQ.shape[0], self.tile_m)
        return (mQ.shape[0] + self.tile_m - 1) // self.tile_m

    @cute.jit
    def work_item(self, tile: Int32, num_m_blocks: Int32, mQ: cute.Tensor, mK: cute.Tensor, lengths):
        """Where tile `tile` sits and what it sees: (m_block, head, batch_index, q_row0, k_row0,
        holds_rows, rows_left, row_start, q_len, kv_len, offset, first key block, end key block).
        q_row0 / k_row0: the first query row / key of its sequence in the arrays (0 unless packed),
        m_block its query block within that sequence, rows_left the rows from the block's first to its
        sequence's end; holds_rows is False for a packed slot past its sequence's blocks (both roles
        skip it), and for the empty second tile of a middle unit of mirrored_tiles; a constant True
        otherwise, so the other kernels have no branch for it."""
        mQSeqLengths, mKVSeqLengths, mQStart, mCuSeqlensQ, mCuSeqlensK = lengths
        # Packed: slot order (sequence by sequence); the causal orders need Sq known statically.
        m_block, head, batch_index, holds_rows = tile_scheduler.work_tile(
            tile, num_m_blocks, mQ.shape[2], mQ.shape[3], self.mask.causal and not self.options.packed,
            self.options.mirrored_tiles)
        holds_rows = cutlass.Boolean(holds_rows)
        q_row0 = Int32(0)
        k_row0 = Int32(0)
        if cutlass.const_expr(self.options.packed):
            m_block, q_row0, q_len, k_row0, kv_len = tile_scheduler.packed_item(
                m_block, mCuSeqlensQ, mCuSeqlensK, self.options.num_sequences, mQ.shape[0], mK.shape[0], self.tile_m)
            row_start, q_len, kv_len, offset, first, end = masking.tile_extents(
                self.mask, m_block, batch_index, self.tile_m, self.tile_n, q_len, kv_len, None, None, None, None)
            rows_left = q_len - m_block * self.tile_m
            holds_rows = rows_left > 0
        else:
            row_start, q_len, kv_len, offset, first, end = masking.tile_extents(
                self.mask, m_block, batch_index, self.tile_m, self.tile_n, mQ.shape[0], mK.shape[0],
                mQSeqLengths, mKVSeqLengths, mQStart, self.options.q_total)
            rows_left = mQ.shape[0] - m_block * self.tile_m
        return (m_block, head, batch_index, q_row0, k_row0, holds_rows, rows_left, row_start, q_len, kv_len,
                offset, first, end)

    def sequence_rows(self, tensor: cute.Tensor, row0: Int32) -> cute.Tensor:
        """A (rows, columns) slice of Q, K, V or O from its sequence's first row on (packed: an offset
        view, so tiles start at a sequence's own rows wherever it begins; the TMA coordinates are
        plain integers, so any offset loads)."""
        if cutlass.const_expr(self.options.packed):
            return cute.domain_offset((row0, 0), tensor)
        return tensor

    @cute.jit
    def produce(self, tma_q: cute.CopyAtom, mQ: cute.Tensor, tma_k: cute.CopyAtom, mK: cute.Tensor,
                tma_v: cute.CopyAtom, mV: cute.Tensor, sQ: cute.Tensor, sK: cute.Tensor,
                sV: cute.Tensor, pipeline_q, pipeline_k, pipeline_v, lengths, num_m_blocks: Int32,
                num_tiles: Int32):
        """Producer warp: TMA loads of Q once per tile and of the visible K/V blocks, last first."""
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stages)
        # K and V of one key block share a stage index; V runs one block behind K within a tile.
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        tile = tile_scheduler.first_tile(cute.arch.block_idx()[0], self.options.mirrored_tiles)
        wave = Int32(0)
        while tile < num_tiles:
            m_block, head, batch_index, q_row0, k_row0, holds_rows, _, _, _, _, _, first, end = self.work_item(
                tile, num_m_blocks, mQ, mK, lengths)
            if holds_rows:
                head_kv = head // self.options.group
                g_q = cute.local_tile(self.sequence_rows(mQ[None, None, head, batch_index], q_row0),
                                      (self.tile_m, self.head_dim), (m_block, 0))
                t_q_smem, t_q_gmem = cpasync.tma_partition(
                    tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2), cute.group_modes(g_q, 0, 2))
                if cutlass.const_expr(self.q_stages > 1):
                    t_q_smem = t_q_smem[None, q_state.index]
                # Packed: a key block past the sequence's keys loads the next sequence's (or zeros past
                # the array's end); the consumers mask keys >= kv_len, as for a padded batch.
                g_k = cute.local_tile(self.sequence_rows(mK[None, None, head_kv, batch_index], k_row0),
                                      (self.tile_n, self.head_dim), (None, 0))
                t_k_smem, t_k_gmem = cpasync.tma_partition(
                    tma_k, 0, cute.make_layout(1), cute.group_modes(sK, 0, 2), cute.group_modes(g_k, 0, 2))
                g_v = cute.local_tile(self.sequence_rows(mV[None, None, head_kv, batch_index], k_row0),
                                      (self.tile_n, self.v_head_dim), (None, 0))
                t_v_smem, t_v_gmem = cpasync.tma_partition(
                    tma_v, 0, cute.make_layout(1), cute.group_modes(sV, 0, 2), cute.group_modes(g_v, 0, 2))

                pipeline_q.producer_acquire(q_state)
                cute.copy(tma_q, t_q_gmem, t_q_smem, tma_bar_ptr=pipeline_q.producer_get_barrier(q_state))
                q_state = advanced(q_state)
                # Order of use by the overlapped consumers: K_last, then (K_j, V_{j+1}) pairs, then V_first.
                num_blocks = end - first
                if num_blocks > 0:
                    pipeline_k.producer_acquire(kv_state)
                    cute.copy(tma_k, t_k_gmem[None, end - 1], t_k_smem[None, kv_state.index],
                              tma_bar_ptr=pipeline_k.producer_get_barrier(kv_state))
                    kv_state = advanced(kv_state)
                    for i in cutlass.range(1, num_blocks, unroll=1):
                        pipeline_k.producer_acquire(kv_state)
                        cute.copy(tma_k, t_k_gmem[None, end - 1 - i], t_k_smem[None, kv_state.index],
                                  tma_bar_ptr=pipeline_k.producer_get_barrier(kv_state))
                        pipeline_v.producer_acquire(v_state)
                        cute.copy(tma_v, t_v_gmem[None, end - i], t_v_smem[None, v_state.index],
                                  tma_bar_ptr=pipeline_v.producer_get_barrier(v_state))
                        v_state = advanced(v_state)
                        kv_state = advanced(kv_state)
                    pipeline_v.producer_acquire(v_state)
                    cute.copy(tma_v, t_v_gmem[None, first], t_v_smem[None, v_state.index],
                              tma_bar_ptr=pipeline_v.producer_get_barrier(v_state))
                    v_state = advanced(v_state)
            wave += 1
            tile = self.next_tile(tile, wave)

    @cute.jit
    def consume(self, tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma, mQ: cute.Tensor,
                mK: cute.Tensor, mO: cute.Tensor, mLSE: cute.Tensor, sQ: cute.Tensor,
                sK: cute.Tensor, sV: cute.Tensor, pipeline_q, pipeline_k, pipeline_v,
                mSinks: Optional[cute.Tensor], mQSegmentIds: Optional[cute.Tensor],
                mKVSegmentIds: Optional[cute.Tensor], lengths, num_m_blocks: Int32, num_tiles: Int32,
                tiled_mma_epilogue: Optional[cute.TiledMma],
                tma_o: Optional[cute.CopyAtom], mO_tma: Optional[cute.Tensor], sO: Optional[cute.Tensor]):
        """Consumer warpgroups: S = QK^T, mask, online softmax, O += PV, epilogue."""
        tidx = cute.arch.thread_idx()[0] - wgmma.WARP_GROUP
        warpgroup_index = cute.arch.make_warp_uniform(tidx // wgmma.WARP_GROUP)
        thread_mma_qk = tiled_mma_qk.get_slice(tidx)
        thread_mma_pv = tiled_mma_pv.get_slice(tidx)
        warpgroup_mma_qk = tiled_mma_qk.get_slice(warpgroup_index * wgmma.WARP_GROUP)
        warpgroup_mma_pv = tiled_mma_pv.get_slice(warpgroup_index * wgmma.WARP_GROUP)

        # V^T view (Dv, tile_n, stages) of the K-major V buffer: the MN-major B operand of P V.
        s_vt = cute.composition(sV, cute.make_ordered_layout(
            (self.v_head_dim, self.tile_n, self.num_stages), order=(1, 0, 2)))
        frag_q = warpgroup_mma_qk.make_fragment_A(warpgroup_mma_qk.partition_A(sQ))
        frag_k = warpgroup_mma_qk.make_fragment_B(warpgroup_mma_qk.partition_B(sK))
        frag_vt = warpgroup_mma_pv.make_fragment_B(warpgroup_mma_pv.partition_B(s_vt))
        frag_p = warpgroup_mma_pv.make_fragment_A(
            warpgroup_mma_pv.partition_shape_A((self.tile_m, self.tile_n)))
        acc_o = cute.make_rmem_tensor(
            warpgroup_mma_pv.partition_shape_C((self.tile_m, self.v_head_dim)), Float32)
        acc_s_shape = warpgroup_mma_qk.partition_shape_C((self.tile_m, self.tile_n))

        coords_s = wgmma.accumulator_mn(thread_mma_qk.partition_C(
            cute.make_identity_tensor((self.tile_m, self.tile_n))))
        coords_o = wgmma.accumulator_mn(thread_mma_pv.partition_C(
            cute.make_identity_tensor((self.tile_m, self.v_head_dim))))
        acc_o_mn = wgmma.accumulator_mn(acc_o)
        num_rows = cute.size(acc_o_mn, mode=[0])
        row_max, row_sum = online_softmax.OnlineSoftmax.new_state(num_rows)
        row_scale = cute.make_rmem_tensor(num_rows, Float32)
        lse_rows = cute.make_rmem_tensor(num_rows, Float32)
        output_scale = cute.make_rmem_tensor(num_rows, Float32)

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stages)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        self.scheduler_start(warpgroup_index)
        tile = tile_scheduler.first_tile(cute.arch.block_idx()[0], self.options.mirrored_tiles)
        wave = Int32(0)
        while tile < num_tiles:
            (m_block, head, batch_index, q_row0, _, holds_rows, rows_left, row_start, q_len, kv_len, offset,
             first, end) = self.work_item(tile, num_m_blocks, mQ, mK, lengths)
            if holds_rows:
                q_segments = None
                kv_segments = None
                if cutlass.const_expr(mQSegmentIds is not None):
                    q_segments = mQSegmentIds[None, batch_index]
                    kv_segments = mKVSegmentIds[None, batch_index]

                online_softmax.OnlineSoftmax.reset(row_max, row_sum)
                acc_o.fill(0.0)
                pipeline_q.consumer_wait(q_state)
                frag_q_tile = frag_q
                if cutlass.const_expr(self.q_stages > 1):
                    frag_q_tile = frag_q[None, None, None, q_state.index]
                block_arguments = (tiled_mma_qk, tiled_mma_pv, frag_q_tile, frag_k, frag_vt, frag_p, acc_o, acc_o_mn,
                                   row_max, row_sum, row_scale, coords_s, pipeline_k, pipeline_v)
                num_blocks = end - first
                if num_blocks > 0:
                    # First block: S = Q K^T alone, then its probabilities become the P of the next step.
                    acc_s = cute.make_rmem_tensor(acc_s_shape, Float32)
                    pipeline_k.consumer_wait(kv_state)
                    if cutlass.const_expr(self.options.schedule_first_block):
                        self.scheduler_wait(warpgroup_index)
                    wgmma.gemm_group(tiled_mma_qk, acc_s, frag_q_tile, frag_k[None, None, None, kv_state.index], True)
                    if cutlass.const_expr(self.options.schedule_first_block):
                        self.scheduler_signal(warpgroup_index)
                    warpgroup.wait_group(0)
                    pipeline_k.consumer_release(kv_state)
                    if cutlass.const_expr(self.options.early_q_release):
                        if num_blocks == 1:
                            pipeline_q.consumer_release(q_state)
                    self.scores_to_probabilities(acc_s, row_max, row_sum, row_scale, coords_s, end - 1, row_start, kv_len,
                                                 q_len, offset, m_block * self.tile_m, q_segments, kv_segments)
                    frag_p.store(wgmma.accumulator_as_operand_a(acc_s).load().to(self.dtype))
                    kv_state = advanced(kv_state)
                    # Steady state: S_j = Q K_j^T and O += P_{j-1} V_{j-1} are in flight together; the
                    # softmax of S_j runs while P V still computes (intra-warpgroup overlap), and the
                    # scheduler barrier hands the tensor cores to the other warpgroup meanwhile.
                    # Iteration i works on key block end - 1 - i.
                    if cutlass.const_expr(self.split_masked_loop):
                        # Partial blocks first (top of the key range), then blocks with no masking code,
                        # then (left window only) the partial blocks at the bottom.
                        unmasked_first, unmasked_end = masking.unmasked_block_range(
                            self.mask, row_start, self.tile_m, self.tile_n, kv_len, q_len, offset)
                        masked_until = cutlass.max(1, cutlass.min(num_blocks, end - unmasked_end))
                        unmasked_until = cutlass.max(masked_until, cutlass.min(num_blocks, end - unmasked_first))
                        for i in cutlass.range(1, masked_until, unroll=1):
                            v_state, kv_state = self.steady_block(
                                i, True, *block_arguments, kv_state, v_state, pipeline_q, q_state, num_blocks, end,
                                row_start, kv_len, q_len, offset, m_block, q_segments, kv_segments, warpgroup_index)
                        for i in cutlass.range(masked_until, unmasked_until, unroll=1):
                            v_state, kv_state = self.steady_block(
                                i, False, *block_arguments, kv_state, v_state, pipeline_q, q_state, num_blocks, end,
                                row_start, kv_len, q_len, offset, m_block, q_segments, kv_segments, warpgroup_index)
                        if cutlass.const_expr(self.mask.window_left is not None):
                            for i in cutlass.range(unmasked_until, num_blocks, unroll=1):
                                v_state, kv_state = self.steady_block(
                                    i, True, *block_arguments, kv_state, v_state, pipeline_q, q_state, num_blocks, end,
                                    row_start, kv_len, q_len, offset, m_block, q_segments, kv_segments, warpgroup_index)
                    else:
                        for i in cutlass.range(1, num_blocks, unroll=1):
                            v_state, kv_state = self.steady_block(
                                i, None, *block_arguments, kv_state, v_state, pipeline_q, q_state, num_blocks, end,
                                row_start, kv_len, q_len, offset, m_block, q_segments, kv_segments, warpgroup_index)
                    pipeline_v.consumer_wait(v_state)
                    wgmma.gemm_group(tiled_mma_pv, acc_o, frag_p, frag_vt[None, None, None, v_state.index], False)
                    warpgroup.wait_group(0)
                    pipeline_v.consumer_release(v_state)
                    v_state = advanced(v_state)
                if cutlass.const_expr(self.options.early_q_release):
                    if num_blocks == 0:
                        pipeline_q.consumer_release(q_state)
                else:
                    pipeline_q.consumer_release(q_state)
                q_state = advanced(q_state)

                sink_logit = None
                if cutlass.const_expr(mSinks is not None):
                    sink_logit = Float32(mSinks[head])
                self.softmax.finalize(row_max, row_sum, sink_logit, lse_rows, output_scale)
                online_softmax.rescale_rows(acc_o_mn, output_scale, False)
                if cutlass.const_expr(self.options.tma_store):
                    self.store_tile_through_shared(acc_o, tiled_mma_epilogue, tma_o, mO_tma, sO,
                                                   warpgroup_index, m_block, head, batch_index)
                    self.store_lse(coords_o, lse_rows, mLSE, q_row0, rows_left, m_block, head, batch_index)
                else:
                    self.store_tile(acc_o, coords_o, lse_rows, mO, mLSE, thread_mma_pv, q_row0, rows_left,
                                    m_block, head, batch_index)
            wave += 1
            tile = self.next_tile(tile, wave)
        if cutlass.const_expr(self.options.tma_store):
            # Shared memory must outlive the last TMA store's reads of it.
            if tidx % wgmma.WARP_GROUP == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def steady_block(self, i: Int32, masked: cutlass.Constexpr, tiled_mma_qk: cute.TiledMma,
                     tiled_mma_pv: cute.TiledMma, frag_q: cute.Tensor, frag_k: cute.Tensor, frag_vt: cute.Tensor,
                     frag_p: cute.Tensor, acc_o: cute.Tensor, acc_o_mn: cute.Tensor, row_max: cute.Tensor,
                     row_sum: cute.Tensor, row_scale: cute.Tensor, coords_s: cute.Tensor, pipeline_k, pipeline_v,
                     kv_state, v_state, pipeline_q, q_state, num_blocks: Int32, end: Int32, row_start: Int32,
                     kv_len: Int32, q_len: Int32, offset: Int32, m_block: Int32,
                     q_segments: Optional[cute.Tensor], kv_segments: Optional[cute.Tensor], warpgroup_index: Int32):
        """Iteration i >= 1 of a tile's key loop: S = Q K^T of block end - 1 - i in flight with
        O += P V of the block before, then that block's softmax into P. masked: as in
        `scores_to_probabilities`. Returns the advanced (v_state, kv_state)."""
        acc_s = cute.make_rmem_tensor(
            tiled_mma_qk.get_slice(0).partition_shape_C((self.tile_m, self.tile_n)), Float32)
        pipeline_k.consumer_wait(kv_state)
        self.scheduler_wait(warpgroup_index)
        wgmma.gemm_group(tiled_mma_qk, acc_s, frag_q, frag_k[None, None, None, kv_state.index], True)
        pipeline_v.consumer_wait(v_state)
        wgmma.gemm_group(tiled_mma_pv, acc_o, frag_p, frag_vt[None, None, None, v_state.index], False)
        self.scheduler_signal(warpgroup_index)
        warpgroup.wait_group(1)
        pipeline_k.consumer_release(kv_state)
        if cutlass.const_expr(self.options.early_q_release):
            if i == num_blocks - 1:  # the tile's last Q K^T is done: Q's buffer is free
                pipeline_q.consumer_release(q_state)
        self.scores_to_probabilities(acc_s, row_max, row_sum, row_scale, coords_s, end - 1 - i, row_start,
                                     kv_len, q_len, offset, m_block * self.tile_m, q_segments, kv_segments,
                                     masked)
        warpgroup.wait_group(0)
        pipeline_v.consumer_release(v_state)
        online_softmax.rescale_rows(acc_o_mn, row_scale, self.options.rescale_threshold > 0)
        frag_p.store(wgmma.accumulator_as_operand_a(acc_s).load().to(self.dtype))
        v_state = advanced(v_state)
        kv_state = advanced(kv_state)
        return v_state, kv_state

    @cute.jit
    def scores_to_probabilities(self, acc_s: cute.Tensor, row_max: cute.Tensor,
                                row_sum: cute.Tensor, row_scale: cute.Tensor,
                                coords_s: cute.Tensor, n_block: Int32, row_start: Int32, kv_len: Int32,
                                q_len: Int32, offset: Int32, local_row_start: Int32,
                                q_segments: Optional[cute.Tensor], kv_segments: Optional[cute.Tensor],
                                masked: cutlass.Constexpr = None):
        """Softcap, mask and online softmax of one S block, in place.

        masked: None masks the block when `block_is_partial` says so (checked at run time); True
        always masks (harmless on a fully visible block); False never (the caller knows it is full).
        """
        if cutlass.const_expr(self.options.softcap is not None):
            apply_softcap(acc_s, self.options.softcap, self.options.scale)
        acc_s_mn = wgmma.accumulator_mn(acc_s)
        if cutlass.const_expr(masked is None):
            if masking.block_is_partial(self.mask, n_block, row_start, self.tile_m, self.tile_n,
                                        kv_len, q_len, offset):
                masking.apply_mask(acc_s_mn, coords_s, self.mask, row_start, n_block * self.tile_n,
                                   kv_len, q_len, offset, local_row_start, q_segments, kv_segments)
        elif cutlass.const_expr(masked):
            masking.apply_mask(acc_s_mn, coords_s, self.mask, row_start, n_block * self.tile_n,
                               kv_len, q_len, offset, local_row_start, q_segments, kv_segments)
        self.softmax.step(acc_s_mn, row_max, row_sum, row_scale)

    # Ping-pong between the consumer warpgroups (named barriers 1.., one per warpgroup, 256 threads:
    # the waiting warpgroup and the one releasing it): a warpgroup waits on its own barrier before
    # issuing its GEMMs and then releases the next one's, round robin, so the softmax of one
    # warpgroup runs while another's GEMMs own the tensor cores.
    @cute.jit
    def scheduler_start(self, warpgroup_index: Int32):
        if cutlass.const_expr(self.pingpong):
            if warpgroup_index == 0:
                cute.arch.barrier_arrive(barrier_id=SCHEDULER_BARRIER, number_of_threads=2 * wgmma.WARP_GROUP)

    @cute.jit
    def scheduler_wait(self, warpgroup_index: Int32):
        if cutlass.const_expr(self.pingpong):
            cute.arch.barrier(barrier_id=SCHEDULER_BARRIER + warpgroup_index,
                              number_of_threads=2 * wgmma.WARP_GROUP)

    @cute.jit
    def scheduler_signal(self, warpgroup_index: Int32):
        if cutlass.const_expr(self.pingpong):
            if cutlass.const_expr(self.consumer_warpgroups == 2):
                cute.arch.barrier_arrive(barrier_id=SCHEDULER_BARRIER + 1 - warpgroup_index,
                                         number_of_threads=2 * wgmma.WARP_GROUP)
            else:
                next_warpgroup = warpgroup_index + 1
                if next_warpgroup == self.consumer_warpgroups:
                    next_warpgroup = 0
                cute.arch.barrier_arrive(barrier_id=SCHEDULER_BARRIER + next_warpgroup,
                                         number_of_threads=2 * wgmma.WARP_GROUP)

    @cute.jit
    def store_tile(self, acc_o: cute.Tensor, coords_o: cute.Tensor, lse_rows: cute.Tensor,
                   mO: cute.Tensor, mLSE: cute.Tensor, thread_mma_pv, q_row0: Int32, rows_left: Int32,
                   m_block: Int32, head: Int32, batch_index: Int32):
        """Write this thread's rows of O (in the input dtype) and, from one lane per row, LSE: only the
        tile's first `rows_left` rows (past them: the array's end, or with packed sequences the next
        sequence's rows)."""
        out_rows = cute.make_rmem_tensor(acc_o.layout, self.dtype)
        out_rows.store(acc_o.load().to(self.dtype))
        g_o = cute.local_tile(self.sequence_rows(mO[None, None, head, batch_index], q_row0),
                              (self.tile_m, self.v_head_dim), (m_block, 0))
        t_g_o = wgmma.accumulator_mn(thread_mma_pv.partition_C(g_o))
        out_mn = wgmma.accumulator_mn(out_rows)
        for r in cutlass.range_constexpr(cute.size(out_mn, mode=[0])):
            if coords_o[r, 0][0] < rows_left:
                for c in cutlass.range_constexpr(cute.size(out_mn, mode=[1])):
                    t_g_o[r, c] = out_mn[r, c]
        self.store_lse(coords_o, lse_rows, mLSE, q_row0, rows_left, m_block, head, batch_index)

    @cute.jit
    def store_lse(self, coords_o: cute.Tensor, lse_rows: cute.Tensor, mLSE: cute.Tensor, q_row0: Int32,
                  rows_left: Int32, m_block: Int32, head: Int32, batch_index: Int32):
        """LSE of this thread's rows (the tile's first `rows_left`), from the one lane of each quad that
        holds column 0."""
        if coords_o[0, 0][1] == 0:
            g_lse = mLSE[None, head, batch_index]
            for r in cutlass.range_constexpr(cute.size(lse_rows)):
                if coords_o[r, 0][0] < rows_left:
                    g_lse[q_row0 + m_block * self.tile_m + coords_o[r, 0][0]] = lse_rows[r]

    @cute.jit
    def store_tile_through_shared(self, acc_o: cute.Tensor, tiled_mma_epilogue: cute.TiledMma,
                                  tma_o: cute.CopyAtom, mO_tma: cute.Tensor, sO: cute.Tensor,
                                  warpgroup_index: Int32, m_block: Int32, head: Int32, batch_index: Int32):
        """This warpgroup's 64 rows of O: registers -> its shared buffer (stmatrix) -> TMA store, in
        `store_chunks` column chunks through the one buffer.

        The last store is left in flight; the buffer is reused (next chunk, or next tile) after
        waiting for the TMA unit to have read it. Rows past Sq are clipped by the TMA unit.
        """
        lane_in_warpgroup = cute.arch.thread_idx()[0] % wgmma.WARP_GROUP
        barrier_id = EPILOGUE_BARRIER + warpgroup_index
        out_rows = cute.make_rmem_tensor(acc_o.layout, self.dtype)
        s_o_warpgroup = sO[None, None, warpgroup_index]
        store_atom = sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, self.dtype, Float32)
        tiled_store = cute.make_tiled_copy_C(store_atom, tiled_mma_epilogue)
        thread_store = tiled_store.get_slice(lane_in_warpgroup)
        g_o_rows = mO_tma[None, None, head, batch_index]
        for chunk in cutlass.range_constexpr(self.options.store_chunks):
            # The buffer is free once the TMA unit has read the previous store out of it.
            if lane_in_warpgroup == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            cute.arch.barrier(barrier_id=barrier_id, number_of_threads=wgmma.WARP_GROUP)
            if cutlass.const_expr(chunk == 0):
                out_rows.store(acc_o.load().to(self.dtype))
            chunk_rows = out_rows
            if cutlass.const_expr(self.options.store_chunks > 1):
                # Columns [chunk * Dv / chunks, ...) of this thread's rows, in the register order of a
                # one-warpgroup MMA with N = Dv / chunks: per thread, the mn view's columns are
                # (2 adjacent, N / 8 groups), so a chunk is a contiguous run of them.
                chunk_rows = cute.make_rmem_tensor(
                    tiled_mma_epilogue.get_slice(0).partition_shape_C((ROWS_PER_WARPGROUP, self.store_columns)),
                    self.dtype)
                chunk_mn = wgmma.accumulator_mn(chunk_rows)
                out_mn = wgmma.accumulator_mn(out_rows)
                chunk_width = cute.size(chunk_mn, mode=[1])
                for r in cutlass.range_constexpr(cute.size(chunk_mn, mode=[0])):
                    for c in cutlass.range_constexpr(chunk_width):
                        chunk_mn[r, c] = out_mn[r, chunk * chunk_width + c]
            cute.copy(tiled_store, thread_store.retile(chunk_rows), thread_store.partition_D(s_o_warpgroup))
            # stmatrix writes through the generic proxy; the TMA unit reads through the async proxy.
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=barrier_id, number_of_threads=wgmma.WARP_GROUP)
            if lane_in_warpgroup == 0:
                g_o = cute.local_tile(g_o_rows, (ROWS_PER_WARPGROUP, self.store_columns),
                                      (m_block * self.consumer_warpgroups + warpgroup_index, chunk))
                t_o_smem, t_o_gmem = cpasync.tma_partition(
                    tma_o, 0, cute.make_layout(1), cute.group_modes(s_o_warpgroup, 0, 2), cute.group_modes(g_o, 0, 2))
                cute.copy(tma_o, t_o_smem, t_o_gmem)
                cute.arch.cp_async_bulk_commit_group()


# --------------------------------------------------------------------------------------------------
# The kernel module's face (what fa4_jax/lowering/cuda.py calls).

def unsupported_reason(config: AttentionConfig, problem: host.Problem) -> Optional[str]:
    """None when this kernel computes `config` exactly; otherwise what it cannot take, for the user."""
    reason = host.kernel_unsupported_reason("sm90", config, problem, SUPPORTED_HEAD_DIMS, takes_packed=True,
                                            extra_pairs=EXTRA_HEAD_DIM_PAIRS)
    if reason is not None:
        return reason
    if config.has_cu_seqlens and (config.has_segment_ids or config.has_q_seq_lengths or config.has_kv_seq_lengths
                                  or config.has_q_start):
        # The packed scheduler takes each sequence's extents from the offsets alone.
        return "sm90 does not combine packed sequences (cu_seqlens) with segment ids, sequence lengths or q_start"
    return host.q_start_unsupported_reason("sm90", config)


def tuned_overrides(head_dim: int, v_head_dim: int, mask: masking.MaskShape, softcap: Optional[float],
                    q_len: int, packed: bool = False) -> dict:
    """The KernelOptions tuning fields that measured fastest for this head dim, mask and query length.

    Packed sequences store O row by row (KernelOptions.check), so they drop the TMA-store epilogue,
    and with it the three-warpgroup set, which was measured (and checked for spills) only with it."""
    tuned = _measured_overrides(head_dim, v_head_dim, mask, softcap, q_len, packed)
    if packed:
        tuned.update(tma_store=False, store_chunks=1)
    return tuned


def _measured_overrides(head_dim: int, v_head_dim: int, mask: masking.MaskShape, softcap: Optional[float],
                        q_len: int, packed: bool) -> dict:
    windowed = (mask.window_left, mask.window_right) != (None, None)
    if v_head_dim <= 64:
        # At 160 registers per consumer thread ptxas spills with a softcap, a window or segments
        # (ptxas 13.0: 28-268 bytes), so those keep two warpgroups.
        plain_mask = softcap is None and not mask.has_segments and not windowed
        if plain_mask and not packed and not (mask.causal and q_len < THREE_WARPGROUPS_MIN_CAUSAL_Q_LEN):
            return dict(THREE_WARPGROUPS)
        # Causal below the three-group cut: the split key loop too (seventh round, +2.5 % at 1k).
        return dict(Q_DOUBLE_BUFFER_TMA_STORE, split_masked_loop=plain_mask and mask.causal and not packed)
    if head_dim <= 128:
        # The split key loop on causal (first sweep) and full masks (seventh round: +4.5 to +7.6 %); a window
        # without the causal mask keeps the one loop (not measured with the split).
        return dict(Q_DOUBLE_BUFFER_TMA_STORE, split_masked_loop=mask.causal or not windowed,
                    zigzag_tiles=mask.causal)
    if head_dim == 192:
        tuned = dict(D192_CAUSAL if mask.causal else D192)
        if v_head_dim != head_dim and not packed:
            # Packed MLA keeps D = 192's 96-key blocks: its GPU tests have not run with 128 yet.
            tuned.update(MLA)
        return tuned
    if head_dim == 256:
        return dict(LARGE_HEAD_CAUSAL if mask.causal else LARGE_HEAD_FULL)
    return {}


def options(config: AttentionConfig, problem: host.Problem, sm_count: Optional[int] = None,
            **overrides) -> KernelOptions:
    """The static kernel configuration for one call, the tuned defaults with `overrides` (KernelOptions
    fields, for tests and tuning sweeps) on top; also what the compile tests build."""
    if config.has_cu_seqlens and problem.sequences is None:
        raise ValueError("packed sequences (cu_seqlens) need the Problem's sequence count: "
                         "host.Problem.of(query, key, value, optional)")
    mask = masking.MaskShape.from_config(config)
    softcap_value = None if config.softcap is None else float(config.softcap)
    tuned = tuned_overrides(problem.head_dim, problem.v_head_dim, mask, softcap_value, problem.q_len,
                            config.has_cu_seqlens)
    if mask.causal and not config.has_cu_seqlens:
        tuned["mirrored_tiles"] = True
    tuned.update(overrides)
    if tuned.get("mirrored_tiles"):
        tuned["zigzag_tiles"] = False     # the mirrored order is its own; one compile key per kernel
    return KernelOptions(
        dtype_name=problem.dtype,
        head_dim=problem.head_dim,
        v_head_dim=problem.v_head_dim,
        group=problem.group,
        scale=float(config.scale),
        mask=mask,
        softcap=softcap_value,
        has_sinks=config.has_sinks,
        has_q_lengths=config.has_q_seq_lengths,
        has_kv_lengths=config.has_kv_seq_lengths,
        has_q_start=config.has_q_start,
        q_total=config.q_total if config.has_q_start else None,
        num_sequences=problem.sequences if config.has_cu_seqlens else None,
        sm_count=host.sm_count(DEFAULT_SM_COUNT) if sm_count is None else sm_count,
        **tuned,
    )


@functools.lru_cache(maxsize=None)
def _kernel(options: KernelOptions) -> Sm90ForwardKernel:
    return Sm90ForwardKernel(options)


def run(options: KernelOptions, query, key, value, optional: dict):
    """(out [B, Sq, Hq, Dv] in the query dtype, lse [B, Hq, Sq] float32), traceable under jax.jit; with
    packed sequences B = 1 and `optional` holds cu_seqlens_q / cu_seqlens_k (int32 [N + 1])."""
    return host.launch_forward(_kernel(options), options, query, key, value, optional)
