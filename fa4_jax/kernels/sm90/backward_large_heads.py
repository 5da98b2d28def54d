"""Hopper (sm_90a) attention backward for head dims 192 and 256, and DeepSeek MLA's D / Dv = 192 / 128:
dQ, dK, dV in CuTe DSL.

backward.py keeps dK and dV of 64 keys per consumer warp group in registers: at D = 256 that is
256 fp32 registers per thread before a single score, more than a thread has. This kernel uses the
layout FA3 uses for large heads:

- a CTA owns one block of TILE_N = 64 keys of one KV head and walks the query blocks (TILE_M = 64
  rows) of every query head of its group, as backward.py does;
- the two consumer warp groups split the head dimension, not the keys: group g accumulates
  dK[:, g D/2 : (g+1) D/2] and the same columns of dV for all 64 keys. Per thread that is
  2 x 64 x D/2 / 128 = D/2 fp32 registers (128 at D = 256, 96 at D = 192);
- S = Q K^T and dP = dO V^T (64 rows x 64 keys) are split by keys instead: group g computes the 32 keys
  [32 g, 32 g + 32) of all 64 rows, 16 fp32 registers each;
- P and dS therefore leave registers: each group rounds its half into shared memory, a named barrier
  joins the halves, and both groups read the whole tile as the A operand of dV += P^T dO, dK += dS^T Q
  and dQ = dS K (N = the group's half of D);
- dQ (a [64, D/2] fp32 tile per group) is staged in shared memory in the threads' register order,
  one 16-byte store per 4 values and one address per thread, and added into the fp32 accumulator by
  one bulk reduce-add (`cp.reduce.async.bulk`, 64 x D x 4 contiguous bytes) that a writer warp of the
  producer warp group issues (deterministic: in key block order, waited for by the writer alone;
  the turns are common/ordered_reduction.py's, as in backward.py).
  The accumulator is therefore kept in that order, [B, Hq, query block, 64 x D], and the
  postprocess (`dq_reader`) puts rows and columns back while it scales and casts. A
  swizzled [64, D/2] staging tile for a TMA tensor reduce would need 16 swizzled addresses per
  thread held across the loop: 96 bytes of spills at D = 256 with segment ids;
- dK and dV leave through shared memory (over K and V) and TMA stores.

Registers (consumers get 240 with setmaxnreg): dK + dV D/2, dQ D/4 (64 at D = 256) but only after S
and dP (32) are dead, row statistics 4. Shared memory (227 KiB): K, V 64 x D x 2 bytes each; Q and
dO `stages` x 64 x D x 2 each; P and dS two 64 x 64 buffers each (the second lets one group write
block i + 1 while the other still reads block i; `Tuning.prefetch_query` trades it for a second Q
stage); the dQ staging 64 x D x 4. At D = 256 that is
64 + 64 + 32 + 64 KiB with one Q / dO stage, at D = 192 48 + 96 + 32 + 48 KiB with two: 224 KiB
each. (`Sm90LargeHeadBackwardKernel.shared_memory_bytes` is checked against the struct.)

Preprocess (dPsum, the LSE in the exp2 domain) and postprocess (dQ scale and cast, the sinks
gradient) are kernels/host.py's, shared with backward.py and the sm100 backward.

D = 192 runs a variant of this layout by default (`Tuning.three_warpgroups`, measured 3-9 % faster,
and 1.4-1.5x in deterministic mode): 96 keys per CTA and three consumer warp groups of 64 head-dim
columns each (160 registers), dK / dV computed transposed (dK^T = Q^T dS, M = the group's columns), P and
dS stored with stmatrix; at D = Dv = 192 with two Q stages, one dO stage and one P / dS buffer
(`Tuning.prefetch_query`, measured 2-16 % faster), else one Q / dO stage and two P / dS buffers. D = 256
keeps the two groups above.

MLA's Dv = 128 (EXTRA_HEAD_DIM_PAIRS) takes the same layouts with V, dO and dV 128 wide: dP = dO V^T
has K = 128 (8 k-steps instead of 12). With three warp groups dV^T is two 64-row atoms: groups 0 and 1
own one each (M = 64, N = 96 keys, as dK^T), group 2 owns none and runs its own copy of the loop
without the dV GEMM (`dv_groups`; a copy rather than a branch around that wgmma, so that ptxas sees
the same straight pipeline in both). Per query block and CTA that is (in m64nNk16 instructions x N)
S 3 x 12 x 32, dP 3 x 8 x 32, dV^T 2 x 4 x 96, dK^T 3 x 4 x 96, dQ 3 x 6 x 64 = 832 / 960 of the
padded 192 / 192 kernel's work; splitting dV^T by keys instead (each group M = 128, N = 32) would
balance the groups but reads a third more shared memory per FLOP in those GEMMs (N = 32 reads 3 KiB a
k-step for 32 K MACs, N = 96 5 KiB for 96 K), which the S / dP GEMMs already saturate. Group 2's lighter
block lets it start the next block's S and dP while groups 0 and 1 finish dV. With two warp groups
(segment ids) each takes 64 of dV's 128 columns. The shared memory freed (V and one dO stage 24 and 16
KiB instead of 36 and 24: 197 KiB with three groups) does not hold a second Q / dO stage (+40 KiB);
`Tuning.prefetch_query` takes a second Q stage for the second P / dS buffer (as at Dv = 192).

In deterministic mode the dQ turns go in the staggered walk's arrival order on full masks whose key blocks
fit on half the SMs (`Tuning.rotated_turns`, the default), and otherwise highest key block first
(`Tuning.diagonal_first`, backward.py's order: under a causal mask that is the order the key blocks reach a
tile). `Tuning.stagger=False` (walk without a stagger, as backward.py does) is a candidate, off so that what
ships is what was measured; its prediction and device command are in docs/sm90_backward_tuning.md, "Large
head dims: the prepared candidates".
"""

from __future__ import annotations

import dataclasses
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
from fa4_jax.kernels.common import masking, ordered_reduction
from fa4_jax.kernels.sm90 import DEFAULT_SM_COUNT, backward_common
from fa4_jax.kernels.sm90.backward_common import TILE_M, BackwardOptions, Sm90BackwardBase
from fa4_jax.kernels.sm90.wgmma import (K_MAJOR, MN_MAJOR, WARP_GROUP, accumulator_mn, gemm, k_major_layout,
                                        swizzle_columns, transpose_view, warpgroup_first_thread)

SUPPORTED_HEAD_DIMS = (192, 256)
# DeepSeek MLA's (D, Dv), besides D = Dv: V, dO and dV are Dv wide (`Sm90LargeHeadBackwardKernel.dv_groups`).
EXTRA_HEAD_DIM_PAIRS = ((192, 128),)
TILE_N = 64                     # keys per CTA
THREE_WARPGROUPS_TILE_N = 96    # keys per CTA with `Tuning.three_warpgroups`
THREE_WARPGROUPS_HEAD_DIM = 192
PDS_READY_BARRIER = 1           # both groups' halves of P and dS are in shared memory
PDS_FREE_BARRIER = 3            # one P / dS buffer (`Tuning.prefetch_query`): all groups have read the last block
PDS_BUFFERS = 2


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Choices that change the speed, not the function computed (deterministic dQ keeps one fixed
    fp32 summation order in either turn order). DEFAULT_TUNING is the code measured on the H200; the
    other settings are candidates waiting for their measurement (prediction and device command in
    docs/sm90_backward_tuning.md, "Large head dims: the prepared candidates").

    diagonal_first: deterministic mode takes the dQ turns of a tile highest key block first, and the
      key blocks of a head launch highest first (backward.py's order). Under a causal mask key
      block n + 1 reaches every tile one step before key block n, so the turn order is the arrival
      order; lowest first, key block n waits ~n steps at its first tile. A CTA still waits only for
      CTAs launched before it. On (the default) at both head dims: deterministic causal mode measured
      1.9x faster at D = 192 (cuDNN ms / ours 0.64 / 0.70 -> 1.26 / 1.32 at 2k / 8k; rev d94ae72,
      benchmarks/results/backward_d192_diagonal_first_h200.json) and 1.6-1.8x at D = 256 (0.50 / 0.43
      -> 0.82 / 0.77 at 1k / 4k on an H100, rev 9938702,
      benchmarks/results/logs/next_sweeps_9938702_h100.tar.xz/), full rows unchanged. False: lowest first.
    stagger: key block n starts its walk n query blocks in, so the CTAs running together add into
      different dQ tiles (ignored in deterministic mode, which walks in plain order, or staggered with
      `rotated_turns`). Whether it pays here is open: backward.py walks without one
      (docs/sm90_backward_tuning.md has its measurement).
    three_warpgroups: None (the default) takes the layout that measured faster at the head dim:
      three warp groups at D = 192 (two with segment ids, which spill at 160 registers), two at
      D = 256; `options` resolves it (`resolved_tuning`). True: D = 192 only
      (construction raises otherwise). 96 keys per CTA and three consumer
      warp groups (160 registers each, producer 24), one Q / dO stage: S and dP split by keys (32
      each), dQ = dS K by head dim (64 columns each), and dK / dV computed transposed, dK^T = Q^T dS
      and dV^T = dO^T P with M = the group's 64 head-dim columns, N = the 96 keys (96 fp32
      accumulator registers a thread). Q / dO / LSE / dPsum are loaded and dQ reduce-added once per
      96 keys instead of per 64, a third less of that traffic per FLOP, and the dK / dV GEMMs get
      N = 96. Measured on the H200 (rev 162be91, cuDNN ms / ours, 2k / 8k): 1.25 / 1.27 -> 1.31 / 1.38
      causal, 1.31 / 1.34 -> 1.35 / 1.39 full; deterministic 0.43 / 0.46 -> 0.64 / 0.70 causal,
      0.74 / 0.88 -> 1.04 / 1.35 full (docs/sm90_backward_tuning.md, "D = 192: three consumer warp
      groups"). False keeps the two-group layout at D = 192, for comparison.
    prefetch_query: None (the default) takes it at D = Dv = 192 wherever the three-warp-group layout runs
      (not with segment ids, which keep two groups); True also at MLA's 192 / 128 (not yet timed there) and
      with segment ids; False keeps one Q stage and two P / dS buffers. The layout: a second Q stage, paid
      for with one P / dS buffer instead of two (the same shared memory: 222,208 bytes at Dv = 192,
      201,728 at Dv = 128). With one Q / dO stage the next block's load starts only once dK^T / dV^T have
      read the stage and has the dQ GEMM alone to hide under (an ncu stall profile puts ~10 % of the
      consumers' time at the query pipeline's full-barrier wait); the second stage's Q load is issued a
      whole block earlier. dO keeps one stage, in a ring and pipeline of its own (`do_pipe`, released
      with Q): S starts on Q while dO may still be arriving. (At Dv = 128 a second dO stage fits too, but
      its descriptors spill at 160 registers: 4 bytes stored, 12 loaded.) The single P / dS buffer is
      overwritten by block i + 1 only after every group's wgmmas reading block i have completed: a named
      barrier (PDS_FREE_BARRIER) before the P store, which each thread reaches after its wait_group(0) of
      block i. FA4's D = 192 configuration spends its shared memory this way (Q two stages, dO one, P / dS
      one buffer). Measured on an H100 (rev 6f403c6, cuDNN ms / ours, 2k / 8k): full 1.36 / 1.45 ->
      1.45 / 1.69, causal 1.27 / 1.37 -> 1.34 / 1.41; deterministic 1.04 / 1.34 -> 1.08 / 1.34 full,
      1.13 / 1.14 -> 1.13 / 1.15 causal (docs/sm90_backward_tuning.md, "D = 192: a second Q stage").
    rotated_turns (deterministic, full masks; the default since the measurement below): key block n walks
      the staggered order (starting n query blocks in) and each dQ tile takes its adds in arrival order
      (`ordered_reduction.rotated_turn`), launched lowest key block first, instead of the plain walk
      where all N key blocks of a head reach query block 0 together and queue one add latency apart
      at every tile after it (a convoy of ~L N (N - 1) / 2 against N M T of work). A key block then also
      waits for key blocks launched after it, so `options` keeps it only where a head's key blocks (of
      this layout's 64 or 96 keys) fit on half the SMs (`rotated_turns_reason`) and resolves it to False
      elsewhere. backward.py's same change measured on an H100 (rev 17f1841, cuDNN ms / ours,
      deterministic full masks at 1k / 4k): D = 64 0.84 -> 0.97, D = 128 0.79 -> 0.83; its default since.
      Here (an H100, rev bc0bd69, cuDNN ms / ours, deterministic full masks, plain -> rotated): D = 256
      2k 0.80 -> 0.89, 4k 0.80 -> 0.85, D = 192 2k 1.18 -> 1.25 (docs/sm90_backward_tuning.md, "Large
      heads: rotated turns").
    stage_dq_under_dk: a block's GEMMs issued dV and dQ first, dK last, so that dQ is staged for the writer
      warp while the tensor cores compute dK (and the dO stage, where it has its own pipe, released once dV
      has read it), as backward.py does (`stage_dq_under_dk` there: 2-6 % at D = 128). False: dV and dK, then
      dQ, and dQ staged once all three are done, with none of the group's GEMMs left in flight (the two waits
      at the end of a block held 16 % of our D = 192 samples against FA4's 3.4 %, profile at rev 249884f).
      None (the default) takes it where it measured faster (an H100, rev 3e69f08, ratio to cuDNN, 2k / 8k):
      the three-warp-group layout at D = Dv = 192 (causal 1.32 / 1.40 -> 1.34 / 1.41, full 1.45 / 1.64 ->
      1.47 / 1.73; deterministic +0 to +2 %) and deterministic D = 256 (full 0.89 / 0.93 -> 0.93 / 0.96,
      causal 0.85 / 0.79 -> 0.88 / 0.83); not at D = 256 without determinism (1.06 / 1.08 -> 0.77 / 0.76
      full, 1.00 / 0.99 -> 0.77 / 0.68 causal), nor where it was not timed (MLA's 192 / 128, two groups at
      D = 192). docs/sm90_backward_tuning.md, "Large heads: dQ staged under dK".
    dq_publish_after_dk: where dQ is staged under dK, publish it to the writer warp (the proxy fence before
      its bulk reduce, and the commit) after the wait for dK instead of right after the stores, where the
      fence waited for them (4.9 % of the samples at D = 192 causal, ncu, an H100, rev 1f1461b); backward.py's
      `Tuning.dq_publish_after_dk`. A candidate, off until measured.
    """
    diagonal_first: bool = True
    stagger: bool = True
    three_warpgroups: Optional[bool] = None
    prefetch_query: Optional[bool] = None
    rotated_turns: bool = True
    stage_dq_under_dk: Optional[bool] = None
    dq_publish_after_dk: bool = False


DEFAULT_TUNING = Tuning()


def unsupported_reason(config: AttentionConfig, problem: host.Problem) -> Optional[str]:
    """Why this kernel cannot take the call, or None when it can."""
    return backward_common.unsupported_reason("sm90 large-head backward", config, problem, SUPPORTED_HEAD_DIMS,
                                              extra_pairs=EXTRA_HEAD_DIM_PAIRS)


def query_stages(head_dim: int, tile_n: int = TILE_N) -> int:
    """Depth of the Q / dO ring: what is left of shared memory after K, V, P, dS and the dQ staging
    (two stages at D = 192, one at D = 256, one with the 96-key K and V of `Tuning.three_warpgroups`)."""
    return 2 if head_dim <= 192 and tile_n == TILE_N else 1


def resolved_tuning(tuning: Tuning, head_dim: int, has_segment_ids: bool = False,
                    v_head_dim: Optional[int] = None, deterministic: bool = False) -> Tuning:
    """`tuning` with the measured choices in place of None: three warp groups at D = 192 except with
    segment ids (where ptxas spilled 8 bytes at 160 registers, one dS stmatrix address a query block, until the
    descriptors moved to uniform registers; three groups there not yet timed) unless
    `prefetch_query` asks for them, two otherwise; `prefetch_query` where the three groups run at
    D = Dv = 192 (v_head_dim None: Dv = D); `stage_dq_under_dk` there and in deterministic mode at D = 256."""
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    if tuning.three_warpgroups is None:
        three = head_dim == THREE_WARPGROUPS_HEAD_DIM and (tuning.prefetch_query or not has_segment_ids)
        tuning = dataclasses.replace(tuning, three_warpgroups=three)
    three_at_192 = bool(tuning.three_warpgroups and head_dim == v_head_dim == THREE_WARPGROUPS_HEAD_DIM)
    if tuning.prefetch_query is None:
        tuning = dataclasses.replace(tuning, prefetch_query=three_at_192)
    if tuning.stage_dq_under_dk is None:
        tuning = dataclasses.replace(tuning, stage_dq_under_dk=three_at_192 or (
            deterministic and head_dim == v_head_dim == 256))
    return tuning


def keys_per_cta(tuning: Tuning) -> int:
    """The key block of the layout a resolved `tuning` builds: 96 keys with three warp groups, else 64."""
    return THREE_WARPGROUPS_TILE_N if tuning.three_warpgroups else TILE_N


def query_step(it, n_block, m_count, staggered: bool):
    """The query block, counted from the key block's first, of iteration `it` of key block n_block's walk
    over its m_count query blocks a head: in order, or `staggered` from n_block (mod m_count) on. Plain
    integer arithmetic, like ordered_reduction's: `_query_block` traces it, and
    tests/test_backward_block_ranges.py runs it on Python ints in its simulation of whole heads."""
    step = it % m_count
    if staggered:
        step = (step + n_block) % m_count
    return step


def tuning_reason(tuning: Tuning, head_dim: int) -> Optional[str]:
    """Why `tuning` cannot build the kernel at `head_dim`, or None."""
    if tuning.three_warpgroups and head_dim != THREE_WARPGROUPS_HEAD_DIM:
        return (f"Tuning(three_warpgroups=True) is the D = {THREE_WARPGROUPS_HEAD_DIM} layout (three warp "
                f"groups of 64 head-dim columns, 96 keys a CTA); at D = {head_dim} it fits neither the "
                f"registers nor the shared memory: use the default Tuning")
    if tuning.prefetch_query and (head_dim != THREE_WARPGROUPS_HEAD_DIM or tuning.three_warpgroups is False):
        return (f"Tuning(prefetch_query=True) changes the D = {THREE_WARPGROUPS_HEAD_DIM} three-warp-group layout "
                f"(a second Q stage for one P / dS buffer): not at D = {head_dim}, not with "
                f"three_warpgroups=False")
    return None


class Sm90LargeHeadBackwardKernel(Sm90BackwardBase):
    """The backward kernel for head dims 192 and 256; `__call__` is the host-side launcher."""

    def __str__(self):
        # The DSL names the compiled kernel after str(self): a fixed name instead of the default
        # repr (module path and address), so profiles show it and moving the class renames nothing.
        return "fa4_jax_sm90_backward_large_heads"

    def __init__(self, options: BackwardOptions):
        super().__init__(options)
        if options.head_splits != 1:
            raise ValueError(f"the large-head backward does not split heads (head_splits={options.head_splits})")
        reason = tuning_reason(options.tuning, self.head_dim)
        if reason is not None:
            raise ValueError(reason)
        tuning = resolved_tuning(options.tuning, self.head_dim, options.has_segment_ids, self.v_head_dim,
                                 options.deterministic)
        three_warpgroups = tuning.three_warpgroups
        # Consumer warp group g owns head-dim columns [g group_dim, (g + 1) group_dim) of dQ, dK and dV,
        # and keys [g tile_n / groups, ...) of S and dP.
        self.consumer_groups = 3 if three_warpgroups else 2
        self.group_dim = self.head_dim // self.consumer_groups
        # Transposed (dK^T = Q^T dS, dV^T = dO^T P): M = the group's head-dim columns, N = the keys.
        self.dkv_transposed = three_warpgroups
        # The warp groups that hold dV: all of them (each Dv / groups columns), except with three groups at
        # Dv = 128: dV^T's two 64-row atoms go to groups 0 and 1, and group 2 computes S, dP, dK^T and dQ
        # only (`_consume(holds_dv=False)`).
        assert self.v_head_dim % 64 == 0, "dV in whole 64-column MMA atoms"
        self.dv_groups = self.v_head_dim // self.group_dim if three_warpgroups else self.consumer_groups
        # Resolved by `options` (off where a head's key blocks may not all be resident at once).
        self.rotated_turns = tuning.rotated_turns and self.deterministic
        # Deterministic mode's turns by key block need the plain walk (with a stagger they would wait);
        # rotated turns are the staggered walk's arrival order, launched lowest key block first.
        self.stagger = self.rotated_turns or (tuning.stagger and not self.deterministic)
        self.staggered_walk = self.stagger      # `_first_query_block`, `_next_query_block`
        self.diagonal_first = self.deterministic and tuning.diagonal_first and not self.rotated_turns
        self.tile_n = keys_per_cta(tuning)
        self.stage_dq_under_dk = tuning.stage_dq_under_dk
        self.dq_publish_after_dk = tuning.dq_publish_after_dk and self.stage_dq_under_dk
        # `Tuning.prefetch_query`: two Q stages, dO one in a ring of its own (`separate_do_ring`), one P / dS
        # buffer.
        prefetch = tuning.prefetch_query
        self.stages = 2 if prefetch else query_stages(self.head_dim, self.tile_n)
        self.do_stages = 1 if prefetch else self.stages
        self.pds_buffers = 1 if prefetch else PDS_BUFFERS
        self.check_shared_memory()
        self.num_threads = WARP_GROUP * (1 + self.consumer_groups)
        self.consumer_threads = WARP_GROUP * self.consumer_groups
        # 24 x 128 + 160 x 384 <= 65536 with three consumer groups.
        self.producer_registers = 24
        self.consumer_registers = 160 if three_warpgroups else 240

    def shared_memory_bytes(self):
        """What `SharedStorage` takes, member by member with its alignment (mbarriers first)."""
        element = self.dtype.width // 8
        q_ring = self.stages * self.tile_m * self.head_dim * element
        do_ring = self.do_stages * self.tile_m * self.v_head_dim * element
        key_tile = self.tile_n * self.head_dim * element
        value_tile = self.tile_n * self.v_head_dim * element
        pds = self.pds_buffers * self.tile_m * self.tile_n * element
        members = [q_ring, do_ring, key_tile, value_tile, pds, pds, self.tile_m * self.head_dim * 4]
        offset = 8 * (self._query_barrier_count() + 2 + 2)
        for size in members:
            offset = host.ceil_div(offset, 1024) * 1024 + size
        return host.ceil_div(offset, 1024) * 1024

    @property
    def separate_do_ring(self) -> bool:
        """Whether dO has a ring (and pipeline, `do_pipe`) of its own: fewer stages than Q."""
        return self.do_stages != self.stages

    def _query_barrier_count(self) -> int:
        """The query pipeline's mbarriers (full and empty a stage), then the dO pipeline's where it has one."""
        return 2 * self.stages + (2 * self.do_stages if self.separate_do_ring else 0)

    # The producer (backward_common) runs without the row statistics' staging: this kernel reads LSE
    # and dPsum from global memory.
    staged_row_stats = False

    # -------------------------------------------------------------------------------- host side
    def _tiled_mmas(self):
        groups = self.consumer_groups
        # S = Q K^T, dP = dO V^T: M = 64 query rows, N = keys, tile_n / groups per warp group.
        mma_sdp = sm90_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_MAJOR, K_MAJOR, Float32, (1, groups, 1),
            (self.tile_m, self.tile_n // groups))
        if self.dkv_transposed:
            # dV^T += dO^T P, dK^T += Q^T dS: A = dO^T / Q^T read as [D, rows] (D contiguous), B = P
            # / dS read as [keys, rows] (keys contiguous); each warp group M = its columns of D.
            mma_dkv = sm90_helpers.make_trivial_tiled_mma(
                self.dtype, self.dtype, MN_MAJOR, MN_MAJOR, Float32, (groups, 1, 1),
                (self.group_dim, self.tile_n))
        else:
            # dV += P^T dO, dK += dS^T Q: A = P^T / dS^T (keys contiguous), B = dO / Q read as
            # [D, rows] (D contiguous); each warp group N = its columns of D.
            mma_dkv = sm90_helpers.make_trivial_tiled_mma(
                self.dtype, self.dtype, MN_MAJOR, MN_MAJOR, Float32, (1, groups, 1),
                (self.tile_n, self.group_dim))
        # dQ = dS K: A = dS (keys contiguous = K-major), B = K read as [D, keys].
        mma_dq = sm90_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, K_MAJOR, MN_MAJOR, Float32, (1, groups, 1),
            (self.tile_m, self.group_dim))
        return mma_sdp, mma_dkv, mma_dq

    def _dv_tiled_mma(self, mma_dkv):
        """The dV (dV^T) MMA: `mma_dkv` where dV has dK's shape (D = Dv); at Dv < D each warp group's
        N = Dv / groups columns of dV, or, transposed, the first `dv_groups` groups' M = 64 rows of dV^T each.
        Built where it is used, not passed to the kernel: a tiled MMA is a kernel parameter of its own,
        and the D = Dv kernels keep theirs."""
        if self.v_head_dim == self.head_dim:
            return mma_dkv
        if self.dkv_transposed:
            return sm90_helpers.make_trivial_tiled_mma(
                self.dtype, self.dtype, MN_MAJOR, MN_MAJOR, Float32, (self.dv_groups, 1, 1),
                (self.group_dim, self.tile_n))
        return sm90_helpers.make_trivial_tiled_mma(
            self.dtype, self.dtype, MN_MAJOR, MN_MAJOR, Float32, (1, self.consumer_groups, 1),
            (self.tile_n, self.v_head_dim // self.consumer_groups))

    def _dkv_tile(self, head_dim):
        """The (rows, columns) of the dK (`head_dim` D) or dV (Dv) accumulator: [keys, D], or [D, keys]
        transposed."""
        return (head_dim, self.tile_n) if self.dkv_transposed else (self.tile_n, head_dim)

    def _smem_layouts(self):
        d = self.head_dim
        # Q, dO and K are also read MN-major with MN = a warp group's columns of D (of Dv for dO), and
        # dK / dV are written over K / V by those columns: the swizzle atom must tile them (64 columns
        # at D = 256, with three warp groups and at Dv = 128, 32 at D = Dv = 192 with two).
        group_atom = swizzle_columns(self.group_dim, 64)
        value_atom = swizzle_columns(self.v_head_dim // self.dv_groups, 64)
        q_layout = k_major_layout(self.dtype, self.tile_m, d, self.stages, group_atom)
        do_layout = k_major_layout(self.dtype, self.tile_m, self.v_head_dim, self.do_stages, value_atom)
        k_layout = k_major_layout(self.dtype, self.tile_n, d, None, group_atom)
        v_layout = k_major_layout(self.dtype, self.tile_n, self.v_head_dim, None, value_atom)
        # P and dS as [rows, keys], keys contiguous: what the S accumulator writes pairwise, the
        # K-major A of dQ and (transposed) the MN-major A of dV / dK.
        pds_layout = k_major_layout(self.dtype, self.tile_m, self.tile_n, self.pds_buffers,
                                    swizzle_columns(self.tile_n, 64))
        return q_layout, do_layout, k_layout, v_layout, pds_layout

    @cute.jit
    def __call__(self, stream, mQ, mK, mV, mdO, mLSE, mdPsum, mQSegmentIds, mKVSegmentIds, mQSeqLengths, mKVSeqLengths,
                 mQStart, mdQacc, mSemaphores, mdK, mdV):
        # Logical views: rows, head dim, head, batch (JAX arrays are [B, S, H, D] row-major).
        # mdQacc stays [B, Hq, query block, 64 x D] (see `dq_reader`).
        qkv_order = [1, 3, 2, 0]
        mQ, mK, mV, mdO, mdK, mdV = [
            cute.make_tensor(t.iterator, cute.select(t.layout, mode=qkv_order))
            for t in (mQ, mK, mV, mdO, mdK, mdV)]
        # Row statistics [B, H, S_pad] -> (S_pad, H, B).
        mLSE, mdPsum = [cute.make_tensor(t.iterator, cute.select(t.layout, mode=[2, 1, 0]))
                        for t in (mLSE, mdPsum)]

        mma_sdp, mma_dkv, mma_dq = self._tiled_mmas()
        q_layout, do_layout, k_layout, v_layout, pds_layout = self._smem_layouts()
        q_stage_layout = cute.select(q_layout, mode=[0, 1])
        do_stage_layout = cute.select(do_layout, mode=[0, 1])
        tile_q = (self.tile_m, self.head_dim)
        tile_do = (self.tile_m, self.v_head_dim)
        tile_k = (self.tile_n, self.head_dim)
        tile_v = (self.tile_n, self.v_head_dim)

        load = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tma_mQ = cpasync.make_tiled_tma_atom(load, mQ, q_stage_layout, tile_q)
        tma_do, tma_mdO = cpasync.make_tiled_tma_atom(load, mdO, do_stage_layout, tile_do)
        tma_k, tma_mK = cpasync.make_tiled_tma_atom(load, mK, k_layout, tile_k)
        tma_v, tma_mV = cpasync.make_tiled_tma_atom(load, mV, v_layout, tile_v)
        store = cpasync.CopyBulkTensorTileS2GOp()
        tma_dk, tma_mdK = cpasync.make_tiled_tma_atom(store, mdK, k_layout, tile_k)
        tma_dv, tma_mdV = cpasync.make_tiled_tma_atom(store, mdV, v_layout, tile_v)
        self.query_block_bytes = cute.size_in_bytes(self.dtype, q_stage_layout)
        self.do_block_bytes = cute.size_in_bytes(self.dtype, do_stage_layout)
        if const_expr(not self.separate_do_ring):
            self.query_block_bytes += self.do_block_bytes
        self.key_block_bytes = (cute.size_in_bytes(self.dtype, k_layout)
                                + cute.size_in_bytes(self.dtype, v_layout))

        align = 1024

        @cute.struct
        class SharedStorage:
            query_barriers: cute.struct.MemRange[cutlass.Int64, self._query_barrier_count()]
            key_barriers: cute.struct.MemRange[cutlass.Int64, 2]
            dq_barriers: cute.struct.MemRange[cutlass.Int64, 2]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(q_layout)], align]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(do_layout)], align]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(k_layout)], align]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(v_layout)], align]
            sP: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(pds_layout)], align]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(pds_layout)], align]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, self.tile_m * self.head_dim],
                                   align]

        self.shared_storage = SharedStorage
        assert SharedStorage.size_in_bytes() == self.shared_memory_bytes(), (
            SharedStorage.size_in_bytes(), self.shared_memory_bytes())
        num_n_blocks = cute.ceil_div(cute.size(mK, mode=[0]), self.tile_n)
        grid = (num_n_blocks, cute.size(mK, mode=[2]), cute.size(mK, mode=[3]))
        self.kernel(mma_sdp, mma_dkv, mma_dq, tma_q, tma_mQ, tma_do, tma_mdO, tma_k, tma_mK,
                    tma_v, tma_mV, mdQacc, tma_dk, tma_mdK, tma_dv, tma_mdV, mLSE, mdPsum,
                    mQSegmentIds, mKVSegmentIds, mQSeqLengths, mKVSeqLengths, mQStart, mSemaphores, mQ.shape[0],
                    q_layout, do_layout, k_layout, v_layout, pds_layout).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    # ------------------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(self, mma_sdp, mma_dkv, mma_dq, tma_q, mQ, tma_do, mdO, tma_k, mK, tma_v, mV,
               mdQacc, tma_dk, mdK, tma_dv, mdV, mLSE, mdPsum, mQSegmentIds, mKVSegmentIds, mQSeqLengths, mKVSeqLengths,
               mQStart, mSemaphores, q_len_static, q_layout, do_layout, k_layout, v_layout, pds_layout):
        tidx, _, _ = cute.arch.thread_idx()
        n_block, kv_head, batch = cute.arch.block_idx()
        if const_expr(self.diagonal_first):
            n_block = cute.arch.grid_dim()[0] - 1 - n_block      # launched in dQ turn order
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        warp_group = cute.arch.make_warp_uniform(tidx // WARP_GROUP)

        storage = SmemAllocator().allocate(self.shared_storage)
        sQ = storage.sQ.get_tensor(q_layout.outer, swizzle=q_layout.inner)
        sdO = storage.sdO.get_tensor(do_layout.outer, swizzle=do_layout.inner)
        sK = storage.sK.get_tensor(k_layout.outer, swizzle=k_layout.inner)
        sV = storage.sV.get_tensor(v_layout.outer, swizzle=v_layout.inner)
        sP = storage.sP.get_tensor(pds_layout.outer, swizzle=pds_layout.inner)
        sdS = storage.sdS.get_tensor(pds_layout.outer, swizzle=pds_layout.inner)
        sdQ = storage.sdQ.get_tensor(cute.make_layout(self.tile_m * self.head_dim))

        producer = pipeline.CooperativeGroup(pipeline.Agent.Thread)
        consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.consumer_threads // 32)
        query_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.query_barriers.data_ptr(), num_stages=self.stages,
            producer_group=producer, consumer_group=consumers,
            tx_count=self.query_block_bytes, defer_sync=True)
        key_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.key_barriers.data_ptr(), num_stages=1,
            producer_group=producer, consumer_group=consumers,
            tx_count=self.key_block_bytes, defer_sync=True)
        do_pipe = None
        if const_expr(self.separate_do_ring):
            do_pipe = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.query_barriers.data_ptr() + 2 * self.stages, num_stages=self.do_stages,
                producer_group=producer, consumer_group=consumers, tx_count=self.do_block_bytes, defer_sync=True)
        # One dQ staging buffer (no room for two): the consumers fill it, the writer warp empties it.
        dq_pipe = pipeline.PipelineAsync.create(
            barrier_storage=storage.dq_barriers.data_ptr(), num_stages=1,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.consumer_threads),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
            defer_sync=True)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        # Geometry as in backward.py: global row = local row + q_start, and global row i sits at key
        # position i + offset. Every row position below (the query-block range, the masks, the
        # deterministic turns) is global; the row statistics, Q / dO tiles, dQ accumulator and turn
        # counters are indexed by local row or block.
        q_len, kv_len, offset = masking.batch_extents(batch, q_len_static, cute.size(mK, mode=[0]), mQSeqLengths,
                                                      mKVSeqLengths, self.q_total)
        q_start = Int32(0)
        if const_expr(self.has_q_start):
            q_start = mQStart[0]
        num_m_blocks = cute.ceil_div(q_len_static, self.tile_m)
        m_lo, m_hi = masking.query_block_range(self.mask, n_block, self.tile_m, self.tile_n, kv_len,
                                               offset + q_start, num_m_blocks)
        m_count = m_hi - m_lo
        iterations = m_count * self.group

        if warp_group == 0:
            cute.arch.setmaxregister_decrease(self.producer_registers)
            if warp_idx == 0:
                self._produce(tma_q, mQ, tma_do, mdO, tma_k, mK, tma_v, mV, sQ, sdO, sK, sV,
                              None, None, None, None, query_pipe, key_pipe, n_block, kv_head, batch,
                              m_lo, m_count, iterations, do_pipe=do_pipe)
            if warp_idx == 1:
                self._write_dq(dq_pipe, sdQ, mdQacc, mSemaphores, n_block, kv_head, batch, m_lo, m_count,
                               iterations, kv_len, offset, q_start)
        else:
            cute.arch.setmaxregister_increase(self.consumer_registers)
            consume = (mma_sdp, mma_dkv, self._dv_tiled_mma(mma_dkv), mma_dq, sQ, sdO, sK, sV, sP, sdS, sdQ,
                       query_pipe, do_pipe, key_pipe, dq_pipe, mLSE, mdPsum, mQSegmentIds, mKVSegmentIds,
                       (tma_dk, mdK, tma_dv, mdV), tidx - WARP_GROUP, n_block, kv_head, batch, m_lo, m_count,
                       iterations, offset, kv_len, q_len, q_start)
            if const_expr(self.dv_groups == self.consumer_groups):
                self._consume(*consume, holds_dv=True)
            else:
                # Two copies of the loop, so that no wgmma of either sits under a branch.
                if warp_group <= self.dv_groups:
                    self._consume(*consume, holds_dv=True)
                else:
                    self._consume(*consume, holds_dv=False)

    @cute.jit
    def _query_block(self, it, kv_head, n_block, m_lo, m_count):
        """(query head, query block) of iteration `it`: the group's heads in turn, each over the
        query blocks this key block sees (staggered by n_block when `self.stagger`, `query_step`)."""
        step = query_step(it, n_block, m_count, self.stagger)
        return kv_head * self.group + it // m_count, m_lo + step

    @cute.jit
    def _consume(self, mma_sdp, mma_dkv, mma_dv, mma_dq, sQ, sdO, sK, sV, sP, sdS, sdQ, query_pipe,
                 do_pipe, key_pipe, dq_pipe, mLSE, mdPsum, mQSegmentIds, mKVSegmentIds, dkv_store, tidx, n_block,
                 kv_head, batch, m_lo, m_count, iterations, offset, kv_len, q_len, q_start,
                 holds_dv: cutlass.Constexpr):
        """The consumer warp groups' loop; `holds_dv` False: a warp group outside the dV MMA
        (`dv_groups`), which computes and stores no dV. `do_pipe`: dO's own pipeline
        (`separate_do_ring`), else None (dO arrives with Q)."""
        thr_sdp = mma_sdp.get_slice(tidx)
        thr_dkv = mma_dkv.get_slice(tidx)
        thr_dv = None
        if const_expr(holds_dv):
            thr_dv = mma_dv.get_slice(tidx)
        thr_dq = mma_dq.get_slice(tidx)

        # Operand fragments: shared-memory descriptors (the stage / buffer is the last mode), sliced at the
        # warp group's first thread (`warpgroup_first_thread`; at `tidx` their descriptors were a third of the
        # instructions at D = 192, profile at rev 1f1461b).
        warpgroup_thread = warpgroup_first_thread(tidx)
        warpgroup_sdp = mma_sdp.get_slice(warpgroup_thread)
        warpgroup_dkv = mma_dkv.get_slice(warpgroup_thread)
        warpgroup_dv = None
        if const_expr(holds_dv):
            warpgroup_dv = mma_dv.get_slice(warpgroup_thread)
        warpgroup_dq = mma_dq.get_slice(warpgroup_thread)
        tSrQ = warpgroup_sdp.make_fragment_A(warpgroup_sdp.partition_A(sQ))
        tSrK = warpgroup_sdp.make_fragment_B(warpgroup_sdp.partition_B(sK))
        tdPrdO = warpgroup_sdp.make_fragment_A(warpgroup_sdp.partition_A(sdO))
        tdPrV = warpgroup_sdp.make_fragment_B(warpgroup_sdp.partition_B(sV))
        # P^T / dS^T [keys, rows] and dO / Q read as [D, rows]: A and B of dV, dK, or B and A of the
        # transposed dV^T, dK^T.
        tdVrP = tdVrdO = None
        if const_expr(self.dkv_transposed):
            if const_expr(holds_dv):
                tdVrP = warpgroup_dv.make_fragment_B(warpgroup_dv.partition_B(transpose_view(sP)))
                tdVrdO = warpgroup_dv.make_fragment_A(warpgroup_dv.partition_A(transpose_view(sdO)))
            tdKrdS = warpgroup_dkv.make_fragment_B(warpgroup_dkv.partition_B(transpose_view(sdS)))
            tdKrQ = warpgroup_dkv.make_fragment_A(warpgroup_dkv.partition_A(transpose_view(sQ)))
        else:
            if const_expr(holds_dv):
                tdVrP = warpgroup_dv.make_fragment_A(warpgroup_dv.partition_A(transpose_view(sP)))
                tdVrdO = warpgroup_dv.make_fragment_B(warpgroup_dv.partition_B(transpose_view(sdO)))
            tdKrdS = warpgroup_dkv.make_fragment_A(warpgroup_dkv.partition_A(transpose_view(sdS)))
            tdKrQ = warpgroup_dkv.make_fragment_B(warpgroup_dkv.partition_B(transpose_view(sQ)))
        tdQrdS = warpgroup_dq.make_fragment_A(warpgroup_dq.partition_A(sdS))
        tdQrK = warpgroup_dq.make_fragment_B(warpgroup_dq.partition_B(transpose_view(sK)))
        tPsP = thr_sdp.partition_C(sP)          # where this thread's P and dS values go
        tdSsdS = thr_sdp.partition_C(sdS)
        pds_store = None                        # plain stores, or (stmatrix copy, this thread's slice)
        if const_expr(self.dkv_transposed):
            # stmatrix (four 8x8 matrices, one address a thread per 4 registers): 2 swizzled addresses
            # per tile where the 32-bit stores take 8, which 160 registers cannot hold across the loop.
            pds_copy = cute.make_tiled_copy_C(
                sm90_helpers.get_smem_store_op(LayoutEnum.ROW_MAJOR, self.dtype, Float32), mma_sdp)
            thread_pds_copy = pds_copy.get_slice(tidx)
            tPsP = thread_pds_copy.partition_D(sP)
            tdSsdS = thread_pds_copy.partition_D(sdS)
            pds_store = (pds_copy, thread_pds_copy)
        # This thread's dQ values in shared memory, in register order.
        dq_chunks = self.tile_m * self.group_dim // (4 * WARP_GROUP)   # 4-value chunks a thread
        tdQsdQ = backward_common.register_order_staging(sdQ.iterator, tidx, dq_chunks)

        acc_dK = cute.make_rmem_tensor(thr_dkv.partition_shape_C(self._dkv_tile(self.head_dim)), Float32)
        acc_dK.fill(0.0)
        acc_dV = None
        if const_expr(holds_dv):
            acc_dV = cute.make_rmem_tensor(thr_dv.partition_shape_C(self._dkv_tile(self.v_head_dim)), Float32)
            acc_dV.fill(0.0)

        # (row, key) coordinates of this thread's S elements, viewed (rows, keys) for the masks.
        coords = accumulator_mn(thr_sdp.partition_C(
            cute.make_identity_tensor((self.tile_m, self.tile_n))))
        rows = cute.size(coords, mode=[0])
        key_base = n_block * self.tile_n
        key_segments = None
        if const_expr(self.dkv_transposed and self.mask.has_segments):
            # This thread's 8 keys' segment ids, loaded once: at 160 registers the 8 64-bit addresses
            # that the mask would otherwise keep across the loop spill.
            key_segments = cute.make_rmem_tensor(cute.make_layout(cute.size(coords, mode=[1])), Int32)
            last_key = cute.size(mKVSegmentIds, mode=[1]) - 1
            for c in cutlass.range_constexpr(cute.size(coords, mode=[1])):
                key_segments[c] = mKVSegmentIds[batch, cutlass.min(key_base + coords[0, c][1], last_key)]

        key_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        key_pipe.consumer_wait(key_state)
        query_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        do_state = None
        if const_expr(do_pipe is not None):
            do_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.do_stages)
        dq_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        pds_ready = pipeline.NamedBarrier(barrier_id=PDS_READY_BARRIER,
                                          num_threads=self.consumer_threads)
        pds_free = None
        if const_expr(self.pds_buffers == 1):
            pds_free = pipeline.NamedBarrier(barrier_id=PDS_FREE_BARRIER, num_threads=self.consumer_threads)
        m_start = self._first_query_block(n_block, m_lo, m_count)
        q_head, m_block = kv_head * self.group, m_start
        for it in cutlass.range(iterations, unroll=1):
            row_base = m_block * self.tile_m
            stage = query_state.index
            do_stage = stage
            buffer = 0
            if const_expr(self.pds_buffers > 1):
                buffer = it % self.pds_buffers
            query_pipe.consumer_wait(query_state)

            shape_s = thr_sdp.partition_shape_C((self.tile_m, self.tile_n))
            acc_s = cute.make_rmem_tensor(shape_s, Float32)
            acc_dp = cute.make_rmem_tensor(shape_s, Float32)
            warpgroup.fence()
            gemm(mma_sdp, acc_s, tSrQ[None, None, None, stage], tSrK, True)
            warpgroup.commit_group()
            if const_expr(do_pipe is not None):
                do_pipe.consumer_wait(do_state)     # S runs on Q meanwhile
                do_stage = do_state.index
                warpgroup.fence()
            gemm(mma_sdp, acc_dp, tdPrdO[None, None, None, do_stage], tdPrV, True)
            warpgroup.commit_group()

            # This thread's two rows' statistics, loaded while the GEMMs run.
            lse = cute.make_rmem_tensor(cute.make_layout(rows), Float32)
            dpsum = cute.make_rmem_tensor(cute.make_layout(rows), Float32)
            for r in cutlass.range_constexpr(rows):
                lse[r] = mLSE[row_base + coords[r, 0][0], q_head, batch]
                dpsum[r] = mdPsum[row_base + coords[r, 0][0], q_head, batch]

            warpgroup.wait_group(1)
            scores = accumulator_mn(acc_s)
            self.numerics.probabilities(acc_s, scores, coords, lse, n_block, q_start + row_base, row_base, key_base,
                                        kv_len, q_len, offset, mQSegmentIds, mKVSegmentIds, batch, key_segments)
            if const_expr(pds_free is not None):
                # One P / dS buffer: each thread comes here after its wait_group(0) of the last block, so
                # past this barrier no wgmma still reads that block's P or dS.
                pds_free.arrive_and_wait()
            self._round_into(acc_s, tPsP[None, None, None, buffer], pds_store)

            warpgroup.wait_group(0)
            self.numerics.ds_over_dp(scores, accumulator_mn(acc_dp), dpsum, lse)
            self._round_into(acc_dp, tdSsdS[None, None, None, buffer], pds_store)

            # Every group's keys of P and dS in shared memory before any reads the whole tile.
            cute.arch.fence_view_async_shared()
            pds_ready.arrive_and_wait()
            warpgroup.fence()
            dv = (mma_dv, acc_dV, tdVrdO, tdVrP, do_stage, buffer, holds_dv)
            dk = (mma_dkv, acc_dK, tdKrQ, tdKrdS, stage, buffer)
            if const_expr(not self.stage_dq_under_dk):
                self._dv_gemm(*dv)
                self._dk_gemm(*dk)
                warpgroup.commit_group()
                acc_dq = cute.make_rmem_tensor(thr_dq.partition_shape_C((self.tile_m, self.head_dim)),
                                               Float32)   # ((2 columns, 2 row halves, group_dim / 8), 1, 1)
                assert cute.size(acc_dq) == 4 * dq_chunks
                gemm(mma_dq, acc_dq, tdQrdS[None, None, None, buffer], tdQrK, True)
                warpgroup.commit_group()
                if const_expr(self.dkv_transposed):
                    # Free the Q / dO stage once dK and dV have read it, so that a load into it (with one
                    # stage, the next block's) runs under the dQ GEMM (which reads only dS and K).
                    warpgroup.wait_group(1)
                    query_pipe.consumer_release(query_state)
                    if const_expr(do_pipe is not None):
                        do_pipe.consumer_release(do_state)
                        do_state.advance()
                    warpgroup.wait_group(0)
                else:
                    warpgroup.wait_group(0)
                    query_pipe.consumer_release(query_state)
                query_state.advance()
                self._stage_dq(acc_dq, tdQsdQ, dq_chunks, dq_pipe, dq_state)
                self._publish_dq(dq_pipe, dq_state)
                dq_state.advance()
            else:
                # dV and dQ as one wgmma group, dK as the next: dQ is staged for the writer warp while dK
                # runs; the dO stage (where it has its own pipe) is free once dV is done, the Q stage once dK is.
                self._dv_gemm(*dv)
                acc_dq = cute.make_rmem_tensor(thr_dq.partition_shape_C((self.tile_m, self.head_dim)), Float32)
                gemm(mma_dq, acc_dq, tdQrdS[None, None, None, buffer], tdQrK, True)
                warpgroup.commit_group()
                self._dk_gemm(*dk)
                warpgroup.commit_group()
                warpgroup.wait_group(1)
                if const_expr(do_pipe is not None):
                    do_pipe.consumer_release(do_state)
                    do_state.advance()
                self._stage_dq(acc_dq, tdQsdQ, dq_chunks, dq_pipe, dq_state)
                if const_expr(not self.dq_publish_after_dk):
                    self._publish_dq(dq_pipe, dq_state)
                    dq_state.advance()
                warpgroup.wait_group(0)
                query_pipe.consumer_release(query_state)
                query_state.advance()
                if const_expr(self.dq_publish_after_dk):
                    self._publish_dq(dq_pipe, dq_state)
                    dq_state.advance()
            q_head, m_block = self._next_query_block(q_head, m_block, m_start, m_lo, m_count)

        self._store_dkv_tma(acc_dK, acc_dV, sK, sV, *dkv_store, thr_dkv, n_block, kv_head, batch,
                            tidx, thr_dv)

    @cute.jit
    def _dv_gemm(self, mma_dv, acc_dV, tdVrdO, tdVrP, do_stage, buffer, holds_dv: cutlass.Constexpr):
        """dV += P^T dO (with three warp groups transposed, dV^T += dO^T P); nothing in a group holding no dV."""
        if const_expr(holds_dv):
            if const_expr(self.dkv_transposed):
                gemm(mma_dv, acc_dV, tdVrdO[None, None, None, do_stage], tdVrP[None, None, None, buffer], False)
            else:
                gemm(mma_dv, acc_dV, tdVrP[None, None, None, buffer], tdVrdO[None, None, None, do_stage], False)

    @cute.jit
    def _dk_gemm(self, mma_dkv, acc_dK, tdKrQ, tdKrdS, stage, buffer):
        """dK += dS^T Q (with three warp groups transposed, dK^T += Q^T dS)."""
        if const_expr(self.dkv_transposed):
            gemm(mma_dkv, acc_dK, tdKrQ[None, None, None, stage], tdKrdS[None, None, None, buffer], False)
        else:
            gemm(mma_dkv, acc_dK, tdKrdS[None, None, None, buffer], tdKrQ[None, None, None, stage], False)

    @cute.jit
    def _stage_dq(self, acc_dq, tdQsdQ, dq_chunks, dq_pipe, dq_state):
        """Stage this block's dQ for the writer warp (waits only if it has not read the last block yet);
        `_publish_dq` hands it over, the caller advances `dq_state`."""
        dq_pipe.producer_acquire(dq_state)
        cute.autovec_copy(cute.make_tensor(acc_dq.iterator, cute.make_layout((4, dq_chunks))), tdQsdQ)

    @cute.jit
    def _round_into(self, accumulator, destination, stmatrix=None):
        """Round an fp32 S-shaped accumulator to the input type and store it into shared memory:
        with plain stores, or `stmatrix` = (tiled copy, thread slice) that partitioned `destination`."""
        rounded = cute.make_rmem_tensor(accumulator.layout, self.dtype)
        rounded.store(accumulator.load().to(self.dtype))
        if const_expr(stmatrix is None):
            cute.autovec_copy(rounded, destination)
        else:
            copy, thread_copy = stmatrix
            cute.copy(copy, thread_copy.retile(rounded), destination)

    @cute.jit
    def _write_dq(self, dq_pipe, sdQ, mdQacc, mSemaphores, n_block, kv_head, batch, m_lo, m_count,
                  iterations, kv_len, offset, q_start):
        """The dQ writer warp: per query block, wait for the staged dQ, add it into the fp32
        accumulator with one bulk reduce, free the buffer once the copy engine has read it.
        Deterministic: in the tile's turn (`ordered_reduction`), lowest key block first, or highest
        with `diagonal_first`, or in arrival order with `rotated_turns`; the buffer is freed once the add
        is complete."""
        lane = cute.arch.lane_idx()
        dq_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        tile_bytes = self.tile_m * self.head_dim * 4
        m_start = self._first_query_block(n_block, m_lo, m_count)
        q_head, m_block = kv_head * self.group, m_start
        for _ in cutlass.range(iterations, unroll=1):
            destination = mdQacc.iterator + cute.crd2idx((batch, q_head, m_block, 0), mdQacc.layout)
            dq_pipe.consumer_wait(dq_state)
            flag = None
            if const_expr(self.deterministic):
                if const_expr(self.rotated_turns):
                    # A full mask: every key block [0, N) visits every query block [m_lo, m_lo + m_count).
                    turn = ordered_reduction.rotated_turn(n_block, m_block - m_lo,
                                                          (kv_len + self.tile_n - 1) // self.tile_n, m_count)
                else:
                    turn = ordered_reduction.key_block_turn(
                        self.mask, n_block, q_start + m_block * self.tile_m, self.tile_m, self.tile_n, kv_len,
                        offset, highest_first=self.diagonal_first)
                flag = ordered_reduction.wait_for_turn(mSemaphores, (batch, q_head, m_block), turn, lane)
            if lane == 0:
                primitives.cp_reduce_async_bulk_global_shared_cta(
                    destination, sdQ.iterator, tile_bytes, op=primitives.CpReduceOp.ADD,
                    type=primitives.CpReduceType.F32)
            cute.arch.cp_async_bulk_commit_group()
            ordered_reduction.finish_bulk_adds(flag, lane)
            dq_pipe.consumer_release(dq_state)
            dq_state.advance()
            q_head, m_block = self._next_query_block(q_head, m_block, m_start, m_lo, m_count)


# ----------------------------------------------------------------------------------------------------
# JAX side
# ----------------------------------------------------------------------------------------------------


# The launcher's optional inputs after dPsum, by name (absent ones None).
OPTIONAL_INPUTS = ("q_segment_ids", "kv_segment_ids", "q_seq_lengths", "kv_seq_lengths", "q_start")


# The fp32 dQ accumulator in the kernel's staging order, [B, Hq, query block, 64 x D], and its reader
# (`backward_common.dq_from_fragments` says where each element sits).
dq_accumulator_shape = backward_common.flat_dq_accumulator_shape(TILE_M)


def dq_reader(tuning: Tuning):
    """The reader of that accumulator for `tuning`: the consumer warp groups' column groups, two of
    D/2 (three of 64 with `three_warpgroups`)."""
    assert tuning.three_warpgroups is not None, "dq_reader takes a resolved Tuning (resolved_tuning)"
    return backward_common.dq_from_fragments(TILE_M, column_groups=3 if tuning.three_warpgroups else 2)


def options(config: AttentionConfig, problem: host.Problem, tuning: Tuning = DEFAULT_TUNING) -> BackwardOptions:
    """The static kernel configuration for one call (`tuning`: this kernel's speed choices), with
    `rotated_turns` resolved to False where it cannot run (`rotated_turns_reason`)."""
    tuning = resolved_tuning(tuning, problem.head_dim, config.has_segment_ids, problem.v_head_dim,
                             config.deterministic)
    rotated_turns = tuning.rotated_turns and rotated_turns_reason(config, problem, tuning) is None
    return BackwardOptions.of(config, problem, dataclasses.replace(tuning, rotated_turns=rotated_turns))


def rotated_turns_reason(config: AttentionConfig, problem: host.Problem,
                         tuning: Tuning = DEFAULT_TUNING) -> Optional[str]:
    """Why `Tuning.rotated_turns` cannot order this call's dQ adds, or None: backward_common's rule, the
    key blocks of the layout `tuning` resolves to (`keys_per_cta`)."""
    resolved = resolved_tuning(tuning, problem.head_dim, config.has_segment_ids, problem.v_head_dim)
    return backward_common.rotated_turns_reason(config, host.ceil_div(problem.kv_len, keys_per_cta(resolved)),
                                                host.sm_count(DEFAULT_SM_COUNT))


def fake_arguments(config: AttentionConfig, shape, dtype_name: str) -> list:
    """Fake tensors in the launcher's order, for compiling without a GPU. shape = (B, Sq, Sk, Hq, Hkv, D)."""
    return host.backward_fake_arguments(config, shape, dtype_name, OPTIONAL_INPUTS, dq_accumulator_shape, TILE_M)


def run(options: BackwardOptions, query, key, value, out, lse, d_out, d_lse, optional: dict):
    """(dq, dk, dv, dsinks or None) for one attention call; traceable JAX."""
    return host.run_backward(Sm90LargeHeadBackwardKernel(options), options, query, key, value, out, lse, d_out,
                             d_lse, optional, OPTIONAL_INPUTS, dq_accumulator_shape, dq_reader(options.tuning),
                             TILE_M)
