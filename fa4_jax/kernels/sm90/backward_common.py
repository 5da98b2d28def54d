"""What the two sm90 backward kernels share: their static options and the device code both run
(`Sm90BackwardBase`: the TMA producer, the dK / dV store through shared memory). P recomputed from the
stored LSE and dS with the softcap slope are common/backward_numerics.py's, and the JAX side around
the kernel call (the preprocess of dPsum and the LSE, the sinks gradient, the flow `run` drives) is
kernels/host.py's: both are shared with the sm100 backward.

Three stages, one obvious place each:
- preprocess (`host.backward_preprocess`, traceable JAX, one fused reduction): dPsum = rowsum(dO * O)
  - d_lse, the log-sum-exp moved to the exp2 domain (rows with no visible key get +inf so that P = 0
  there), both padded to whole query blocks of TILE_M rows;
- the kernel (backward.py for head dims 64-128, backward_large_heads.py for 192 / 256), which adds
  dQ into an fp32 accumulator and writes dK, dV;
- postprocess (`host.run_backward` with the kernel module's dQ read-back, then `host.sinks_gradient`):
  dQ scaled and cast.

A subclass of `Sm90BackwardBase` sets, besides what the base's __init__ sets: `tile_n` (keys per CTA),
`stages` (Q / dO ring depth; `do_stages` for dO where it has a ring of its own, `_produce`'s `do_pipe`),
`staged_row_stats` (whether the producer copies LSE / dPsum into the
ring), `consumer_threads`, `dkv_transposed` when its dK / dV accumulators are of dK^T / dV^T (class
default False), `poly_exp2_every` where part of its P takes the FMA-pipe exp2 (class default 0), and
`_query_block(it, kv_head, n_block, m_lo, m_count)`, the (query head, query block) of iteration `it` of a
CTA's walk, and `staggered_walk`, whether that walk starts each head at the key block's index (the consumers
and the dQ writer carry it: `_first_query_block`, `_next_query_block`); `_produce` reads those.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync

from fa4_jax.config import AttentionConfig
from fa4_jax.kernels import host
from fa4_jax.kernels.common import backward_numerics, masking
from fa4_jax.kernels.sm90.wgmma import WARP_GROUP, transpose_view

TILE_M = 64                    # query rows per block unless a kernel's options say otherwise
SHARED_MEMORY_BYTES = 232448   # per CTA on sm_90 (227 KiB)
DKV_STORE_BARRIER = 2          # named barrier of the consumers around the dK / dV store


@dataclasses.dataclass(frozen=True)
class BackwardOptions:
    """Everything static about one compiled backward kernel (hashable: with the kernel's name it is
    the compile key). `tuning` is the kernel module's own `Tuning`."""

    dtype_name: str            # "bfloat16" | "float16"
    head_dim: int
    v_head_dim: int            # of V, O, dO, dV: head_dim, or a kernel's EXTRA_HEAD_DIM_PAIRS partner
    group: int                 # query heads per key/value head
    scale: float
    causal: bool
    window_left: Optional[int]
    window_right: Optional[int]
    softcap: Optional[float]
    has_segment_ids: bool
    has_q_seq_lengths: bool
    has_kv_seq_lengths: bool
    has_q_start: bool
    q_total: Optional[int]
    deterministic: bool
    has_sinks: bool
    tuning: Any
    # CTAs that share a (key block, KV head, batch), each adding fp32 partial dK / dV (backward.py's
    # head splits, resolved from its Tuning by its `options`); the large-head kernel takes only 1.
    head_splits: int = 1
    # Packed variable-length sequences (attention_varlen; backward.py only): N, the static length of
    # cu_seqlens less one, which sizes the scheduler's slots; None: not packed.
    num_sequences: Optional[int] = None

    @property
    def packed(self) -> bool:
        return self.num_sequences is not None

    @classmethod
    def of(cls, config: AttentionConfig, problem: host.Problem, tuning, head_splits: int = 1) -> "BackwardOptions":
        return cls(problem.dtype, problem.head_dim, problem.v_head_dim, problem.group, config.scale, config.causal,
                   config.window_left, config.window_right, config.softcap, config.has_segment_ids,
                   config.has_q_seq_lengths, config.has_kv_seq_lengths, config.has_q_start, config.q_total,
                   config.deterministic, config.has_sinks, tuning, head_splits)


def unsupported_reason(kernel_name: str, config: AttentionConfig, problem: host.Problem,
                       head_dims, takes_packed: bool = False, extra_pairs=()) -> Optional[str]:
    """What either sm90 backward kernel (`kernel_name`, its `head_dims` with D = Dv and its
    `extra_pairs` of (D, Dv)) cannot take, or None: the checks of every kernel, the (key blocks, KV
    heads, batch) grid's limits, and q_start (`takes_packed`: the kernel schedules packed sequences)."""
    return (host.kernel_unsupported_reason(kernel_name, config, problem, head_dims, takes_packed, extra_pairs)
            or host.grid_unsupported_reason(kernel_name, problem)
            or host.q_start_unsupported_reason(kernel_name, config))


def rotated_turns_reason(config: AttentionConfig, key_blocks: int, sm_count: int) -> Optional[str]:
    """Why either kernel's `Tuning.rotated_turns` cannot order this call's dQ adds, `key_blocks` of a head
    on `sm_count` SMs, or None. Its turns are those of a full mask (every key block visits every query
    block), and a key block may wait for one launched after it, so all key blocks of a head must be
    resident at once: one CTA per SM, at most half the SMs (the other half for the heads that finish
    meanwhile, and for whatever else runs on the GPU)."""
    if not config.deterministic:
        return "rotated turns order deterministic dQ adds only"
    if config.causal or config.has_window or config.has_segment_ids or config.has_cu_seqlens or config.has_q_start:
        return "rotated turns need a full mask (no causal, window, segment ids, packed sequences or q_start)"
    if key_blocks > sm_count // 2:
        return (f"rotated turns need a head's {key_blocks} key blocks resident at once: at most half of the "
                f"{sm_count} SMs")
    return None


def register_order_staging(buffer_iterator, consumer_tidx, chunks: int):
    """Where consumer thread `consumer_tidx` (0 .. 128 x warp groups - 1) stages its dQ accumulator,
    `chunks` 4-value chunks in register order: thread t of warp group g puts chunk k at ((g K + k) 128 + t) 4 (K =
    `chunks`), so a warp stores 512 contiguous bytes per chunk, without bank conflicts
    (`dq_from_fragments` reads the accumulator this fills)."""
    return cute.make_tensor(
        buffer_iterator + ((consumer_tidx // WARP_GROUP) * chunks * WARP_GROUP + consumer_tidx % WARP_GROUP) * 4,
        cute.make_layout((4, chunks), stride=(1, 4 * WARP_GROUP)))


def next_query_block(q_head, m_block, m_start, m_lo, m_count, staggered: bool, select):
    """The (query head, query block) after (q_head, m_block) on a walk over query blocks [m_lo, m_lo + m_count)
    of each head in turn: the next block, wrapping to m_lo; the next head after the last block, or with
    `staggered` when the walk is back at its start m_start (`_first_query_block`). select(cond, a, b) picks a
    where cond holds: `cutlass.select_` in the kernel (integers as Int32), a Python conditional in the tests,
    which check it against the divisions of `_query_block` (backward_large_heads.query_step)."""
    m_block = m_block + 1
    wrapped = m_block == m_lo + m_count
    if staggered:
        m_block = select(wrapped, m_lo, m_block)
        return q_head + select(m_block == m_start, 1, 0), m_block
    return q_head + select(wrapped, 1, 0), select(wrapped, m_lo, m_block)


def _select(condition, if_true, if_false):
    """cutlass.select_ with Python integers as Int32 (`next_query_block`'s head increment)."""
    as_value = lambda value: Int32(value) if isinstance(value, int) else value  # noqa: E731
    return cutlass.select_(condition, as_value(if_true), as_value(if_false))


class Sm90BackwardBase:
    """The static configuration and the device code both sm90 backward kernels run."""

    # Whether the dK / dV accumulators hold dK^T / dV^T ([D, keys]; `_store_dkv_tma` transposes them).
    dkv_transposed = False
    # Every how many of a thread's scores one exp2 of P runs on the FMA pipe (`numerics`; 0: none).
    poly_exp2_every = 0

    def __init__(self, options: BackwardOptions):
        self.options = options
        self.dtype = host.cutlass_dtype(options.dtype_name)
        self.head_dim = options.head_dim
        self.v_head_dim = options.v_head_dim
        self.group = options.group
        self.scale = options.scale
        self.softcap = options.softcap
        self.has_segment_ids = options.has_segment_ids
        self.has_q_seq_lengths = options.has_q_seq_lengths
        self.has_kv_seq_lengths = options.has_kv_seq_lengths
        self.has_q_start = options.has_q_start
        self.q_total = options.q_total
        self.deterministic = options.deterministic
        self.tuning = options.tuning
        self.tile_m = TILE_M
        self.packed = options.packed
        # Packed: a sequence's last query block reads the next sequence's rows, which the query-length
        # rule hides.
        self.mask = masking.MaskShape(causal=options.causal, window_left=options.window_left,
                                      window_right=options.window_right,
                                      has_q_lengths=options.has_q_seq_lengths or options.packed,
                                      has_segments=options.has_segment_ids)

    def check_shared_memory(self):
        if self.shared_memory_bytes() > SHARED_MEMORY_BYTES:
            raise ValueError(f"head dim {self.head_dim} needs {self.shared_memory_bytes()} bytes of shared "
                             f"memory; sm_90 has {SHARED_MEMORY_BYTES}")

    def _sequence_rows(self, tensor, sequence, which: int):
        """A (rows, columns) view of `tensor` from the packed sequence's first query row (`which` 0) or
        key (1) on, `sequence` being (q_row0, k_row0, query slot); the tensor itself when not packed.
        TMA coordinates are plain integers, so tiles of such a view load and store at any row."""
        if const_expr(sequence is None):
            return tensor
        return cute.domain_offset((sequence[which], 0), tensor)

    # The walk over query blocks (`_query_block`) carried from one iteration to the next, for the consumers
    # and the dQ writer (the producer keeps `_query_block`). `staggered_walk`, set by the subclass: each head's
    # walk starts at query block n_block (mod the count) and wraps, as `_query_block` staggers it.
    @cute.jit
    def _first_query_block(self, n_block, m_lo, m_count):
        """The query block each head's walk starts at: the first, or with `staggered_walk` the key
        block's own index modulo the count (1 when a key block sees none: then it walks nothing)."""
        if const_expr(self.staggered_walk):
            return m_lo + n_block % cutlass.max(m_count, 1)
        return m_lo

    @cute.jit
    def _next_query_block(self, q_head, m_block, m_start, m_lo, m_count):
        """`next_query_block` in the kernel: the step after (q_head, m_block), with an add and a compare, where
        `_query_block` divides by the dynamic m_count (a signed division, ~25 SASS instructions per
        iteration under a causal mask, where m_count depends on the key block)."""
        return next_query_block(q_head, m_block, m_start, m_lo, m_count, self.staggered_walk, _select)

    @cute.jit
    def _publish_dq(self, dq_pipe, dq_state):
        """Hand this block's staged dQ (each kernel's `_stage_dq`) to the writer warp: the stores ordered
        before its bulk reduce (the async proxy), then the commit. `Tuning.dq_publish_after_dk` says where."""
        cute.arch.fence_proxy("async.shared", space="cta")
        dq_pipe.producer_commit(dq_state)

    @cute.jit
    def _produce(self, tma_q, mQ, tma_do, mdO, tma_k, mK, tma_v, mV, sQ, sdO, sK, sV, mLSE,
                 mdPsum, sLSE, sdPsum, query_pipe, key_pipe, n_block, kv_head, batch, m_lo, m_count,
                 iterations, sequence=None, do_pipe=None):
        """TMA loads: K and V once, then per iteration Q and dO into the next stage of `query_pipe`
        (one barrier for both); with `do_pipe`, dO into a ring of its own (`do_stages` deep, its own
        barrier), so that Q may run further ahead than dO."""
        tile_q = (self.tile_m, self.head_dim)
        tile_do = (self.tile_m, self.v_head_dim)
        tile_k = (self.tile_n, self.head_dim)
        tile_v = (self.tile_n, self.v_head_dim)
        gK = cute.local_tile(self._sequence_rows(mK[None, None, kv_head, batch], sequence, 1), tile_k, (n_block, 0))
        gV = cute.local_tile(self._sequence_rows(mV[None, None, kv_head, batch], sequence, 1), tile_v, (n_block, 0))
        tKsK, tKgK = cpasync.tma_partition(tma_k, 0, cute.make_layout(1),
                                           cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(tma_v, 0, cute.make_layout(1),
                                           cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))
        key_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        key_pipe.producer_acquire(key_state)
        cute.copy(tma_k, tKgK, tKsK, tma_bar_ptr=key_pipe.producer_get_barrier(key_state))
        cute.copy(tma_v, tVgV, tVsV, tma_bar_ptr=key_pipe.producer_get_barrier(key_state))

        query_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer,
                                                   self.stages)
        do_state = None
        if const_expr(do_pipe is not None):
            do_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.do_stages)
        for it in cutlass.range(iterations, unroll=1):
            q_head, m_block = self._query_block(it, kv_head, n_block, m_lo, m_count)
            gQ = cute.local_tile(self._sequence_rows(mQ[None, None, q_head, batch], sequence, 0), tile_q, (None, 0))
            gdO = cute.local_tile(self._sequence_rows(mdO[None, None, q_head, batch], sequence, 0), tile_do, (None, 0))
            tQsQ, tQgQ = cpasync.tma_partition(tma_q, 0, cute.make_layout(1),
                                               cute.group_modes(sQ, 0, 2),
                                               cute.group_modes(gQ, 0, 2))
            tOsdO, tOgdO = cpasync.tma_partition(tma_do, 0, cute.make_layout(1),
                                                 cute.group_modes(sdO, 0, 2),
                                                 cute.group_modes(gdO, 0, 2))
            query_pipe.producer_acquire(query_state)
            barrier = query_pipe.producer_get_barrier(query_state)
            cute.copy(tma_q, tQgQ[None, m_block], tQsQ[None, query_state.index],
                      tma_bar_ptr=barrier)
            if const_expr(do_pipe is None):
                cute.copy(tma_do, tOgdO[None, m_block], tOsdO[None, query_state.index],
                          tma_bar_ptr=barrier)
            else:
                do_pipe.producer_acquire(do_state)
                cute.copy(tma_do, tOgdO[None, m_block], tOsdO[None, do_state.index],
                          tma_bar_ptr=do_pipe.producer_get_barrier(do_state))
                do_state.advance()
            if const_expr(self.staged_row_stats):
                # Plain bulk copies are not elected by the compiler: one lane issues them.
                stats_copy = cute.make_copy_atom(cpasync.CopyBulkG2SOp(), Float32,
                                                 num_bits_per_copy=self.tile_m * 32)
                if cute.arch.lane_idx() == 0:
                    cute.copy(stats_copy,
                              cute.local_tile(mLSE[None, q_head, batch], (self.tile_m,), (m_block,)),
                              sLSE[None, query_state.index], mbar_ptr=barrier)
                    cute.copy(stats_copy,
                              cute.local_tile(mdPsum[None, q_head, batch], (self.tile_m,),
                                              (m_block,)),
                              sdPsum[None, query_state.index], mbar_ptr=barrier)
            query_state.advance()

    @property
    def numerics(self) -> backward_numerics.BackwardNumerics:
        """P from the stored LSE and dS with the softcap slope: the functions the sm100 backward shares."""
        return backward_numerics.BackwardNumerics(self.mask, self.softcap, self.scale, self.tile_m, self.tile_n,
                                                  self.poly_exp2_every)

    @cute.jit
    def _store_dkv_tma(self, acc_dK, acc_dV, sK, sV, tma_dk, mdK, tma_dv, mdV, thr_dkv, n_block,
                       kv_head, batch, tidx, thr_dv=None):
        """dK (scaled) and dV rounded into the K and V tiles' shared memory, then one TMA bulk store
        each; the copy engine clips the rows past the sequence end. With `dkv_transposed` the
        accumulators are of dK^T / dV^T and land through [D, keys] views of the same tiles. `thr_dv`:
        the dV MMA's slice where it is not `thr_dkv`'s; `acc_dV` None: this thread holds no dV (a warp
        group outside the dV MMA, backward_large_heads' three groups at Dv = 128)."""
        consumers = pipeline.NamedBarrier(barrier_id=DKV_STORE_BARRIER,
                                          num_threads=self.consumer_threads)
        consumers.arrive_and_wait()        # every warp group's last GEMMs have read K and V
        dk_tile, dv_tile = sK, sV
        if const_expr(self.dkv_transposed):
            dk_tile, dv_tile = transpose_view(sK), transpose_view(sV)
        rounded_dk = cute.make_rmem_tensor(acc_dK.layout, self.dtype)
        rounded_dk.store((acc_dK.load() * self.scale).to(self.dtype))
        cute.autovec_copy(rounded_dk, thr_dkv.partition_C(dk_tile))
        if const_expr(thr_dv is None):
            thr_dv = thr_dkv
        if const_expr(acc_dV is not None):
            rounded_dv = cute.make_rmem_tensor(acc_dV.layout, self.dtype)
            rounded_dv.store(acc_dV.load().to(self.dtype))
            cute.autovec_copy(rounded_dv, thr_dv.partition_C(dv_tile))
        cute.arch.fence_proxy("async.shared", space="cta")
        consumers.arrive_and_wait()
        self._copy_dkv_tiles(tma_dk, sK, mdK, tma_dv, sV, mdV, n_block, kv_head, batch, tidx)

    @cute.jit
    def _copy_dkv_tiles(self, tma_dk, sdK, mdK, tma_dv, sdV, mdV, n_block, kv_head, batch, tidx):
        """Warp 0 of the consumers sends the staged dK and dV tiles (`sdK`, `sdV`) to this CTA's key
        block of `mdK`, `mdV` with one TMA bulk copy each (a store or a reduce-add, as the atoms say)
        and waits until the copy engine has read them, so the shared memory outlives the reads."""
        if tidx // 32 == 0:
            gdK = cute.local_tile(mdK[None, None, kv_head, batch], (self.tile_n, self.head_dim), (n_block, 0))
            gdV = cute.local_tile(mdV[None, None, kv_head, batch], (self.tile_n, self.v_head_dim), (n_block, 0))
            tdKsdK, tdKgdK = cpasync.tma_partition(tma_dk, 0, cute.make_layout(1),
                                                   cute.group_modes(sdK, 0, 2),
                                                   cute.group_modes(gdK, 0, 2))
            tdVsdV, tdVgdV = cpasync.tma_partition(tma_dv, 0, cute.make_layout(1),
                                                   cute.group_modes(sdV, 0, 2),
                                                   cute.group_modes(gdV, 0, 2))
            cute.copy(tma_dk, tdKsdK, tdKgdK)
            cute.copy(tma_dv, tdVsdV, tdVgdV)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)


# ----------------------------------------------------------------------------------------------------
# JAX side: dQ staged in the wgmma accumulator's register order (both kernels)
# ----------------------------------------------------------------------------------------------------

def flat_dq_accumulator_shape(tile_m):
    """The fp32 dQ accumulator of a kernel that stages dQ in register order (backward_large_heads;
    backward with `Tuning.flat_dq`): [B, Hq, query block, tile_m x D] in the staging order."""
    return lambda batch, padded_rows, q_heads, head_dim: (batch, q_heads, padded_rows // tile_m, tile_m * head_dim)


def dq_from_fragments(tile_m, column_groups=2):
    """The reader of that accumulator: the accumulator [B, Hq, query block, tile_m x D] as [B, q_len, Hq, D].

    Within a block, consumer warp group g of `column_groups` G (columns g D/G ...) puts thread t = 32 w
    + 4 q + r's chunk k = m D/(8 G) + j (rows 64 m ..., columns 8 j ... of its D/G) at ((g K + k) 128 +
    t) 4, K = tile_m D / (128 G) chunks a thread; the chunk's 4 values are (row half h, column c) =
    (0, 0), (0, 1), (1, 0), (1, 1). That value is row 64 m + 16 w + 8 h + q, column g D/G + 8 j + 2 r +
    c of the block (the PTX ISA's wgmma D fragment layout, repeated over the 64-row atoms m). G = 2
    (backward.py, backward_large_heads.py's default) or 3 (its `three_warpgroups`: 64 columns each)."""
    def rows(dq_accum, q_len: int):
        batch, heads, blocks, flat = dq_accum.shape
        head_dim = flat // tile_m
        fragments = dq_accum.reshape(batch, heads, blocks, column_groups, tile_m // 64,
                                     head_dim // (8 * column_groups), 4, 8, 4, 2, 2)
        # axes: 0 batch, 1 heads, 2 blocks, 3 g, 4 m, 5 j, 6 w, 7 q, 8 r, 9 h, 10 c
        rows_columns = fragments.transpose(0, 2, 4, 6, 9, 7, 1, 3, 5, 8, 10)
        return rows_columns.reshape(batch, blocks * tile_m, heads, head_dim)[:, :q_len]
    return rows
