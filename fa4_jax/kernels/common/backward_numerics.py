"""The backward's numerics per score, one home for the sm90 and sm100 backward kernels: P recomputed
from the stored log-sum-exp (with the softcap and the mask where a block is partial), and
dS = P * (dP - dPsum) times the softcap's slope. The sm90 backward runs these on the H200 (its GPU
tests check them against the float64 oracle); the sm100 backward, which no GPU here can run, calls
the same functions on its TMEM rows."""

from __future__ import annotations

import math
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr

from fa4_jax.kernels.common import exp2_polynomial, masking
from fa4_jax.kernels.common.softcap import apply_softcap

LOG2_E = math.log2(math.e)


class BackwardNumerics:
    """The static part (mask rules, softcap, scale, the (query, key) block a partial-block test is
    about) of the per-score backward arithmetic."""

    def __init__(self, mask: masking.MaskShape, softcap: Optional[float], scale: float, tile_m: int, tile_n: int,
                 poly_exp2_every: int = 0):
        self.mask = mask
        # Every `poly_exp2_every`-th of a thread's scores takes the FMA-pipe exp2 (0: all on MUFU.EX2).
        # Counted over the thread's scores, not along a row: an sm90 thread holds only two keys of a
        # query row of S^T.
        self.poly_exp2_every = poly_exp2_every
        self.softcap = softcap
        self.scale = scale
        self.scale_log2 = scale * LOG2_E
        self.tile_m = tile_m
        self.tile_n = tile_n

    @cute.jit
    def probabilities(self, acc_s, scores, coords, lse, n_block, row_start, row_base, key_base, kv_len, q_len,
                      offset, mQSegmentIds, mKVSegmentIds, batch, kv_segment_columns=None):
        """P recomputed in place over the S accumulator `acc_s` (`scores`: its query-major view,
        `coords` that view's (query, key) coordinates within the block): softcap, the mask where key
        block `n_block` is partial for the query block starting at `row_start` (its first row's
        position; `row_base` its first local row, `key_base` the first key of `coords`), then
        exp2(S * scale * log2 e - LSE_log2) with the stored LSE (`lse[r]` for row r of the view).
        `kv_segment_columns`: the KV segment ids of the view's columns, preloaded (`masking.apply_mask`)."""
        if const_expr(self.softcap is not None):
            apply_softcap(acc_s, self.softcap, self.scale)
        if masking.block_is_partial(self.mask, n_block, row_start, self.tile_m, self.tile_n,
                                    kv_len, q_len, offset):
            q_segments = None
            kv_segments = None
            if const_expr(self.mask.has_segments):
                q_segments = mQSegmentIds[batch, None]
                kv_segments = mKVSegmentIds[batch, None]
            masking.apply_mask(scores, coords, self.mask, row_start, key_base, kv_len, q_len,
                               offset, row_base, q_segments, kv_segments, kv_segment_columns=kv_segment_columns)
        logit_scale = self.scale_log2              # with softcap the scale is already applied
        if const_expr(self.softcap is not None):
            logit_scale = LOG2_E
        columns = cute.size(scores, mode=[1])
        for r in cutlass.range_constexpr(cute.size(scores, mode=[0])):
            for c in cutlass.range_constexpr(columns):
                x = scores[r, c] * logit_scale - lse[r]
                if const_expr(self.poly_exp2_every > 0
                              and (r * columns + c) % self.poly_exp2_every == self.poly_exp2_every - 1):
                    scores[r, c] = exp2_polynomial.exp2(x)
                else:
                    scores[r, c] = cute.math.exp2(x, fastmath=True)

    @cute.jit
    def ds_over_dp(self, probabilities, grads, dpsum, lse):
        """dS = P * (dP - dPsum), times the softcap's slope, written over dP (`grads`, query-major
        like `probabilities`)."""
        for r in cutlass.range_constexpr(cute.size(grads, mode=[0])):
            for c in cutlass.range_constexpr(cute.size(grads, mode=[1])):
                grad = probabilities[r, c] * (grads[r, c] - dpsum[r])
                if const_expr(self.softcap is not None):
                    grad = grad * self.softcap_slope(probabilities[r, c], lse[r])
                grads[r, c] = grad

    @cute.jit
    def softcap_slope(self, probability, lse_log2):
        """1 - tanh^2 of the capped logit, recovered from P (cheaper than holding it in registers):
        capped logit = (log2 P + LSE_log2) / log2 e = softcap * tanh. Zero where P is zero."""
        t = (cute.math.log2(probability, fastmath=True) + lse_log2) * (1.0 / (self.softcap * LOG2_E))
        slope = 1.0 - t * t
        if probability == 0.0:
            slope = Float32(0.0)
        return slope
