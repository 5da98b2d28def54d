"""Persistent tile scheduler: which (query block, head, batch) tile each CTA works on, in which order.

A persistent grid launches min(tiles, SM count) CTAs (each kernel's host function sizes it); CTA c
handles tiles c, c + grid, c + 2 grid, ... in the order below. The SM count is a parameter (never
queried from the driver while tracing, so kernels compile on a CPU-only machine).

Order:
- non-causal: query blocks of one (batch, head) are adjacent, so the CTAs running at the same time
  share that head's K and V in L2;
- causal ("longest first"): tiles sorted by decreasing query block, since with bottom-right alignment a
  later query block sees more keys. Starting the long tiles first and filling the tail with short
  ones balances the SMs (the LPT rule). Sorted over all (batch, head) pairs at once, a wave of CTAs
  runs one query block of ~grid different heads, so every tile reads its head's K and V from DRAM:
  at B 16, S 1k, D 128 that is 4.5x the K/V bytes, ~600 MB, more than an H100 streams in the time
  the tensor cores need. `head_group` sorts in chunks of that many consecutive (batch, head) pairs
  instead, chunk after chunk, sized by the kernel so one chunk's K and V stay in L2: each head's
  K/V come from DRAM once, and within a chunk the long tiles still go first.

Packed variable-length sequences: the query-block axis is a static axis of slots over (sequence,
block), mapped back by `packed_item` (below).

`tile_coordinates` and the packed functions are plain integer arithmetic: they run on Python ints in
the unit tests and on `cutlass.Int32` inside kernels.
"""

from __future__ import annotations

from fa4_jax.kernels.common import integer


def tile_coordinates(tile_index, num_m_blocks, num_heads, batch, longest_first: bool, head_group: int = 0):
    """Linear tile index -> (m_block, head, batch_index). `head_group` (longest first only; a static
    int, 0: all pairs in one chunk): the (batch, head) pairs, head fastest, in chunks of this many,
    longest first within each chunk (the last chunk may be smaller)."""
    if longest_first:
        heads_times_batch = num_heads * batch
        if head_group:
            chunk_tiles = head_group * num_m_blocks
            chunk = tile_index // chunk_tiles
            first_pair = chunk * head_group
            pairs = integer.maximum(integer.minimum(heads_times_batch - first_pair, head_group), 1)
            within = tile_index - chunk * chunk_tiles
            m_block = num_m_blocks - 1 - within // pairs
            rest = first_pair + within % pairs
        else:
            m_block = num_m_blocks - 1 - tile_index // heads_times_batch
            rest = tile_index % heads_times_batch
    else:
        m_block = tile_index % num_m_blocks
        rest = tile_index // num_m_blocks
    return m_block, rest % num_heads, rest // num_heads


def l2_head_group(kv_len: int, kv_head_bytes_per_key: int, group: int, pairs: int,
                  budget_bytes: int = 24 << 20) -> int:
    """`head_group` for `tile_coordinates`: the most consecutive (batch, query head) pairs whose K and
    V (`kv_head_bytes_per_key` a key, `kv_len` keys per KV head, `group` query heads per KV head) fit
    in `budget_bytes`, whole KV groups, at least one group; 0 when all `pairs` fit (one chunk: the
    plain longest-first order). The budget is about half of an H100's / H200's 50 MB L2, leaving room
    for the Q and O streams that pass through it."""
    kv_heads = max(1, budget_bytes // max(1, kv_len * kv_head_bytes_per_key))
    head_group = kv_heads * group
    return 0 if head_group >= pairs else head_group


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
