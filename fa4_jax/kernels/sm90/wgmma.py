"""What the sm90 kernels share about wgmma: shared-memory operand layouts, views of a thread's
accumulator fragment, the warp-group GEMM loop, and where a warp group slices its operands
(`warpgroup_first_thread`).

wgmma reads A and B from shared memory through swizzled layouts (`k_major_layout`, `mn_major_layout`,
`transpose_view` for the other operand role of the same bytes) or A from registers, and leaves each
thread a (2, 2, N/8) fragment of C: `accumulator_mn` views it as (rows, columns), `query_major_view` as
(query, key) when the tile is S^T, `accumulator_as_operand_a` as the register A operand of the next GEMM.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_helpers
from cutlass.cute.nvgpu import warpgroup
from cutlass.tensor_utils import LayoutEnum

K_MAJOR = cute.nvgpu.OperandMajorMode.K
MN_MAJOR = cute.nvgpu.OperandMajorMode.MN
WARP_GROUP = 128           # threads in a warp group, the unit wgmma issues from


def warpgroup_first_thread(tidx):
    """The first thread of `tidx`'s warp group, warp-uniform: where a tiled MMA's shared-memory operands
    are sliced. A wgmma operand is one descriptor a warp group; sliced there, its descriptors are built in
    uniform registers (one 64-bit add a wgmma), where slicing at `tidx` builds them per thread and moves
    them over with two R2UR a wgmma."""
    return cute.arch.make_warp_uniform(tidx // WARP_GROUP) * WARP_GROUP


def transpose_view(tensor):
    """Swap the first two modes of a (swizzled) shared-memory tensor: same bytes, other operand role."""
    modes = [1, 0] + list(range(2, cute.rank(tensor)))
    return cute.make_tensor(tensor.iterator, cute.select(tensor.layout, mode=modes))


def swizzle_columns(columns, widest):
    """The widest swizzle atom (in elements, at most `widest` = one 128-byte row) that tiles `columns`:
    64 / 32 / 16 / 8 two-byte elements are the 128 / 64 / 32 / 16-byte swizzles (halve for fp32)."""
    width = widest
    while columns % width:
        width //= 2
    return width


def k_major_layout(dtype, rows, cols, stages=None, atom_cols=None):
    """Row-major [rows, cols] tile(s), swizzle atom `atom_cols` wide (default: the widest that `cols`
    allows), tiled rows first; `stages`: None, a count, or a tuple of counts (one mode each) of such
    tiles.

    Read K-major it is an operand with K = cols; through `transpose_view` the same bytes are an
    MN-major operand with MN = cols, K = rows (wgmma reads both)."""
    atom = warpgroup.make_smem_layout_atom(
        sm90_helpers.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, atom_cols or cols), dtype)
    if stages is None:
        stages = ()
    elif isinstance(stages, int):
        stages = (stages,)
    shape = (rows, cols, *stages)
    return cute.tile_to_shape(atom, shape, order=tuple(range(len(shape))))


def mn_major_layout(dtype, rows, cols, stages):
    """[rows, cols] tiles with rows contiguous: the MN-major A operand (M = rows, K = cols)."""
    atom = warpgroup.make_smem_layout_atom(
        sm90_helpers.get_smem_layout_atom(LayoutEnum.COL_MAJOR, dtype, rows), dtype)
    return cute.tile_to_shape(atom, (rows, cols, stages), order=(1, 0, 2))


def fresh_atom(tiled_mma, accumulate):
    """A new MMA atom per GEMM, so toggling ACCUMULATE never leaks across loop iterations."""
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, accumulate)
    return atom


def query_major_view(fragment):
    """A thread's S^T accumulator (keys x queries) as a (query, key) matrix view.

    wgmma's C fragment holds (2, 2, N/8) values: column pair, row half (+8), column chunk (+8), so the
    query (column) coordinate varies over modes 0 and 2 and the key (row) coordinate over mode 1."""
    chunks = cute.size(fragment, mode=[0, 2])
    query_major = cute.make_layout(((2, chunks), 2), stride=((1, 4), 2))
    return cute.make_tensor(fragment.iterator, cute.composition(fragment.layout, query_major))


@cute.jit
def gemm(tiled_mma, acc, frag_a, frag_b, zero_init: cutlass.Constexpr):
    """acc (+)= A B over the K blocks of the fragments, issued async (caller commits and waits)."""
    atom = fresh_atom(tiled_mma, not zero_init)
    for k in cutlass.range_constexpr(cute.size(frag_a, mode=[2])):
        cute.gemm(atom, acc, frag_a[None, None, k], frag_b[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)


@cute.jit
def gemm_group(tiled_mma: cute.TiledMma, acc: cute.Tensor, a: cute.Tensor, b: cute.Tensor,
               zero_init: cutlass.Constexpr):
    """`gemm` fenced and committed as one wgmma group of its own (the caller waits)."""
    warpgroup.fence()
    gemm(tiled_mma, acc, a, b, zero_init)
    warpgroup.commit_group()


def accumulator_mn(acc: cute.Tensor) -> cute.Tensor:
    """View a wgmma accumulator ((2, 2, N/8), M, N) per thread as (rows, cols).

    Mode 0 is (2 adjacent columns, 2 rows 8 apart, N/8 column groups): rows are (mode0[1], M),
    columns (mode0[0], mode0[2], N).
    """
    compact = cute.make_layout(acc.layout.shape)
    rows_cols = cute.make_layout(
        ((compact.shape[0][1], compact.shape[1]),
         (compact.shape[0][0], compact.shape[0][2], compact.shape[2])),
        stride=((compact.stride[0][1], compact.stride[1]),
                (compact.stride[0][0], compact.stride[0][2], compact.stride[2])),
    )
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, rows_cols))


def accumulator_as_operand_a(acc: cute.Tensor) -> cute.Tensor:
    """View the S accumulator ((2, 2, N/8), M, N) as a 16-bit wgmma A operand ((2, 2, 2), M, N/16).

    For 16-bit inputs one A k-block of 16 columns is exactly two accumulator column groups, so the
    registers line up with no data movement.
    """
    split = cute.logical_divide(acc.layout, ((None, None, 2), None, None))
    return cute.make_tensor(acc.iterator, cute.make_layout(
        ((split.shape[0][0], split.shape[0][1], split.shape[0][2][0]), split.shape[1],
         (split.shape[0][2][1], split.shape[2])),
        stride=((split.stride[0][0], split.stride[0][1], split.stride[0][2][0]), split.stride[1],
                (split.stride[0][2][1], split.stride[2])),
    ))
