"""2^x on the FMA units: range reduction plus a low-degree polynomial (FA4's exp2 emulation).

The special-function unit issues one exp2 per 4 cycles per SM quadrant (16/clk/SM), the FMA pipes 4x
that, so moving a fraction of a softmax's exponentials onto FMAs raises the rate at which a tile's
scores can be exponentiated. Which scores use it is the caller's choice (`poly_exp2_every` of
OnlineSoftmax and of BackwardNumerics).

    x  = max(x, -127)            (2^-127 and below flush to 0; -inf lands here too)
    t  = x + 1.5 * 2^23, rounded down: t's low mantissa bits are floor(x) in two's complement
    n  = t - 1.5 * 2^23 = floor(x) (exact), f = x - n in [0, 1)
    2^f ~ c0 + f (c1 + f (c2 + f c3))            (Horner: 3 FMAs)
    2^x = bits(2^f) + (bits(t) << 23)            (the constant's bits shift out, floor(x) << 23 stays)

Every step is a full-rate FMA-pipe or integer instruction. The floor by rounded add matters: a
`cvt.rmi` floor and a `cvt.rzi` float-to-int each run on the conversion pipe at MUFU's own quarter
rate, so an exp2 built from them cost two quarter-rate instructions for the one it replaced (measured
26-34 % slower at D = 64 on the H200, docs/sm90_forward_tuning.md).

The coefficients minimise the relative error of 2^f over [0, 1) (iteratively reweighted least
squares, rounded to float32) with c0 = 1 exactly: max relative error 8.6e-5 for degree 3, far below
bf16/fp16 P rounding (3.9e-3 / 4.9e-4). c0 = 1 matters: at the clamp, x = -127 (masked scores are
-inf) gives bits(1.0) - (127 << 23) = +0 exactly, where c0 < 1 would wrap the exponent into a NaN
(seen on the H200 with the first, unconstrained fit). `exp2_reference` mirrors the device code in
float32 NumPy for tests.
"""

from __future__ import annotations

import numpy as np

from cutlass import Float32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

COEFFICIENTS = {
    3: (1.0, 0.6951166987419128, 0.22764535248279572, 0.07706671953201294),
    4: (1.0, 0.6930448412895203, 0.241280198097229, 0.05224248394370079, 0.013426678255200386),
}
DEFAULT_DEGREE = 3
# 1.5 * 2^23: a float32 in [2^23, 2^24) has a unit last place, so adding x (|x| < 2^22) rounds to an
# integer, and the 1.5 keeps the sum there for negative x too.
FLOOR_MAGIC = 12582912.0


def _ptx_float(value: float) -> str:
    return "0f%08X" % int(np.float32(value).view(np.uint32))


def _exp2_ptx(degree: int) -> str:
    coefficients = COEFFICIENTS[degree]
    horner = [f"mov.f32 p, {_ptx_float(coefficients[degree])};"]
    for k in range(degree - 1, -1, -1):
        horner.append(f"fma.rn.f32 p, p, f, {_ptx_float(coefficients[k])};")
    return "\n".join([
        "{",
        ".reg .f32 xc, t, n, f, p;",
        ".reg .b32 e, bits;",
        f"max.f32 xc, $1, {_ptx_float(-127.0)};",
        f"add.rm.f32 t, xc, {_ptx_float(FLOOR_MAGIC)};",
        f"sub.rn.f32 n, t, {_ptx_float(FLOOR_MAGIC)};",
        "sub.rn.f32 f, xc, n;",
        *horner,
        "mov.b32 e, t;",
        "shl.b32 e, e, 23;",
        "mov.b32 bits, p;",
        "add.s32 bits, bits, e;",
        "mov.b32 $0, bits;",
        "}",
    ])


@dsl_user_op
def exp2(x: Float32, degree: int = DEFAULT_DEGREE, *, loc=None, ip=None) -> Float32:
    """2^x for x <= 127 (the softmax only ever asks for x <= rescale threshold)."""
    return Float32(
        llvm.inline_asm(
            T.f32(),
            [Float32(x).ir_value(loc=loc, ip=ip)],
            _exp2_ptx(degree),
            "=f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
            loc=loc,
            ip=ip,
        )
    )


def exp2_reference(x, degree: int = DEFAULT_DEGREE) -> np.ndarray:
    """The device algorithm step by step in float32 NumPy (for accuracy tests on the CPU). NumPy has
    no round-down add: floor(x) + 1.5 * 2^23 is the value `add.rm` gives, exactly."""
    x = np.maximum(np.asarray(x, np.float32), np.float32(-127.0))
    t = (np.floor(x) + np.float32(FLOOR_MAGIC)).astype(np.float32)
    n = (t - np.float32(FLOOR_MAGIC)).astype(np.float32)
    f = (x - n).astype(np.float32)
    coefficients = [np.float32(c) for c in COEFFICIENTS[degree]]
    p = coefficients[degree]
    for k in range(degree - 1, -1, -1):
        p = (p * f + coefficients[k]).astype(np.float32)
    bits = p.view(np.uint32) + (t.view(np.uint32) << np.uint32(23))
    return bits.astype(np.uint32).view(np.float32)
