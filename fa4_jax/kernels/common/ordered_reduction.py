"""Deterministic dQ: the key blocks that visit a query tile add into its fp32 accumulator one at a
time, in a fixed order, so the sums round the same way on every run and dQ is bitwise reproducible.

Each (batch, query head, query block) tile has an int32 counter in global memory, zero at launch. A
key block's dQ writer warp waits until the counter equals its turn (`wait_for_turn`), issues its bulk
adds, and once they are complete in global memory passes the turn on (`finish_bulk_adds`). Without
ordering the same writer only waits until the copy engine has read its staging buffer. The sm100
backward's dQ warpgroup adds with atomics and passes the turn with `finish_atomic_adds`.

The turn order must be one in which a key block never waits for a CTA that cannot start before it:
the kernels launch the key blocks of a head in turn order.

`key_block_turn` is plain integer arithmetic, like masking's block-grain functions: it runs on Python
ints in the unit tests and on `cutlass.Int32` inside the kernels.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Int32, const_expr

from fa4_jax.kernels.common import integer, masking


def key_block_turn(shape: masking.MaskShape, n_block, row_start, tile_m, tile_n, kv_len, offset,
                   highest_first: bool):
    """Key block n_block's turn (0, 1, ...) at the query tile of rows [row_start, row_start + tile_m).

    The tile's visitors are exactly the key blocks [first, end) of `masking.key_block_range`
    (tests/test_backward_block_ranges.py), so their turns are 0 .. end - first - 1, taken from the
    highest key block down or from the lowest up. Highest first is the arrival order under a causal
    mask, where key block n + 1 reaches every tile before key block n.
    """
    first, end = masking.key_block_range(shape, row_start, tile_m, tile_n, kv_len, offset)
    if highest_first:
        return end - 1 - n_block
    return n_block - first


def rotated_turn(n_block, m_block, key_blocks, query_blocks):
    """Key block n_block's turn at query block m_block when every key block visits every query block
    (a full mask: key blocks [0, N), query blocks [0, M)) and key block k walks them rotated, starting
    at its own index: query block (k + s) mod M at step s. Key block k reaches query block m at step
    s_k = (m - k) mod M, so its turn is #{k : s_k < s_n} + #{k < n : s_k = s_n} (equal steps, k = n
    mod M when N > M, take the lower key block first): every wait is for a visitor that got there at an
    earlier step of its walk (or the same step, a lower key block), so the waits form no cycle, and in
    the steady state consecutive visitors of a tile arrive one step apart.

    Closed form, with N = a M + b: the residues r = k mod M of the visitors arriving earlier are the
    s_n values m, m - 1, ..., m - s_n + 1 (mod M), each r the residue of a (+1 if r < b) key blocks.
    Unlike `key_block_turn`'s orders a key block here also waits for key blocks launched after it: the
    caller must make sure all N key blocks of a head can be resident at once."""
    steps = query_blocks
    s = ((m_block - n_block) % steps + steps) % steps      # non-negative for Python and device ints
    whole, rest = key_blocks // steps, key_blocks % steps
    low = m_block - s + 1                                  # the earlier arrivals' residues: [low, m_block]
    below_m = integer.minimum(m_block + 1, rest)           # residues < rest among [0, m_block]
    unwrapped = integer.maximum(below_m - low, 0)
    wrapped = below_m + integer.maximum(rest - (steps + low), 0)
    return whole * s + integer.pick(low >= 0, unwrapped, wrapped) + n_block // steps


@cute.jit
def wait_for_turn(counters: cute.Tensor, tile, turn, lane):
    """Hold the writer warp until the counter of `tile` (batch, query head, query block) in
    `counters` shows `turn`: every earlier visitor's adds are then complete in global memory (the
    acquire pairs with their `finish_bulk_adds`). One lane polls. Returns the counter's address."""
    flag = counters.iterator + cute.crd2idx(tile, counters.layout)
    if lane == 0:
        seen = cute.arch.load(flag, Int32, sem="acquire", scope="gpu")
        while seen != turn:
            seen = cute.arch.load(flag, Int32, sem="acquire", scope="gpu")
    cute.arch.sync_warp()
    return flag


@cute.jit
def wait_for_bulk_reads():
    """Hold the warp until the copy engine has read the source of every bulk copy its threads committed
    (the adds may still be landing): their staging buffers may be refilled from here."""
    cute.arch.cp_async_bulk_wait_group(0, read=True)
    cute.arch.sync_warp()


@cute.jit
def finish_bulk_adds(flag, lane):
    """After the writer warp commits its bulk adds: with `flag` (from `wait_for_turn`), wait until
    they are complete in global memory, not just read, and pass the tile's turn to the next visitor;
    with `flag` None (no ordering), wait only until the copy engine has read the staging buffer, so
    it can be refilled while the adds land.

    The turn passes as a fence.acq_rel.gpu, then a relaxed red of the counter: a fence followed by a
    strong write is a release pattern in the PTX memory model, so the poller's acquire sees the
    completed adds, as after a release red; but a release red after the fence compiles to a second
    MEMBAR.GPU + ERRBAR on every tile's turn chain. Measured on an H100 (rev a546978, deterministic,
    B*S = 16k): D = 64 full +11 / +12 % at 1k / 4k, D = 128 full +5 / +8 %, causal +1 to +8 %, the
    same bits (docs/sm90_backward_tuning.md, "D = 64 full: a tile's turn chain")."""
    if const_expr(flag is None):
        wait_for_bulk_reads()
    else:
        cute.arch.cp_async_bulk_wait_group(0)
        cute.arch.sync_warp()
        if lane == 0:
            cute.arch.fence_acq_rel_gpu()
            cute.arch.red(flag, Int32(1), op="add", dtype=Int32, sem="relaxed", scope="gpu")


@cute.jit
def finish_atomic_adds(flag, thread, threads):
    """After every thread of the group `threads` (a named barrier; `thread` its index there) issued its
    atomic adds of a tile in its turn: order them before the turn passes (each thread's fence, then the
    barrier), and pass the tile's turn to the next visitor from thread 0. The sm100 backward's dQ
    warpgroup adds with atomics instead of bulk copies."""
    cute.arch.fence_acq_rel_gpu()
    threads.arrive_and_wait()
    if thread == 0:
        cute.arch.red(flag, Int32(1), op="add", dtype=Int32, sem="release", scope="gpu")
