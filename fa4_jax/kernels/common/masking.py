"""Which keys a query row may see, at two grains: whole key blocks and single scores.

Shared by the sm90 and sm100 forward kernels and both sm90 backward kernels. Positions follow the
contract: query row i (global) sits at key position i + offset (offset = Sk - Sq, or kv_len[b] -
q_len[b] with sequence lengths), and key j is visible iff

    j < kv_len                                   (always; kv_len = Sk without lengths)
    j <= i + offset                              (causal)
    i + offset - left <= j <= i + offset + right (window; a None side is unbounded)
    i < q_len                                    (with query lengths)
    q_segment[i] == kv_segment[j]                (with segment ids)

The block-grain functions are plain integer arithmetic: they run on Python ints (unit tests, host-side
grid sizing) and on `cutlass.Int32` inside a kernel, so the tested code is the code that runs. Integer
division only ever sees non-negative numerators, where floor and truncation agree.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from fa4_jax.kernels.common import integer


@dataclasses.dataclass(frozen=True)
class MaskShape:
    """The static part of a mask: which rules apply. Hashable, so it can sit in a compile key."""

    causal: bool = False
    window_left: Optional[int] = None
    window_right: Optional[int] = None
    has_q_lengths: bool = False
    has_segments: bool = False

    @classmethod
    def from_config(cls, config) -> "MaskShape":
        """The rules an `AttentionConfig` asks for (key lengths need no rule: they clip `kv_len`)."""
        return cls(causal=config.causal, window_left=config.window_left, window_right=config.window_right,
                   has_q_lengths=config.has_q_seq_lengths, has_segments=config.has_segment_ids)

    @property
    def right_reach(self) -> Optional[int]:
        """Largest j - (i + offset) that is visible, or None when unbounded on the right."""
        if self.causal and self.window_right is not None:
            return min(0, self.window_right)
        if self.causal:
            return 0
        return self.window_right


def batch_extents(batch, q_len, kv_len, q_lengths=None, kv_lengths=None, q_total=None):
    """(q_len, kv_len, offset) of batch element `batch`, for every kernel: the static lengths clipped
    by the per-batch length tensors where given, and offset = kv_len - q_len, with the query's global
    length `q_total` in place of q_len when the query is sharded on sequence."""
    if q_lengths is not None:
        q_len = integer.minimum(q_lengths[batch], q_len)
    if kv_lengths is not None:
        kv_len = integer.minimum(kv_lengths[batch], kv_len)
    aligned_q_len = q_len if q_total is None else q_total
    return q_len, kv_len, kv_len - aligned_q_len


@cute.jit
def tile_extents(shape: MaskShape, m_block, batch, tile_m, tile_n, q_len_static, kv_len_static,
                 q_lengths, kv_lengths, q_start, q_total):
    """(row_start, q_len, kv_len, offset, first key block, end key block) of query tile `m_block`
    (`tile_m` rows) of batch element `batch`: `batch_extents` and the tile's `key_block_range`, the
    one computation both forward kernels' tile loops start from. row_start is the position row of the
    tile's first query row, global when the query is split on sequence (`q_start`, a one-element
    tensor, or None); the length tensors are None when absent."""
    q_len, kv_len, offset = batch_extents(batch, q_len_static, kv_len_static, q_lengths, kv_lengths, q_total)
    local_row_start = m_block * tile_m
    row_start = local_row_start
    if cutlass.const_expr(q_start is not None):
        row_start = row_start + q_start[0]
    num_rows = cutlass.min(tile_m, q_len - local_row_start)
    first, end = key_block_range(shape, row_start, num_rows, tile_n, kv_len, offset)
    return row_start, q_len, kv_len, offset, first, end


def key_block_range(shape: MaskShape, row_start, num_rows, tile_n, kv_len, offset):
    """Key blocks [first, end) that hold any visible key for query rows [row_start, row_start+num_rows).

    `num_rows` counts only valid rows (a query tile clipped at q_len); with none, the range is empty.
    """
    last_row = row_start + num_rows - 1
    end = (kv_len + tile_n - 1) // tile_n
    reach = shape.right_reach
    if reach is not None:
        last_visible = last_row + offset + reach
        end = integer.minimum(end, (integer.maximum(last_visible, -1) + 1 + tile_n - 1) // tile_n)
    first = 0
    if shape.window_left is not None:
        first_visible = row_start + offset - shape.window_left
        first = integer.maximum(first_visible, 0) // tile_n
    end = integer.pick(num_rows > 0, integer.maximum(end, first), first)
    return first, end


def block_is_partial(shape: MaskShape, n_block, row_start, tile_m, tile_n, kv_len, q_len, offset):
    """Whether key block `n_block` needs per-score masking for the query tile starting at row_start.

    False means every key of the block is visible to every row of the tile (rows past q_len are
    only a concern with query lengths; without them such rows are never stored).
    """
    key_start = n_block * tile_n
    key_end = key_start + tile_n
    partial = key_end > kv_len
    reach = shape.right_reach
    if reach is not None:
        partial = integer.either(partial, key_end - 1 > row_start + offset + reach)
    if shape.window_left is not None:
        partial = integer.either(partial, key_start < row_start + tile_m - 1 + offset - shape.window_left)
    if shape.has_q_lengths:
        partial = integer.either(partial, row_start + tile_m > q_len)
    if shape.has_segments:
        partial = True
    return partial


def unmasked_block_range(shape: MaskShape, row_start, tile_m, tile_n, kv_len, q_len, offset):
    """Key blocks [first, end) that need no per-score mask for the query tile at row_start: exactly the
    blocks n >= 0 for which `block_is_partial` is False (end == first when there are none).

    The partial blocks of a tile sit at the two ends of its key range (right reach and kv_len at the
    top, a left window at the bottom), so a kernel can run the middle without masking code.
    """
    end = kv_len // tile_n
    reach = shape.right_reach
    if reach is not None:       # (n + 1) * tile_n - 1 <= row_start + offset + reach
        end = integer.minimum(end, integer.maximum(row_start + offset + reach + 1, 0) // tile_n)
    first = 0
    if shape.window_left is not None:   # n * tile_n >= row_start + tile_m - 1 + offset - left
        lowest = row_start + tile_m - 1 + offset - shape.window_left
        first = (integer.maximum(lowest, 0) + tile_n - 1) // tile_n
    if shape.has_segments:
        end = first
    if shape.has_q_lengths:
        end = integer.pick(row_start + tile_m > q_len, first, end)
    return first, integer.maximum(end, first)


@cute.jit
def apply_mask(
    scores_mn: cute.Tensor,
    coords_mn: cute.Tensor,
    shape: cutlass.Constexpr,
    row_start: cutlass.Int32,
    col_start: cutlass.Int32,
    kv_len: cutlass.Int32,
    q_len: cutlass.Int32,
    offset: cutlass.Int32,
    local_row_start: cutlass.Int32,
    q_segments: Optional[cute.Tensor] = None,
    kv_segments: Optional[cute.Tensor] = None,
    rows_per_position: cutlass.Constexpr = 1,
    kv_segment_columns: Optional[cute.Tensor] = None,
):
    """Set scores of invisible (row, key) pairs to -inf, in place.

    scores_mn / coords_mn: a thread's scores and their (row, col) tile coordinates, both viewed as
    (rows, cols). row_start: position of the tile's first row (for the position rules);
    local_row_start: its index into q_segments (differs when Q is split on sequence).
    q_segments / kv_segments: 1-D global tensors of the current batch (with segments).
    rows_per_position: tile rows that share one query position (the decode kernel packs the G query
    heads of one key/value head into consecutive rows, row = position * G + head); row_start then
    counts packed rows.
    kv_segment_columns: with segments, the KV segment id of each column of the view, loaded once by a
    kernel whose columns stay the same keys over its loop (kv_segments is then not read): 32-bit ids
    in registers where the per-column addresses into kv_segments would be 64 bits each.
    """
    for r in cutlass.range_constexpr(cute.size(scores_mn, mode=[0])):
        row = row_start + coords_mn[r, 0][0]
        if cutlass.const_expr(rows_per_position > 1):
            row = row // rows_per_position
        col_end = kv_len
        reach = shape.right_reach
        if cutlass.const_expr(reach is not None):
            col_end = cutlass.min(col_end, row + offset + reach + 1)
        col_first = 0
        if cutlass.const_expr(shape.window_left is not None):
            col_first = row + offset - shape.window_left
        if cutlass.const_expr(shape.has_q_lengths):
            if row >= q_len:
                col_end = -1
        row_segment = 0
        if cutlass.const_expr(shape.has_segments):
            local_row = local_row_start + coords_mn[r, 0][0]
            row_segment = q_segments[cutlass.min(local_row, q_segments.shape[0] - 1)]
        for c in cutlass.range_constexpr(cute.size(scores_mn, mode=[1])):
            col = col_start + coords_mn[0, c][1]
            visible = col < col_end
            if cutlass.const_expr(shape.window_left is not None):
                visible = visible and col >= col_first
            if cutlass.const_expr(shape.has_segments):
                if cutlass.const_expr(kv_segment_columns is None):
                    col_segment = kv_segments[cutlass.min(col, kv_segments.shape[0] - 1)]
                else:
                    col_segment = kv_segment_columns[c]
                visible = visible and col_segment == row_segment
            if not visible:
                scores_mn[r, c] = -Float32.inf


def query_block_range(shape: MaskShape, n_block, tile_m, tile_n, kv_len, row_offset, num_m_blocks):
    """Query blocks [first, end) whose `key_block_range` (taken over full tiles) holds key block n_block.

    The exact inverse of `key_block_range` at block grain, so a backward kernel that walks query blocks
    per key block visits the (query block, key block) pairs a forward kernel visits, and key block n is
    the (n - first)-th visitor of query block m, first = key_block_range(m)[0] (what a deterministic
    ordering of the dQ sums needs). row_offset: key position of local query row 0, i.e. offset plus
    the shard's first global row.
    """
    first = 0
    end = num_m_blocks
    reach = shape.right_reach
    if reach is not None:       # n * tile_n <= m * tile_m + tile_m - 1 + row_offset + reach
        lowest = n_block * tile_n - tile_m + 1 - row_offset - reach
        first = (integer.maximum(lowest, 0) + tile_m - 1) // tile_m
    if shape.window_left is not None:   # m * tile_m + row_offset - left < (n + 1) * tile_n
        bound = (n_block + 1) * tile_n - row_offset + shape.window_left
        end = integer.minimum(end, (integer.maximum(bound, 0) + tile_m - 1) // tile_m)
    end = integer.pick(n_block * tile_n < kv_len, integer.maximum(end, first), first)
    return first, end
