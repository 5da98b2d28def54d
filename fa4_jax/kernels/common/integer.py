"""Integer helpers that run on Python ints and on `cutlass.Int32` alike, so the block arithmetic of the
masks and the tile scheduler is one code path in the unit tests (plain ints) and inside kernels."""

from __future__ import annotations

import cutlass


def minimum(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return min(a, b)
    return cutlass.min(a, b)


def maximum(a, b):
    if isinstance(a, int) and isinstance(b, int):
        return max(a, b)
    return cutlass.max(a, b)


def either(a, b):
    if isinstance(a, bool) and isinstance(b, bool):
        return a or b
    return cutlass.Boolean(a) | cutlass.Boolean(b)


def both(a, b):
    if isinstance(a, bool) and isinstance(b, bool):
        return a and b
    return cutlass.Boolean(a) & cutlass.Boolean(b)


def pick(condition, if_true, if_false):
    if isinstance(condition, bool):
        return if_true if condition else if_false
    return cutlass.Int32(cutlass.select_(condition, cutlass.Int32(if_true), cutlass.Int32(if_false)))
