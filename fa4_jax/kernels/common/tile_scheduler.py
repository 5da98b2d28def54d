"""Persistent tile scheduler: which (query block, head, batch) tile each CTA works on, in which order.

A persistent grid launches min(tiles, SM count) CTAs (each kernel's host function sizes it); CTA c
handles tiles c, c + grid, c + 2 grid, ... in the order below. The SM count is a parameter (never
queried from the driver while tracing, so kernels compile on a CPU-only machine).

Order:
- non-causal: query blocks of one (batch, head) are adjacent, so the CTAs running at the same time
  share that head's K and V in L2;
- causal ("longest first"): tiles sorted by decreasing query block, since with bottom-right alignment a
  later query block sees more keys. Starting the long tiles first and filling the tail with short
  ones balances the SMs (the LPT rule).

`tile_coordinates` is plain integer arithmetic: it runs on Python ints in the unit tests and on
`cutlass.Int32` inside kernels.
"""

from __future__ import annotations


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


def zigzag_tile(wave, cta, grid):
    """The tile CTA `cta` of `grid` persistent CTAs takes in wave `wave` when waves alternate direction:
    even waves hand tiles wave * grid + 0, 1, ... to CTAs 0, 1, ..., odd waves in reverse. With tiles
    in longest-first order, the CTA that got a wave's longest tile gets the next wave's shortest, where
    the plain stride (tile = wave * grid + cta) gives CTA 0 the longest of every wave. Once a CTA's
    tile is past the last one, the following waves are too, so `while tile < num_tiles` still ends
    each CTA's loop."""
    odd = wave % 2
    return wave * grid + cta + odd * (grid - 1 - 2 * cta)
