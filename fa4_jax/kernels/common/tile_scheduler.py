"""Persistent tile scheduler: which (query block, head, batch) tile each CTA works on, in which order.

A persistent grid launches min(tiles, SM count) CTAs (each kernel's host function sizes it); CTA c
handles tiles c, c + grid, c + 2 grid, ... in the order below. The SM count is a parameter (never
queried from the driver while tracing, so kernels compile on a CPU-only machine).

Order:
- non-causal: query blocks of one (batch, head) are adjacent, so the CTAs running at the same time
  share that head's K and V in L2 (spreading them over 4 heads instead measured no faster at B 1,
  S 16k, where one wave is one head: docs/sm90_forward_tuning.md);
- causal ("longest first"): tiles sorted by decreasing query block, since with bottom-right alignment a
  later query block sees more keys. Starting the long tiles first and filling the tail with short
  ones balances the SMs (the LPT rule). But a wave of CTAs then runs one query block of ~grid
  different heads, so with many (batch, head) pairs every tile reads its head's K and V from DRAM.
- causal, mirrored pairs (`mirrored_tile`): each work unit is a query block m and its mirror
  M - 1 - m of the same head, run back to back by one CTA, so every unit sees the same number of
  keys (M + 1 blocks) and any order balances; units go head by head, as the non-causal tiles do, so
  the CTAs running together share a few heads' K and V in L2.

Packed variable-length sequences: the query-block axis is a static axis of slots over (sequence,
block), mapped back by `packed_item` (below).

`tile_coordinates` and the packed functions are plain integer arithmetic: they run on Python ints in
the unit tests and on `cutlass.Int32` inside kernels.
"""

from __future__ import annotations

from fa4_jax.kernels.common import integer


def tile_coordinates(tile_index, num_m_blocks, num_heads, batch, longest_first: bool):
    """Linear tile index -> (m_block, head, batch_index)."""
    if longest_first:
        heads_times_batch = num_heads * batch
        m_block = num_m_blocks - 1 - tile_index // heads_times_batch
        rest = tile_index % heads_times_batch
    else:
        m_block = tile_index % num_m_blocks
        rest = tile_index // num_m_blocks
    return m_block, rest % num_heads, rest // num_heads


def mirrored_units(num_m_blocks, num_heads, batch):
    """Work units of the mirrored order: ceil(M / 2) per (batch, head) pair."""
    return (num_m_blocks + 1) // 2 * num_heads * batch


def mirrored_tile(tile_index, num_m_blocks, num_heads):
    """Virtual tile index of the mirrored order -> (m_block, head, batch_index, holds). Tiles 2u and
    2u + 1 are unit u's two query blocks, M - 1 - j then j (j = u's place in its pair's ceil(M / 2)
    units); with M odd the middle unit has one block, and its second tile does not hold rows. A CTA
    runs tiles 2u, 2u + 1, then 2 (u + grid), ... (`mirrored_next`), 2 x mirrored_units in all."""
    per_pair = (num_m_blocks + 1) // 2
    unit = tile_index // 2
    second = tile_index - 2 * unit
    pair = unit // per_pair
    j = unit - pair * per_pair
    m_block = j + (1 - second) * (num_m_blocks - 1 - 2 * j)
    holds = integer.either(second == 0, 2 * j + 1 != num_m_blocks)
    return m_block, pair % num_heads, pair // num_heads, holds


def mirrored_next(tile_index, grid):
    """The tile after `tile_index` for a CTA of `grid` persistent CTAs in the mirrored order: the second
    tile of the same unit, then the first of the unit `grid` later."""
    second = tile_index % 2
    return tile_index + 1 + second * (2 * grid - 2)


def work_units(num_m_blocks, num_heads, batch, mirrored: bool):
    """What a persistent grid of min(this, SM count) CTAs shares out: the tiles, or the mirrored units."""
    if mirrored:
        return mirrored_units(num_m_blocks, num_heads, batch)
    return num_m_blocks * num_heads * batch


def walked_tiles(num_m_blocks, num_heads, batch, mirrored: bool):
    """The tile indices the CTAs walk run below this: two per mirrored unit (with M odd the middle
    unit's second holds no rows), or the tiles."""
    if mirrored:
        return 2 * mirrored_units(num_m_blocks, num_heads, batch)
    return num_m_blocks * num_heads * batch


def first_tile(cta, mirrored: bool):
    """CTA `cta`'s first tile: tile `cta`, or the first tile of unit `cta`."""
    return 2 * cta if mirrored else cta


def next_tile(tile_index, grid, mirrored: bool):
    """The tile after `tile_index` for one of `grid` persistent CTAs: `grid` tiles on, or `mirrored_next`."""
    return mirrored_next(tile_index, grid) if mirrored else tile_index + grid


def work_tile(tile_index, num_m_blocks, num_heads, batch, longest_first: bool, mirrored: bool):
    """(m_block, head, batch_index, holds) of a tile: `mirrored_tile`'s, or `tile_coordinates`' with
    holds True. Every role of a kernel walks first_tile, next_tile, ... and maps each through this."""
    if mirrored:
        return mirrored_tile(tile_index, num_m_blocks, num_heads)
    return (*tile_coordinates(tile_index, num_m_blocks, num_heads, batch, longest_first), True)


def mirrors_whole_units(q_len, tile_rows):
    """Whether Sq in query blocks of `tile_rows` rows gives an even block count, so that no mirrored
    unit has an empty second tile: where the kernels without that tile's skip (the sm100 forward, the
    tangent kernel) take the mirrored order."""
    return -(-q_len // tile_rows) % 2 == 0


def zigzag_tile(wave, cta, grid):
    """The tile CTA `cta` of `grid` persistent CTAs takes in wave `wave` when waves alternate direction:
    even waves hand tiles wave * grid + 0, 1, ... to CTAs 0, 1, ..., odd waves in reverse. With tiles
    in longest-first order, the CTA that got a wave's longest tile gets the next wave's shortest, where
    the plain stride (tile = wave * grid + cta) gives CTA 0 the longest of every wave. Once a CTA's
    tile is past the last one, the following waves are too, so `while tile < num_tiles` still ends
    each CTA's loop."""
    odd = wave % 2
    return wave * grid + cta + odd * (grid - 1 - 2 * cta)


# --------------------------------------------------------------------------------------------------
# Packed variable-length sequences (attention_varlen): work items over (sequence, query block, head).
#
# The N sequences' query blocks are laid out on a static axis of "slots", sized from the shapes alone,
# so one compiled kernel serves every packing of the same token counts (the offsets are runtime data):
# sequence s starts at slot v(s) = s + start(s) // tile_m. Since floor((c + l) / t) - floor(c / t) >=
# floor(l / t), consecutive starts are at least ceil(len(s) / tile_m) slots apart, so every block of
# every sequence has its own slot; a slot past its sequence's last block (at most one per sequence)
# is an empty item. Mapping a slot back to its sequence is a binary search over v, which grows with s,
# reading log2(N) offsets: no padding to the longest sequence, no per-sequence table in memory.
#
# Besides the N real sequences, two key-less "virtual" ones cover the tokens before cu_seqlens_q[0]
# and from cu_seqlens_q[N] on (empty for well-formed offsets), so that such tokens still get out 0 and
# lse -inf as the API promises, instead of whatever memory held. Virtual sequence index
# s = 0 .. N + 1: 0 and N + 1 are those two, s in 1 .. N is packed sequence s - 1. Offsets are clamped
# into [0, total], so malformed ones never address outside the arrays.

def _clamp(value, low, high):
    return integer.minimum(integer.maximum(value, low), high)


def packed_slots_per_head(num_sequences: int, total_q: int, tile_m: int) -> int:
    """Work items per head: v(N + 2), the slot after the last virtual sequence's."""
    return num_sequences + 2 + total_q // tile_m


def packed_boundary(cu_seqlens, s, num_sequences: int, total: int):
    """Token where virtual sequence s starts (s = 0 .. N + 2; N + 2 gives the total): 0, then the
    offsets cu_seqlens[0 .. N] clamped into [0, total], then total."""
    offset = _clamp(cu_seqlens[_clamp(s - 1, 0, num_sequences)], 0, total)
    return integer.pick(s == 0, 0, integer.pick(s >= num_sequences + 2, total, offset))


def packed_slot(cu_seqlens_q, s, num_sequences: int, total_q: int, tile_m: int):
    """v(s): the first slot of virtual sequence s."""
    return s + packed_boundary(cu_seqlens_q, s, num_sequences, total_q) // tile_m


def packed_sequence(slot, cu_seqlens, num_sequences: int, total: int, tile):
    """The virtual sequence whose slots (of `tile` tokens, over the offsets `cu_seqlens` of `total`
    tokens) hold `slot`: the largest s with v(s) <= slot, by a binary search of a static
    ceil(log2(N + 2)) steps."""
    low, high = 0, num_sequences + 2     # the largest s in [low, high) with v(s) <= slot
    for _ in range((num_sequences + 1).bit_length()):
        middle = (low + high) // 2
        fits = packed_slot(cu_seqlens, middle, num_sequences, total, tile) <= slot
        low, high = integer.pick(fits, middle, low), integer.pick(fits, high, middle)
    return low


def packed_extents(s, cu_seqlens_q, cu_seqlens_k, num_sequences: int, total_q: int, total_k: int):
    """(q_start, q_len, k_start, kv_len) of virtual sequence s: its first query row and key in the
    packed arrays, and its lengths (the two virtual sequences have no keys)."""
    q_start = packed_boundary(cu_seqlens_q, s, num_sequences, total_q)
    q_len = integer.maximum(packed_boundary(cu_seqlens_q, s + 1, num_sequences, total_q) - q_start, 0)
    real = integer.both(s >= 1, s <= num_sequences)
    k_start = _clamp(cu_seqlens_k[_clamp(s - 1, 0, num_sequences)], 0, total_k)
    k_end = _clamp(cu_seqlens_k[_clamp(s, 0, num_sequences)], 0, total_k)
    kv_len = integer.pick(real, integer.maximum(k_end - k_start, 0), 0)
    return q_start, q_len, k_start, kv_len


def packed_item(slot, cu_seqlens_q, cu_seqlens_k, num_sequences: int, total_q: int, total_k: int, tile_m: int):
    """Slot -> (m_block, q_start, q_len, k_start, kv_len): the query block within its sequence, the
    sequence's first query row and key in the packed arrays, and its lengths. The item holds rows iff
    m_block * tile_m < q_len. Runs on Python ints (and lists) in the unit tests and on `cutlass.Int32`
    (and int32 tensors) inside kernels."""
    s = packed_sequence(slot, cu_seqlens_q, num_sequences, total_q, tile_m)
    q_start, q_len, k_start, kv_len = packed_extents(s, cu_seqlens_q, cu_seqlens_k, num_sequences, total_q, total_k)
    m_block = slot - packed_slot(cu_seqlens_q, s, num_sequences, total_q, tile_m)
    return m_block, q_start, q_len, k_start, kv_len


def packed_key_item(slot, cu_seqlens_q, cu_seqlens_k, num_sequences: int, total_q: int, total_k: int, tile_m: int,
                    tile_n: int):
    """The backward's view, slots over (sequence, key block) of `tile_n` keys, laid out on the key axis as
    the forward's are on the query axis (`packed_slots_per_head(N, total_k, tile_n)` per head; the two
    virtual sequences hold the keys outside the offsets, with no query rows): slot -> (n_block,
    k_start, kv_len, q_start, q_len, query_slot). The item holds keys iff n_block * tile_n < kv_len.
    query_slot is the forward's slot v(s) of the sequence's first query block of `tile_m` rows, so
    query block m of the sequence is slot query_slot + m: one per (sequence, query block), what a
    per-query-tile counter needs."""
    s = packed_sequence(slot, cu_seqlens_k, num_sequences, total_k, tile_n)
    k_start, kv_len, q_start, q_len = packed_extents(s, cu_seqlens_k, cu_seqlens_q, num_sequences, total_k, total_q)
    n_block = slot - packed_slot(cu_seqlens_k, s, num_sequences, total_k, tile_n)
    return n_block, k_start, kv_len, q_start, q_len, s + q_start // tile_m
