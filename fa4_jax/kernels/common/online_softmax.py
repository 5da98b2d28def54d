"""Online softmax in the exp2 domain with FA4's lazy rescaling, for one thread's rows of a score tile.

Each key block updates, per query row, a running maximum m (of raw logits) and a running sum l:

    p_j = 2^(s_j * scale_log2 - m * scale_log2)       one FMA + one exp2 per score (scale folded in)
    l   = l * 2^((m_old - m_new) * scale_log2) + sum_j p_j
    O   = O * 2^((m_old - m_new) * scale_log2) + P V

Lazy rescaling (FA4): when the block's maximum exceeds the running one by at most `threshold` (in log2
units) the running maximum is kept, so the rescale factor is exactly 1 and the O rescale is skipped;
p_j may then reach 2^threshold, which float32 sums and bf16/fp16 P values hold without loss. The
result is exact either way: l and O always share one maximum. threshold = 0 gives the classic update.

How a row is spread over threads depends on the kernel: sm90 splits each row over the 4 threads of a
quad (`threads_per_row=4`, the wgmma accumulator layout gives each thread a slice of its rows'
columns); sm100 keeps a whole row in one thread (`threads_per_row=1`, its TMEM load layout), so no
lane exchanges happen there. Maxima are reduced over `threads_per_row` lanes each block, sums only
once, in `finalize`.
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from fa4_jax.kernels.common import exp2_polynomial

LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


class OnlineSoftmax:
    """The static rules of the update; the state (per-row maximum and sum) lives in register tensors
    owned by the caller (`new_state`), since the DSL threads plain local tensors through dynamic
    loops and branches but not tensors stored on objects."""

    def __init__(self, scale_log2, threads_per_row: int = 4, rescale_threshold: float = 8.0,
                 poly_exp2_every: int = 0):
        self.scale_log2 = scale_log2
        self.threads_per_row = threads_per_row
        self.rescale_threshold = rescale_threshold
        self.poly_exp2_every = poly_exp2_every

    @staticmethod
    def new_state(num_rows: int):
        """(row_max, row_sum) register tensors for `num_rows` rows; call `reset` before each tile."""
        return cute.make_rmem_tensor(num_rows, Float32), cute.make_rmem_tensor(num_rows, Float32)

    @staticmethod
    def reset(row_max: cute.Tensor, row_sum: cute.Tensor):
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)

    @cute.jit
    def step(self, scores_mn: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor, row_scale: cute.Tensor):
        """Turn one block of raw scores (rows, cols) into unnormalised probabilities, in place.

        Writes each row's O rescale factor into `row_scale` (1.0 when the maximum did not move).
        """
        for r in cutlass.range_constexpr(cute.size(row_max)):
            block_max = scores_mn[r, 0]
            for c in cutlass.range_constexpr(1, cute.size(scores_mn, mode=[1])):
                block_max = cute.arch.fmax(block_max, scores_mn[r, c])
            block_max = cute.arch.warp_reduction_max(block_max, threads_in_group=self.threads_per_row)
            old_max = row_max[r]
            new_max = cute.arch.fmax(old_max, block_max)
            scale = Float32(1.0)
            # -inf - -inf is NaN: a row with nothing visible so far keeps max -inf and scale 1.
            if new_max != -Float32.inf:
                if (new_max - old_max) * self.scale_log2 > self.rescale_threshold:
                    scale = cute.math.exp2((old_max - new_max) * self.scale_log2, fastmath=True)
                    row_max[r] = new_max
                    row_sum[r] = row_sum[r] * scale
            row_scale[r] = scale
            kept_max = row_max[r]
            max_scaled = kept_max * self.scale_log2
            if kept_max == -Float32.inf:
                max_scaled = Float32(0.0)
            block_sum = Float32(0.0)
            for c in cutlass.range_constexpr(cute.size(scores_mn, mode=[1])):
                x = scores_mn[r, c] * self.scale_log2 - max_scaled
                if cutlass.const_expr(self.poly_exp2_every > 0 and c % self.poly_exp2_every == self.poly_exp2_every - 1):
                    p = exp2_polynomial.exp2(x)
                else:
                    p = cute.math.exp2(x, fastmath=True)
                scores_mn[r, c] = p
                block_sum += p
            row_sum[r] = row_sum[r] + block_sum

    @cute.jit
    def finalize(self, row_max: cute.Tensor, row_sum: cute.Tensor, sink_logit, lse: cute.Tensor,
                 output_scale: cute.Tensor):
        """Per row: lse (natural log, -inf for a row that saw nothing) and the factor 1/l for O.

        sink_logit: None, or this tile's sink logit (one head per tile), added to the denominator only.
        """
        for r in cutlass.range_constexpr(cute.size(row_max)):
            total = cute.arch.warp_reduction_sum(row_sum[r], threads_in_group=self.threads_per_row)
            kept_max = row_max[r]
            max_scaled = kept_max * self.scale_log2
            if kept_max == -Float32.inf:
                max_scaled = -Float32.inf
            scale_o = Float32(1.0)
            if cutlass.const_expr(sink_logit is not None):
                sink_scaled = sink_logit * LOG2_E
                shared_max = cute.arch.fmax(max_scaled, sink_scaled)
                scale_o = cute.math.exp2(max_scaled - shared_max, fastmath=True)
                total = total * scale_o + cute.math.exp2(sink_scaled - shared_max, fastmath=True)
                max_scaled = shared_max
            if total == 0.0 or total != total:
                output_scale[r] = Float32(0.0)
                lse[r] = -Float32.inf
            else:
                output_scale[r] = scale_o * cute.arch.rcp_approx(total)
                lse[r] = (max_scaled + cute.math.log2(total, fastmath=True)) * LN_2


@cute.jit
def rescale_rows(acc_mn: cute.Tensor, row_scale: cute.Tensor, skip_ones: cutlass.Constexpr = True):
    """acc[r, :] *= row_scale[r]; with skip_ones, rows whose factor is exactly 1 are left alone."""
    for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
        if cutlass.const_expr(skip_ones):
            if row_scale[r] != 1.0:
                for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
                    acc_mn[r, c] = acc_mn[r, c] * row_scale[r]
        else:
            for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
                acc_mn[r, c] = acc_mn[r, c] * row_scale[r]
