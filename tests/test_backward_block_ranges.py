"""CPU: `masking.query_block_range` (the backward's walk over query blocks per key block) is the exact
inverse of `masking.key_block_range` (the forward's walk), which the deterministic dQ ordering needs:
key block n is then the (n - first)-th visitor of query block m, first = key_block_range(m)[0]."""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest

pytest.importorskip("cutlass")  # the kernel modules need nvidia-cutlass-dsl (Linux only)
from fa4_jax.kernels.common import masking, ordered_reduction, tile_scheduler  # noqa: E402
from fa4_jax.kernels.sm90 import backward_large_heads  # noqa: E402

SHAPES = [
    masking.MaskShape(),
    masking.MaskShape(causal=True),
    masking.MaskShape(window_left=37),
    masking.MaskShape(window_right=5),
    masking.MaskShape(causal=True, window_left=100),
    masking.MaskShape(window_left=70, window_right=200),
    masking.MaskShape(causal=True, window_left=0),
    masking.MaskShape(causal=True, window_right=-3),
]


@pytest.mark.parametrize("shape", SHAPES, ids=repr)
# (128, 256): the sm100 backward's query block and CTA pair of keys; (64, 96): the large-head backward's
# 96-key blocks (`Tuning.three_warpgroups`), no power of two.
@pytest.mark.parametrize("tile_m,tile_n", [(64, 128), (128, 128), (64, 64), (128, 256), (64, 96)])
def test_query_block_range_inverts_key_block_range(shape, tile_m, tile_n):
    num_m_blocks = 12
    for kv_len, row_offset in itertools.product((1, 130, 700, 1000), (0, 300, -200, 37, -4000)):
        num_n_blocks = -(-kv_len // tile_n)
        for n_block in range(num_n_blocks + 1):
            first, end = masking.query_block_range(shape, n_block, tile_m, tile_n, kv_len, row_offset,
                                                   num_m_blocks)
            for m_block in range(num_m_blocks):
                key_first, key_end = masking.key_block_range(shape, m_block * tile_m, tile_m, tile_n,
                                                             kv_len, row_offset)
                assert (first <= m_block < end) == (key_first <= n_block < key_end), (
                    kv_len, row_offset, n_block, m_block)


@pytest.mark.parametrize("shape", SHAPES[1:6], ids=repr)
@pytest.mark.parametrize("tile_m,tile_n", [(64, 128), (128, 256)], ids=["sm90", "sm100-pair"])
def test_block_ranges_cover_every_visible_pair(shape, tile_m, tile_n):
    """Every (row, key) pair visible under the element rule lies in a visited block pair."""
    q_len, kv_len = 300, 517
    offset = kv_len - q_len
    rows = np.arange(q_len)[:, None] + offset
    keys = np.arange(kv_len)[None, :]
    visible = np.broadcast_to(keys < kv_len, (q_len, kv_len)).copy()
    if shape.right_reach is not None:
        visible &= keys <= rows + shape.right_reach
    if shape.window_left is not None:
        visible &= keys >= rows - shape.window_left
    num_m_blocks = -(-q_len // tile_m)
    for n_block in range(-(-kv_len // tile_n)):
        first, end = masking.query_block_range(shape, n_block, tile_m, tile_n, kv_len, offset, num_m_blocks)
        block = visible[:, n_block * tile_n:(n_block + 1) * tile_n]
        touched = np.nonzero(block.any(axis=1))[0] // tile_m
        assert all(first <= m < end for m in touched), (n_block, first, end, set(touched))


@pytest.mark.parametrize("shape", [masking.MaskShape(causal=True),
                                   masking.MaskShape(causal=True, window_left=100),
                                   masking.MaskShape(causal=True, window_right=-3)], ids=repr)
def test_causal_arrival_order_is_diagonal_first(shape):
    """Under causal masking a key block's walk starts no earlier than the previous block's, so key
    block n + 1 reaches every query block no later than key block n (its step there, m - first, is
    smaller): the deterministic mode's diagonal-first turn order (highest key block first) is the order
    in which the CTAs, all walking from their first block, arrive."""
    tile_m, tile_n, num_m_blocks = 64, 128, 20
    for kv_len, row_offset in itertools.product((130, 700, 1000), (0, 300, -200, 37)):
        num_n_blocks = -(-kv_len // tile_n)
        ranges = [masking.query_block_range(shape, n, tile_m, tile_n, kv_len, row_offset, num_m_blocks)
                  for n in range(num_n_blocks)]
        for m_block in range(num_m_blocks):
            visitors = [n for n, (first, end) in enumerate(ranges) if first <= m_block < end]
            steps = [m_block - ranges[n][0] for n in visitors]
            assert steps == sorted(steps, reverse=True), (kv_len, row_offset, m_block, visitors, steps)


@pytest.mark.parametrize("tile_m,tile_n", [(64, 128), (64, 96)])
@pytest.mark.parametrize("highest_first", [False, True], ids=["lowest_first", "highest_first"])
@pytest.mark.parametrize("shape", SHAPES, ids=repr)
def test_key_block_turns_are_the_visitors_in_order(shape, highest_first, tile_m, tile_n):
    """`ordered_reduction.key_block_turn` hands the key blocks that visit a query block (found by the
    backward's walk, `query_block_range`) the turns 0, 1, ... once each, lowest or highest key block
    first: a turn given twice or skipped would hang the deterministic dQ writers (64-row query blocks of
    128 keys, and the large-head kernel's 96-key blocks)."""
    num_m_blocks = 12
    for kv_len, row_offset in itertools.product((1, 130, 700, 1000), (0, 300, -200, 37)):
        num_n_blocks = -(-kv_len // tile_n)
        ranges = [masking.query_block_range(shape, n, tile_m, tile_n, kv_len, row_offset, num_m_blocks)
                  for n in range(num_n_blocks)]
        for m_block in range(num_m_blocks):
            visitors = [n for n, (first, end) in enumerate(ranges) if first <= m_block < end]
            turns = [ordered_reduction.key_block_turn(shape, n, m_block * tile_m, tile_m, tile_n, kv_len,
                                                      row_offset, highest_first) for n in visitors]
            expected = list(range(len(visitors)))
            assert turns == (expected[::-1] if highest_first else expected), (
                kv_len, row_offset, m_block, visitors, turns)


@pytest.mark.parametrize("shape", SHAPES[:6], ids=repr)
@pytest.mark.parametrize("seed", range(6))
def test_packed_key_slots_cover_every_key_once_and_every_visible_pair(shape, seed):
    """The sm90 backward on packed sequences (`tile_scheduler.packed_key_item`: one CTA per (sequence,
    key block) slot, its walk `query_block_range` in the sequence's own rows): every key of the packed
    axis is stored by exactly one CTA (its sequence's, clipped at the sequence's end; keys outside the
    offsets by a key-less item, as zeros); every pair visible under the per-sequence rule lies in a
    visited block pair; each (sequence, query block) has its own turn counter (query slot), whose
    visitors take the turns 0, 1, ... highest key block first and, launched in decreasing slot order,
    never wait for a CTA launched after them."""
    tile_m, tile_n = 64, 128
    rng = np.random.default_rng(seed)
    num_sequences = int(rng.integers(1, 9))
    lengths = rng.integers(0, 400, size=(num_sequences, 2)) * (rng.random((num_sequences, 2)) < 0.85)
    lengths[0] = (rng.integers(1, 3) * tile_m, rng.integers(1, 3) * tile_n)     # whole tiles
    cu_q = [0, *np.cumsum(lengths[:, 0]).tolist()]
    cu_k = [0, *np.cumsum(lengths[:, 1]).tolist()]
    total_q, total_k = cu_q[-1], cu_k[-1]
    stored = np.zeros(total_k, int)
    turns = {}              # query slot -> [(turn, key slot)]
    query_slots = {}        # query slot -> (sequence's first row, query block)
    for slot in range(tile_scheduler.packed_slots_per_head(num_sequences, total_k, tile_n)):
        n_block, k_start, kv_len, q_start, q_len, query_slot = tile_scheduler.packed_key_item(
            slot, cu_q, cu_k, num_sequences, total_q, total_k, tile_m, tile_n)
        stored[k_start + n_block * tile_n:k_start + min(kv_len, (n_block + 1) * tile_n)] += 1
        offset = kv_len - q_len
        first, end = masking.query_block_range(shape, n_block, tile_m, tile_n, kv_len, offset, -(-q_len // tile_m))
        assert first <= end and (end == first or n_block * tile_n < kv_len)
        for m_block in range(first, end):
            assert query_slots.setdefault(query_slot + m_block, (q_start, m_block)) == (q_start, m_block)
            turn = ordered_reduction.key_block_turn(shape, n_block, m_block * tile_m, tile_m, tile_n, kv_len, offset,
                                                    highest_first=True)
            turns.setdefault(query_slot + m_block, []).append((turn, slot))
        # The pairs this CTA must cover, by the element rule of its sequence alone.
        rows = np.arange(q_len)[:, None] + offset
        keys = np.arange(n_block * tile_n, min(kv_len, (n_block + 1) * tile_n))[None, :]
        visible = np.ones((q_len, keys.shape[1]), bool)
        if shape.right_reach is not None:
            visible &= keys <= rows + shape.right_reach
        if shape.window_left is not None:
            visible &= keys >= rows - shape.window_left
        touched = set(np.nonzero(visible.any(axis=1))[0] // tile_m)
        assert all(first <= m < end for m in touched), (slot, first, end, touched)
    assert stored.tolist() == [1] * total_k, "a key stored twice or never"
    assert max(query_slots, default=0) < tile_scheduler.packed_slots_per_head(num_sequences, total_q, tile_m)
    for visitors in turns.values():
        visitors.sort()
        assert [turn for turn, _ in visitors] == list(range(len(visitors)))
        assert [slot for _, slot in visitors] == sorted((slot for _, slot in visitors), reverse=True)


@pytest.mark.parametrize("key_blocks", [1, 2, 5, 8, 13, 32])
@pytest.mark.parametrize("query_blocks", [1, 3, 8, 16, 20])
def test_rotated_turns_are_the_arrival_order(key_blocks, query_blocks):
    """`rotated_turn` against its definition: key block k, walking query blocks from k (mod M), reaches
    query block m at step (m - k) mod M; the turns at m are 0 .. N - 1, earlier steps first and, at equal
    steps, lower key blocks first."""
    for m in range(query_blocks):
        arrival = {k: ((m - k) % query_blocks, k) for k in range(key_blocks)}
        expected = {k: rank for rank, k in enumerate(sorted(arrival, key=arrival.get))}
        turns = {k: ordered_reduction.rotated_turn(k, m, key_blocks, query_blocks) for k in range(key_blocks)}
        assert turns == expected, (m, turns, expected)


def _rotated_walk(step, key_block, query_blocks):
    """The rotated walk by its definition (backward.py's `_query_block`): step s of key block k is query
    block (k + s) mod M."""
    return (key_block + step) % query_blocks


# The walks simulated: the definition, and the large-head kernel's own staggered walk (`query_step`).
WALKS = {"definition": _rotated_walk,
         "large-head-kernel": lambda step, key_block, query_blocks: backward_large_heads.query_step(
             step, key_block, query_blocks, staggered=True)}


def _run_rotated_heads(heads, key_blocks, query_blocks, slots, walk=_rotated_walk, group=1):
    """Whether every CTA finishes: `heads` x `key_blocks` CTAs launched in order onto `slots` SMs, each
    walking the query blocks of its `group` query heads one head after another, in `walk`'s order, and
    adding at each in its `rotated_turn` (a step is taken once every earlier turn of that tile is done);
    None if at some point no resident CTA can move (a deadlock)."""
    walked = {}                                    # (head, key block) -> steps taken
    done = {}                                      # (head, query head of the group, query block) -> adds done
    pending = [(h, k) for h in range(heads) for k in range(key_blocks)]
    resident, finished = [], 0
    while pending or resident:
        while pending and len(resident) < slots:
            resident.append(pending.pop(0))
            walked[resident[-1]] = 0
        moved = False
        for cta in list(resident):
            head, k = cta
            step = walked[cta]
            m = walk(step, k, query_blocks)
            tile = (head, step // query_blocks, m)
            if done.get(tile, 0) == ordered_reduction.rotated_turn(k, m, key_blocks, query_blocks):
                done[tile] = done.get(tile, 0) + 1
                walked[cta] = step + 1
                moved = True
                if step + 1 == group * query_blocks:
                    resident.remove(cta)
                    finished += 1
        if not moved:
            return None
    return finished


@pytest.mark.parametrize("walk", sorted(WALKS))
@pytest.mark.parametrize("group", [1, 3])
# (64, 96): the large-head kernel's 96-key blocks at 6k (D = 192), fewer key blocks than query blocks.
@pytest.mark.parametrize("key_blocks, query_blocks", [(8, 16), (32, 32), (16, 8), (66, 32), (64, 96)])
def test_rotated_turns_finish_when_a_head_fits_on_the_gpu(key_blocks, query_blocks, group, walk):
    """Rotated turns wait for later-launched key blocks, so they finish only if a head's key blocks can
    all be resident: with the slots `backward_common.rotated_turns_reason` asks for (2 N: half the SMs)
    and even with N, every CTA of several heads finishes (each CTA walking a GQA group's heads in turn,
    as both kernels do); with fewer than N slots (and no more key blocks than query blocks, so that every
    key block waits for the last one somewhere) the first head's CTAs wait for one another forever, which
    is why the kernels resolve the tuning off where a head may not fit."""
    heads = 3
    run = functools.partial(_run_rotated_heads, heads, key_blocks, query_blocks, walk=WALKS[walk], group=group)
    assert run(2 * key_blocks) == heads * key_blocks
    assert run(key_blocks) == heads * key_blocks
    if 1 < key_blocks <= query_blocks:
        assert run(key_blocks - 1) is None


@pytest.mark.parametrize("staggered", [False, True])
def test_carried_walk_is_the_divided_walk(staggered):
    """The consumers' and dQ writer's walk, carried by `backward_common.next_query_block` from the start
    `_first_query_block` gives, visits the same (query head, query block) at every iteration as the
    producer's, divided out of the iteration count (`query_step`; plain when not staggered): a head's
    blocks in turn, the next head after m_count of them, for every key block, count and group."""
    from fa4_jax.kernels.sm90 import backward_common

    def select(condition, if_true, if_false):
        return if_true if condition else if_false

    for m_count, group, m_lo, n_block in itertools.product(range(1, 8), (1, 2, 3, 8), (0, 5), range(12)):
        first_head = 7 * group
        m_block = m_lo + (n_block % m_count if staggered else 0)
        m_start, q_head = m_block, first_head
        for it in range(group * m_count):
            step = backward_large_heads.query_step(it, n_block, m_count, staggered)
            assert (q_head, m_block) == (first_head + it // m_count, m_lo + step), (m_count, group, n_block, it)
            q_head, m_block = backward_common.next_query_block(q_head, m_block, m_start, m_lo, m_count, staggered,
                                                               select)
