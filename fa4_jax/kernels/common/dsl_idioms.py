"""Two CuTe-DSL idioms the sm90 kernels write the same way."""

from __future__ import annotations

import cutlass.cute as cute


def select_modes(tensor: cute.Tensor, modes) -> cute.Tensor:
    """The same memory viewed with its layout's modes picked / reordered (e.g. [B, S, H, D] -> [S, D, H, B])."""
    return cute.make_tensor(tensor.iterator, cute.select(tensor.layout, mode=modes))


def advanced(state):
    """state.advance(), rebound by the caller: the DSL threads only rebound names out of a dynamic if."""
    state.advance()
    return state
