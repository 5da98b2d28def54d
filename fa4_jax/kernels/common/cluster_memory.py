"""Loads from another CTA's shared memory in the same thread-block cluster (distributed shared memory).

The DSL maps a shared address into the cluster window (`cute.arch.map_dsmem_ptr`, PTX `mapa`), but its
tensors cannot load through such a pointer, so the load itself is one PTX instruction here. The asm is
marked as having side effects: it must stay after the cluster barrier that makes the peer's writes
visible, which a pure asm statement does not promise.
"""

from __future__ import annotations

import cutlass.cute as cute
from cutlass import Float32, Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


@dsl_user_op
def load_f32(local: cute.Pointer, rank: Int32, *, loc=None, ip=None) -> Float32:
    """The float32 at shared pointer `local` in the CTA of cluster rank `rank`."""
    address = cute.arch.map_dsmem_ptr(local, rank, loc=loc, ip=ip).toint(loc=loc, ip=ip)
    return Float32(llvm.inline_asm(
        T.f32(), [Int32(address).ir_value(loc=loc, ip=ip)], "ld.shared::cluster.f32 $0, [$1];", "=f,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def load_f32x4(local: cute.Pointer, rank: Int32, *, loc=None, ip=None) -> tuple:
    """The 4 float32 at 16-byte aligned shared pointer `local` in the CTA of cluster rank `rank`."""
    address = cute.arch.map_dsmem_ptr(local, rank, loc=loc, ip=ip).toint(loc=loc, ip=ip)
    quad = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32()] * 4), [Int32(address).ir_value(loc=loc, ip=ip)],
        "ld.shared::cluster.v4.f32 {$0, $1, $2, $3}, [$4];", "=f,=f,=f,=f,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)
    return tuple(Float32(llvm.extractvalue(T.f32(), quad, [i], loc=loc, ip=ip)) for i in range(4))
