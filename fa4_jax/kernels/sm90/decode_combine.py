"""The merge of the split-KV decode kernel's partials as one small kernel (`DecodeOptions.combine="kernel"`).

The decode kernel (decode.py) leaves, per split, a normalised fp32 partial O [B, Hkv * row tiles, splits,
16, D] and its LSE [B, Hkv * row tiles, splits, 16] (only a tile's real rows written). XLA merges them in
three kernels (`combine_partials`, staged: ~1.3 us each at B = 1 on an H100, 3.9 us of a 7.95 us step at
1k keys); this kernel is the same merge in one launch:

    lse = log(sum_p exp(lse_p) + exp(sink)),  O = sum_p exp(lse_p - lse) O_p   (in the output dtype)

and a row whose every partial and sink is -inf gets O = 0, LSE = -inf, as `decode._merge_in_stages`.

The work is a few hundred KB read once from L2 (the partials were just written), so its time is latency:
the launch and the round trips to L2. Hence
- one thread per (batch, key/value head, packed row, COLUMNS-column chunk): at B = 1, Hkv = 8, one token
  of 4 heads a group, D = 128 that is 1024 threads; a warp is one row of D = 128 (its LSE loads are one
  broadcast, its O loads 512 contiguous bytes), and a CTA is one warp, so even B = 1 spreads its reads
  over 32 SMs instead of the 8 that a (batch, head) CTA would use;
- each thread issues the loads of SPLITS_IN_FLIGHT splits together (every LSE and every 16-byte O chunk
  of the group before any arithmetic), so 32 splits (B = 1 at 8k) are one L2 round trip, not a chain;
  more splits take more such groups, merged online (the running maximum rescales the running sums);
- no shared memory and no barrier; plain loads and stores only, so the same code compiles for sm_90 and
  sm_100.
Packed rows map to heads as in the decode kernel: row = position * G + head in group, row tile = row //
16. The sinks (one logit per query head, no value) start the merge: its maximum at the sink, its sum 1.
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
from cutlass import Float32

from fa4_jax.kernels import host
from fa4_jax.kernels.common import online_softmax

THREADS = 32           # per CTA: one warp, so that small batches spread over many SMs
COLUMNS = 4            # fp32 columns a thread merges: one 16-byte load per split
SPLITS_IN_FLIGHT = 32  # splits whose loads a thread issues before merging them (registers: 5 per split)


@dataclasses.dataclass(frozen=True)
class CombineOptions:
    """Everything static about one compiled combine kernel (hashable: the compile key)."""

    dtype_name: str     # of the final O (the query's)
    head_dim: int
    group: int          # query heads per key/value head
    q_len: int
    num_splits: int
    tile_rows: int      # packed rows per partial tile (the decode kernel's TILE_M)
    has_sinks: bool

    @property
    def rows(self) -> int:
        """Packed query rows per key/value head."""
        return self.q_len * self.group

    @property
    def row_tiles(self) -> int:
        return -(-self.rows // self.tile_rows)

    @property
    def chunks(self) -> int:
        """COLUMNS-column chunks per row: threads per row."""
        return self.head_dim // COLUMNS

    @property
    def ctas_per_head(self) -> int:
        return -(-self.rows * self.chunks // THREADS)

    def check(self):
        """Raise ValueError when these options cannot make a kernel."""
        if self.head_dim % COLUMNS or self.num_splits < 1:
            raise ValueError(f"head_dim must be a multiple of {COLUMNS} and num_splits >= 1; got {self.head_dim}, "
                             f"{self.num_splits}")


class Sm90DecodeCombineKernel:
    """Merges the decode kernel's split partials and the sinks into the final O and LSE (module docstring)."""

    def __str__(self):
        return "fa4_jax_sm90_decode_combine"

    def __init__(self, options: CombineOptions):
        options.check()
        self.options = options
        self.dtype = host.cutlass_dtype(options.dtype_name)

    @cute.jit
    def __call__(self, stream: cuda.CUstream, mPartialO: cute.Tensor, mPartialLSE: cute.Tensor,
                 mSinks: Optional[cute.Tensor], mO: cute.Tensor, mLSE: cute.Tensor):
        kv_heads = mO.shape[2] // self.options.group
        self.kernel(mPartialO, mPartialLSE, mSinks, mO, mLSE).launch(
            grid=(self.options.ctas_per_head, kv_heads, mO.shape[0]), block=[THREADS, 1, 1], stream=stream,
            min_blocks_per_mp=1)

    @cute.kernel
    def kernel(self, mPartialO: cute.Tensor, mPartialLSE: cute.Tensor, mSinks: Optional[cute.Tensor],
               mO: cute.Tensor, mLSE: cute.Tensor):
        tidx = cute.arch.thread_idx()[0]
        cta, head_kv, batch_index = cute.arch.block_idx()
        group, splits = self.options.group, self.options.num_splits
        item = cta * THREADS + tidx
        row = item // self.options.chunks
        chunk = item % self.options.chunks
        if row < self.options.rows:
            head_tile = head_kv * self.options.row_tiles + row // self.options.tile_rows
            tile_row = row % self.options.tile_rows
            head = head_kv * group + row % group
            # The running merge: its maximum LSE `top`, the sum of exp(lse - top) and the O sum under it.
            top = -Float32.inf
            total = Float32(0.0)
            if cutlass.const_expr(mSinks is not None):
                top = mSinks[head]
                total = Float32(1.0)
            # This thread's chunk of every split, and every split's LSE of its row: one address each, the
            # splits at constant offsets from it.
            split_chunks = cute.local_tile(mPartialO[batch_index, head_tile, None, tile_row, None],
                                           (splits, COLUMNS), (0, chunk))
            split_lse = mPartialLSE[batch_index, head_tile, None, tile_row]
            acc = cute.make_rmem_tensor(COLUMNS, Float32)
            acc.fill(0.0)
            shift = Float32(0.0)
            for start in cutlass.range_constexpr(0, splits, SPLITS_IN_FLIGHT):
                size = min(SPLITS_IN_FLIGHT, splits - start)
                # Every load of the group first, so that they are all in flight at once.
                part_lse = cute.make_rmem_tensor(size, Float32)
                part_o = cute.make_rmem_tensor((COLUMNS, size), Float32)
                for i in cutlass.range_constexpr(size):
                    part_o[None, i].store(split_chunks[start + i, None].load())
                    part_lse[i] = split_lse[start + i]
                group_top = top
                for i in cutlass.range_constexpr(size):
                    group_top = cute.arch.fmax(group_top, part_lse[i])
                # The sums so far rescaled to the new maximum and this group's weights against it (shift 0
                # while every LSE so far is -inf: every weight is then 0, never NaN).
                shift = group_top * online_softmax.LOG2_E
                if group_top == -Float32.inf:
                    shift = Float32(0.0)
                rescale = cute.math.exp2(top * online_softmax.LOG2_E - shift, fastmath=True)
                total = total * rescale
                acc.store(acc.load() * rescale)
                for i in cutlass.range_constexpr(size):
                    weight = cute.math.exp2(part_lse[i] * online_softmax.LOG2_E - shift, fastmath=True)
                    total = total + weight
                    acc.store(acc.load() + weight * part_o[None, i].load())
                top = group_top
            lse = -Float32.inf
            scale = Float32(0.0)
            if total > 0.0:
                lse = (shift + cute.math.log2(total, fastmath=True)) * online_softmax.LN_2
                scale = cute.arch.rcp_approx(total)
            position = row // group
            g_o = cute.local_tile(mO[batch_index, position, head, None], (COLUMNS,), (chunk,))
            g_o.store((acc.load() * scale).to(self.dtype))
            if chunk == 0:
                mLSE[batch_index, head, position] = lse


# --------------------------------------------------------------------------------------------------
# The JAX side (decode.run calls `run` after the decode kernel when combine="kernel").

@functools.lru_cache(maxsize=None)
def _kernel(options: CombineOptions) -> Sm90DecodeCombineKernel:
    return Sm90DecodeCombineKernel(options)


def partial_shapes(options: CombineOptions, batch: int, kv_heads: int):
    """The partials it reads: O [B, Hkv * row tiles, splits, tile rows, D], LSE [B, Hkv * row tiles, splits,
    tile rows] (float32)."""
    leading = (batch, kv_heads * options.row_tiles, options.num_splits, options.tile_rows)
    return leading + (options.head_dim,), leading


def output_shapes(options: CombineOptions, batch: int, kv_heads: int):
    """O [B, Sq, Hq, D], LSE [B, Hq, Sq]."""
    q_heads = kv_heads * options.group
    return (batch, options.q_len, q_heads, options.head_dim), (batch, q_heads, options.q_len)


def run(options: CombineOptions, partial_o, partial_lse, sinks=None):
    """(out [B, Sq, Hq, D] in options.dtype_name, lse [B, Hq, Sq] float32), traceable under jax.jit."""
    batch, kv_heads = partial_o.shape[0], partial_o.shape[1] // options.row_tiles
    o_shape, lse_shape = output_shapes(options, batch, kv_heads)
    outputs = (jax.ShapeDtypeStruct(o_shape, jnp.dtype(options.dtype_name)),
               jax.ShapeDtypeStruct(lse_shape, jnp.float32))
    kernel = _kernel(options)
    out, lse = host.call_kernel(kernel, (partial_o, partial_lse, sinks if options.has_sinks else None), outputs,
                                (str(kernel), options))
    return out, lse


def fake_arguments(options: CombineOptions, batch: int, kv_heads: int) -> list:
    """Fake tensors in the kernel's argument order, for compiling without a GPU: (partial O, partial LSE,
    sinks or None, out, lse)."""
    o_shape, lse_shape = partial_shapes(options, batch, kv_heads)
    out_shape, out_lse_shape = output_shapes(options, batch, kv_heads)
    return [host.fake_tensor(Float32, o_shape), host.fake_tensor(Float32, lse_shape),
            host.fake_tensor(Float32, (kv_heads * options.group,)) if options.has_sinks else None,
            host.fake_tensor(host.cutlass_dtype(options.dtype_name), out_shape),
            host.fake_tensor(Float32, out_lse_shape)]
