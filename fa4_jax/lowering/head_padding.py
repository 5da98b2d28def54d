"""Head dims the kernels are not built for, reached by zero-padding: the one place that chooses a
kernel's head dims for a call and pads into / slices out of it.

Every kernel takes a few (head dim, value head dim) pairs, today D = Dv in {64, 96, 128, 192, 256}, the
sm90 forward also D = Dv = 80, and the sm90 forward and large-head backward also DeepSeek MLA's 192/128
(the routing table in `fa4_jax/lowering/cuda.py` says which per GPU and pass). A call of head dims
(D, Dv) runs the kernel pair (D', Dv') with D' >= D and Dv' >= Dv that does the least work, with query
and key zero-padded from D to D' and value from Dv to Dv' along the head axis (so on the sm90 forward
64 < D < 80 pads to 80, 80 < D < 96 to 96):
- exact: the zero columns add nothing to Q K^T, so the logits, the softmax, the LSE and the sinks are
  the call's; the output's extra columns are P @ 0 = 0 and are sliced off. The softmax scale is the
  call's own (`AttentionConfig.scale`, 1/sqrt(D) of the *original* D by default): padding happens
  below the config, which it never touches.
- the backward: dO and O are padded like V (their zero columns add nothing to dP = dO V^T or to
  rowsum(dO * O)); dQ = dS K, dK = dS^T Q and dV = P^T dO come out with zero extra columns, sliced off.
  Each pass is planned on its own kernels' pairs, from the call's dims: O and the LSE reach the backward
  at the call's dims whether the forward padded or not (the LSE has no head axis), so e.g. a 160/128
  call on sm_90 runs both passes at 192/128, padding only Q and K, and on sm_100 its forward at
  192/192 and its backward on the reference.
- the tangent (forward mode): t_Q and t_K are padded like Q and K, t_V and O like V; t_S = scale ·
  (t_Q K^T + Q t_K^T) is the call's, and t_out = P t_V + (P o t_S) V - t_lse o O has zero extra
  columns, sliced off; t_lse is the call's.
- the cost, for a (D, Dv) call on kernel (D', Dv'): FLOPs grow by (D' + Dv') / (D + Dv) (80 -> 96
  (every backward, the sm100 forward): 1.2x; 72 -> 80 (the sm90 forward): 1.11x; 72 -> 96: 1.33x;
  112 -> 128: 1.14x; 160 -> 192: 1.2x; MLA 192/128 -> 192/192 (the sm100 forward): 1.2x; 160/128 -> 192/128 on the sm90 forward and backward: 1.1x; 64/128 -> 128/128 and
  256/128 -> 256/256: 1.33x; 96/64 -> 96/96: 1.2x), and each padded operand is one more
  copy: the forward reads Q, K, V and writes their padded copies (D'/D, Dv'/Dv as large), then
  slices O; the backward pads Q, K, V, O, dO and slices dQ, dK, dV. Those copies live only inside
  the primitive's lowering, so the custom VJP's residuals (q, k, v, out, lse) stay at the call's
  dims: the padding costs transient memory and bandwidth, no saved memory.
- any head dim <= 256 pads (the copies are fresh, 16-byte aligned arrays whatever D is), not only
  multiples of 8.

The paged decode kernel is not padded (`PADDED_PASSES`): it reads the KV cache in place, and padding
would copy the whole cache on every decoding step.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Optional

import jax.numpy as jnp

from fa4_jax.kernels import host

# The passes whose calls may be padded up to a kernel's head dims.
PADDED_PASSES = ("forward", "backward", "tangent")


@dataclasses.dataclass(frozen=True)
class HeadPadding:
    """A call's head dims (head_dim, v_head_dim) and the kernel's it runs at (kernel_head_dim >=
    head_dim, kernel_v_head_dim >= v_head_dim); equal pairs are no padding at all."""

    head_dim: int
    v_head_dim: int
    kernel_head_dim: int
    kernel_v_head_dim: int

    @property
    def is_identity(self) -> bool:
        return (self.head_dim, self.v_head_dim) == (self.kernel_head_dim, self.kernel_v_head_dim)

    @property
    def flop_ratio(self) -> float:
        """The kernel's matmul FLOPs over the call's: Q K^T costs D, P V costs Dv per (row, key)."""
        return (self.kernel_head_dim + self.kernel_v_head_dim) / (self.head_dim + self.v_head_dim)

    def kernel_problem(self, problem: host.Problem) -> host.Problem:
        """The `Problem` the kernel sees: `problem` at the kernel's head dims."""
        return dataclasses.replace(problem, query=problem.query[:3] + (self.kernel_head_dim,),
                                   key=problem.key[:3] + (self.kernel_head_dim,),
                                   value=problem.value[:3] + (self.kernel_v_head_dim,))

    def forward(self, run_kernel, query, key, value, optional: dict):
        """`run_kernel(query, key, value, optional) -> (out, lse)` at the kernel's head dims, for
        operands at the call's."""
        out, lse = run_kernel(_pad(query, self.kernel_head_dim), _pad(key, self.kernel_head_dim),
                              _pad(value, self.kernel_v_head_dim), optional)
        return out[..., :self.v_head_dim], lse

    def backward(self, run_kernel, query, key, value, out, lse, d_out, d_lse, optional: dict):
        """`run_kernel(q, k, v, out, lse, d_out, d_lse, optional) -> (dq, dk, dv, d_sinks)` at the
        kernel's head dims, for operands at the call's."""
        d_query, d_key, d_value, d_sinks = run_kernel(
            _pad(query, self.kernel_head_dim), _pad(key, self.kernel_head_dim),
            _pad(value, self.kernel_v_head_dim), _pad(out, self.kernel_v_head_dim), lse,
            _pad(d_out, self.kernel_v_head_dim), d_lse, optional)
        return (d_query[..., :self.head_dim], d_key[..., :self.head_dim], d_value[..., :self.v_head_dim],
                d_sinks)

    def tangent(self, run_kernel, query, key, value, out, lse, t_query, t_key, t_value, t_sinks, optional: dict):
        """`run_kernel(q, k, v, out, lse, t_q, t_k, t_v, t_sinks, optional) -> (t_out, t_lse)` at the
        kernel's head dims, for operands at the call's."""
        d, dv = self.kernel_head_dim, self.kernel_v_head_dim
        t_out, t_lse = run_kernel(_pad(query, d), _pad(key, d), _pad(value, dv), _pad(out, dv), lse,
                                  _pad(t_query, d), _pad(t_key, d), _pad(t_value, dv), t_sinks, optional)
        return t_out[..., :self.v_head_dim], t_lse


def _pad(x, size: int):
    """x zero-padded along its last (head) axis to `size`; x itself when it has that size."""
    if x.shape[-1] == size:
        return x
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])])


def plan(head_dim: int, v_head_dim: int, kernel_head_dims: Iterable[tuple]) -> Optional[HeadPadding]:
    """The padding that takes a (head_dim, v_head_dim) call to the cheapest of `kernel_head_dims`
    ((D', Dv') pairs some kernel takes) that holds it, or None when none is large enough. The
    cheapest: the least D' + Dv' (FLOPs and padded bytes both grow with it), then the smaller D'."""
    fitting = [(d, dv) for d, dv in kernel_head_dims if d >= head_dim and dv >= v_head_dim]
    if not fitting:
        return None
    kernel_head_dim, kernel_v_head_dim = min(fitting, key=lambda pair: (pair[0] + pair[1], pair[0]))
    return HeadPadding(head_dim, v_head_dim, kernel_head_dim, kernel_v_head_dim)


def identity(problem: host.Problem) -> HeadPadding:
    """No padding: the call runs at its own head dims."""
    return HeadPadding(problem.head_dim, problem.v_head_dim, problem.head_dim, problem.v_head_dim)
