"""Unit tests of the building blocks shared by the sm90 and sm100 kernels, on the CPU.

The block-grain mask functions and the tile scheduler are plain integer code that the kernels run on
`cutlass.Int32`; here the same functions run on Python ints against the NumPy oracle's visibility
matrix. The polynomial exp2 is checked through its float32 NumPy mirror. (The online softmax is DSL
code only: its numerics, classic and lazy rescaling, with and without the polynomial, are tested on
the H200 in tests/test_sm90_forward.py; its compilation in tests/test_kernel_compile_sm90.py.)
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import numpy_reference
pytest.importorskip("cutlass")  # the kernel modules need nvidia-cutlass-dsl (Linux only)
from fa4_jax.kernels.common import exp2_polynomial, masking, tile_scheduler  # noqa: E402

TILE_M, TILE_N = 128, 64


def _mask_cases():
    rng = np.random.default_rng(1234)
    windows = [None, (0, 0), (70, 10), (None, 33), (200, None), (5, None)]
    for causal, window, q_lengths in itertools.product((False, True), windows, (False, True)):
        for q_len, kv_len in ((300, 300), (100, 457), (460, 150), (1, 77), (129, 64)):
            q_valid = int(rng.integers(1, q_len + 1)) if q_lengths else q_len
            kv_valid = int(rng.integers(1, kv_len + 1))
            yield causal, window, q_lengths, q_len, kv_len, q_valid, kv_valid


@pytest.mark.parametrize("causal,window,q_lengths,q_len,kv_len,q_valid,kv_valid", list(_mask_cases()))
def test_block_range_and_partial_blocks_match_oracle(causal, window, q_lengths, q_len, kv_len, q_valid, kv_valid):
    left, right = window if window is not None else (None, None)
    shape = masking.MaskShape(causal=causal, window_left=left, window_right=right, has_q_lengths=q_lengths)
    visible = numpy_reference.visible_keys(1, q_len, kv_len, numpy_reference.Masking(
        causal=causal, window=window, q_seq_lengths=np.array([q_valid]),
        kv_seq_lengths=np.array([kv_valid])))[0]
    offset = kv_valid - q_valid
    for m_block in range(-(-q_len // TILE_M)):
        row_start = m_block * TILE_M
        num_rows = min(TILE_M, q_valid - row_start)
        first, end = masking.key_block_range(shape, row_start, num_rows, TILE_N, kv_valid, offset)
        rows = visible[row_start:row_start + TILE_M]
        blocks_needed = [n for n in range(-(-kv_len // TILE_N)) if rows[:, n * TILE_N:(n + 1) * TILE_N].any()]
        assert 0 <= first <= end
        assert all(first <= n < end for n in blocks_needed), (first, end, blocks_needed)
        if blocks_needed:  # tight: the range starts and ends on blocks that hold visible keys
            assert first == blocks_needed[0] and end == blocks_needed[-1] + 1, (first, end, blocks_needed)
        stored_rows = rows[:max(0, q_len - row_start)]
        for n in range(first, end):
            if not masking.block_is_partial(shape, n, row_start, TILE_M, TILE_N, kv_valid, q_valid, offset):
                block = stored_rows[:, n * TILE_N:(n + 1) * TILE_N]
                assert block.shape[1] == TILE_N and block.all(), (m_block, n)


def test_batch_extents_clip_lengths_and_align_bottom_right():
    # Static 300 x 500; batch 1 has 120 valid query rows and 400 valid keys.
    q_lengths, kv_lengths = [300, 120], [500, 400]
    assert masking.batch_extents(1, 300, 500) == (300, 500, 200)
    assert masking.batch_extents(1, 300, 500, q_lengths, kv_lengths) == (120, 400, 280)
    assert masking.batch_extents(0, 300, 500, q_lengths, None) == (300, 500, 200)
    # A query sharded on sequence aligns by its global length, not the shard's.
    assert masking.batch_extents(1, 300, 500, None, kv_lengths, q_total=1000) == (300, 400, -600)


def test_right_reach_combines_causal_and_window():
    assert masking.MaskShape(causal=True).right_reach == 0
    assert masking.MaskShape(causal=True, window_right=5).right_reach == 0
    assert masking.MaskShape(causal=True, window_right=-3).right_reach == -3
    assert masking.MaskShape(window_right=7).right_reach == 7
    assert masking.MaskShape().right_reach is None


@pytest.mark.parametrize("longest_first", [False, True])
@pytest.mark.parametrize("num_m_blocks,num_heads,batch", [(1, 1, 1), (7, 3, 2), (16, 32, 1)])
def test_tile_coordinates_visit_every_tile_once(num_m_blocks, num_heads, batch, longest_first):
    tiles = [tile_scheduler.tile_coordinates(t, num_m_blocks, num_heads, batch, longest_first)
             for t in range(num_m_blocks * num_heads * batch)]
    # The kernels' walk without mirrored units: tile c, c + grid, ..., each holding rows.
    assert tile_scheduler.work_units(num_m_blocks, num_heads, batch, mirrored=False) == len(tiles)
    assert tile_scheduler.walked_tiles(num_m_blocks, num_heads, batch, mirrored=False) == len(tiles)
    assert (tile_scheduler.first_tile(3, mirrored=False), tile_scheduler.next_tile(3, 7, mirrored=False)) == (3, 10)
    assert [tile_scheduler.work_tile(t, num_m_blocks, num_heads, batch, longest_first, mirrored=False)
            for t in range(len(tiles))] == [(*tile, True) for tile in tiles]
    assert sorted(tiles) == sorted(itertools.product(range(num_m_blocks), range(num_heads), range(batch)))
    if longest_first:  # causal: the longest (last) query blocks come first
        m_blocks = [m for m, _, _ in tiles]
        assert m_blocks == sorted(m_blocks, reverse=True)
    else:  # one head's query blocks are adjacent (its K/V stay in L2)
        assert [m for m, _, _ in tiles[:num_m_blocks]] == list(range(num_m_blocks))


@pytest.mark.parametrize("grid", [1, 3, 7, 132])
@pytest.mark.parametrize("num_m_blocks,num_heads,batch", [(1, 1, 1), (7, 3, 2), (8, 4, 3), (16, 32, 1), (5, 1, 1)])
def test_mirrored_order_visits_every_tile_once_in_units_of_equal_length(num_m_blocks, num_heads, batch, grid):
    """The mirrored causal order: the CTAs' walks (first tile 2c, then `mirrored_next`, while below twice
    the unit count) cover every virtual tile once; the tiles that hold rows are every (m, head, batch)
    once; a unit's two tiles are one head's blocks M - 1 - j and j (one block for M odd's middle unit),
    so every unit sees M + 1 blocks of keys (causal, Sq = Sk); units go head by head."""
    units = tile_scheduler.work_units(num_m_blocks, num_heads, batch, mirrored=True)
    assert units == tile_scheduler.mirrored_units(num_m_blocks, num_heads, batch)
    ctas = min(grid, units)
    walked = []
    for cta in range(ctas):
        tile = tile_scheduler.first_tile(cta, mirrored=True)
        while tile < 2 * units:
            walked.append(tile)
            tile = tile_scheduler.next_tile(tile, ctas, mirrored=True)
    assert sorted(walked) == list(range(2 * units)) == list(range(
        tile_scheduler.walked_tiles(num_m_blocks, num_heads, batch, mirrored=True)))
    coordinates = [tile_scheduler.work_tile(t, num_m_blocks, num_heads, batch, True, mirrored=True)
                   for t in range(2 * units)]
    assert coordinates == [tile_scheduler.mirrored_tile(t, num_m_blocks, num_heads) for t in range(2 * units)]
    assert tile_scheduler.mirrors_whole_units(num_m_blocks * 128 - 5, 128) == (num_m_blocks % 2 == 0)
    held = [(m, head, b) for m, head, b, holds in coordinates if holds]
    assert sorted(held) == sorted(itertools.product(range(num_m_blocks), range(num_heads), range(batch)))
    for unit in range(units):
        (m0, h0, b0, holds0), (m1, h1, b1, holds1) = coordinates[2 * unit], coordinates[2 * unit + 1]
        assert holds0 and (h0, b0) == (h1, b1)
        if holds1:
            assert (m0 + 1) + (m1 + 1) == num_m_blocks + 1 and m0 >= m1
        else:
            assert 2 * m0 + 1 == num_m_blocks
    pairs = [h + num_heads * b for _, h, b, _ in coordinates]
    assert pairs == sorted(pairs)


def _packed_rows(cu_q, cu_k, total_q, total_k, tile_m):
    """[(query row, (its sequence's first row, q_len, k_start, kv_len))] over every slot of one head."""
    num_sequences = len(cu_q) - 1
    rows = []
    for slot in range(tile_scheduler.packed_slots_per_head(num_sequences, total_q, tile_m)):
        m_block, q_start, q_len, k_start, kv_len = tile_scheduler.packed_item(
            slot, cu_q, cu_k, num_sequences, total_q, total_k, tile_m)
        assert m_block >= 0
        rows += [(row, (q_start, q_len, k_start, kv_len))
                 for row in range(q_start + m_block * tile_m, q_start + min(q_len, (m_block + 1) * tile_m))]
    return rows


@pytest.mark.parametrize("tile_m", [64, 128, 192])
@pytest.mark.parametrize("seed", range(40))
def test_packed_slots_visit_every_row_once_with_its_sequence(tile_m, seed):
    """Every query row of every packing (empty sequences, lengths on and off tile multiples, one long
    sequence) lies in exactly one slot, which names that row's own sequence: its query and key
    offsets and lengths. The slot count depends on (N, Tq, tile_m) only."""
    rng = np.random.default_rng(seed)
    num_sequences = int(rng.integers(1, 40))
    lengths = rng.integers(0, 3 * tile_m, size=(num_sequences, 2)) * (rng.random((num_sequences, 2)) < 0.8)
    if seed % 5 == 0:
        lengths[rng.integers(num_sequences), 0] = 20 * tile_m + 1
    cu_q = [0, *np.cumsum(lengths[:, 0]).tolist()]
    cu_k = [0, *np.cumsum(lengths[:, 1]).tolist()]
    visits = _packed_rows(cu_q, cu_k, cu_q[-1], cu_k[-1], tile_m)
    rows = dict(visits)
    assert sorted(row for row, _ in visits) == list(range(cu_q[-1])), "a row missed or visited twice"
    for b in range(num_sequences):
        for row in range(cu_q[b], cu_q[b + 1]):
            assert rows[row] == (cu_q[b], cu_q[b + 1] - cu_q[b], cu_k[b], cu_k[b + 1] - cu_k[b])


@pytest.mark.parametrize("cu_q, cu_k, total_q, total_k", [
    ([0, 100, 300], [0, 50, 90], 500, 120),     # rows after the last offset, keys after it too
    ([40, 100, 300], [10, 50, 90], 300, 90),    # rows before the first offset
    ([0, 200, 100], [0, 80, 40], 300, 90),      # decreasing offsets
    ([0, 900, 999], [0, 500, 999], 300, 90),    # offsets past the arrays
])
def test_packed_slots_of_malformed_offsets_stay_inside_the_arrays(cu_q, cu_k, total_q, total_k):
    """Offsets the API cannot check under jit: every slot's rows and keys lie inside the arrays; for
    non-decreasing offsets every row is covered once and the rows outside [cu_q[0], cu_q[N]) belong
    to key-less items (the kernel writes out 0, lse -inf there, as the reference does). Decreasing
    ones may cover a row twice: the API leaves their result unspecified."""
    visits = _packed_rows(cu_q, cu_k, total_q, total_k, 64)
    for row, (_, _, k_start, kv_len) in visits:
        assert 0 <= row < total_q and 0 <= k_start and k_start + kv_len <= total_k
    if cu_q == sorted(cu_q):
        assert sorted(row for row, _ in visits) == list(range(total_q))
        assert all(kv_len == 0 for row, (_, _, _, kv_len) in visits
                   if not min(cu_q[0], total_q) <= row < min(cu_q[-1], total_q))


@pytest.mark.parametrize("degree", sorted(exp2_polynomial.COEFFICIENTS))
def test_polynomial_exp2_accuracy(degree):
    x = np.linspace(-125.0, 10.0, 400_001, dtype=np.float32)
    relative = np.abs(exp2_polynomial.exp2_reference(x, degree) / np.exp2(x.astype(np.float64)) - 1)
    assert relative.max() < {3: 1e-4, 4: 5e-6}[degree]
    # Masked scores are -inf; anything at or below the clamp must give exactly +0, never NaN.
    special = exp2_polynomial.exp2_reference(np.float32([-np.inf, -127.0, -300.0]), degree)
    assert np.array_equal(special, np.zeros(3, np.float32)) and not np.signbit(special).any()
    assert exp2_polynomial.COEFFICIENTS[degree][0] == 1.0


def test_polynomial_exp2_ptx_uses_fmas():
    text = exp2_polynomial._exp2_ptx(3)
    # The floor is a rounded add, not a quarter-rate conversion (`cvt`), and nothing runs on MUFU.
    assert text.count("fma.rn.f32") == 3 and "add.rm.f32" in text and "cvt" not in text and "ex2" not in text


@pytest.mark.parametrize("tile_m,head_dim,groups", [
    (64, 64, 2), (64, 96, 2), (64, 128, 2), (128, 64, 2), (64, 192, 2), (64, 256, 2), (64, 192, 3)])
def test_fragment_order_dq_reads_back_every_element_once(tile_m, head_dim, groups):
    """sm90 backward's `Tuning.flat_dq`: writing a [tile_m, D] block the way the consumers stage it
    (thread t of warp group g puts its accumulator values, in register order, as 4-value chunks at
    ((g K + k) 128 + t) 4, the wgmma D fragment giving each value's row and column) and reading it
    back with `backward_common.dq_from_fragments` (both sm90 backward kernels' reader) gives the block,
    for every head dim and row count the kernel takes. The large-head kernel's groups of columns: two of
    D/2, or three of 64 (its `Tuning.three_warpgroups`)."""
    from fa4_jax.kernels.sm90 import backward_common
    rng = np.random.default_rng()
    block = rng.standard_normal((tile_m, head_dim)).astype(np.float32)
    columns, chunks = head_dim // groups, tile_m * head_dim // (128 * groups) // 4
    n = columns                               # the wgmma's N: N / 2 values per thread and 64-row atom
    flat = np.full(tile_m * head_dim, np.nan, np.float32)
    for g, t in itertools.product(range(groups), range(128)):
        warp, lane = divmod(t, 32)
        for value in range(4 * chunks):       # the accumulator's register order: (c, h, j), then m
            m, within = divmod(value, n // 2)
            j, h, c = within // 4, (within // 2) % 2, within % 2
            row = 64 * m + 16 * warp + 8 * h + lane // 4        # of the warp group's M rows
            column = 8 * j + 2 * (lane % 4) + c
            k, v = divmod(value, 4)
            flat[((g * chunks + k) * 128 + t) * 4 + v] = block[row, g * columns + column]
    assert not np.isnan(flat).any()
    accumulator = np.stack([flat, 2 * flat]).reshape(1, 1, 2, tile_m * head_dim)   # two query blocks
    rows = np.asarray(backward_common.dq_from_fragments(tile_m, groups)(accumulator, 2 * tile_m - 3))
    np.testing.assert_array_equal(rows[0, :tile_m, 0], block)
    np.testing.assert_array_equal(rows[0, tile_m:, 0], 2 * block[:tile_m - 3])
