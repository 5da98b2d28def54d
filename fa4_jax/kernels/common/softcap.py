"""The logit softcap, logits <- c * tanh(logits / c), applied after the scale: one home for the
forward kernels (sm90, sm100) and the sm90 backward's recomputation of P, so the formula the H200 runs
is the one the sm100 kernel compiles."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute


@cute.jit
def apply_softcap(scores: cute.Tensor, softcap: cutlass.Constexpr, scale: cutlass.Constexpr):
    """scores <- softcap * tanh(scores * scale / softcap), in place (logits before the softmax scale)."""
    for i in cutlass.range_constexpr(cute.size(scores)):
        scores[i] = softcap * cute.math.tanh(scores[i] * (scale / softcap), fastmath=True)
