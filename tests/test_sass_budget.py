"""tools/sass_budget.py on a hand-written SASS listing in nvdisasm's format: which loops it finds, which
warp role it names each by, and how it counts a body (the mbarrier spin loops after the last EXIT and
the setmaxnreg retry are not loops of their own; a block a forward branch skips is "conditional")."""

from tools import sass_budget

LISTING = """
        /*0000*/                   S2R R0, SR_TID.X ;
.L_x_0:
        /*0010*/                   USETMAXREG.TRY_ALLOC.CTAPOOL P0, 0xf0 ;
        /*0020*/              @!P0 BRA `(.L_x_0) ;
.L_x_1:
        /*0030*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2 ;
        /*0040*/              @!P0 BRA `(.L_x_5) ;
.L_x_2:
        /*0050*/                   WARPGROUP.ARRIVE ;
        /*0060*/                   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT, gsb0 ;
        /*0070*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0080*/              @!P1 BRA `(.L_x_3) ;
        /*0090*/                   FSEL R24, R24, -INF , !P2 ;
        /*00a0*/                   FSEL R25, R25, -INF , !P2 ;
.L_x_3:
        /*00b0*/                   FFMA R24, R24, 0.5, -R6 ;
        /*00c0*/                   MUFU.EX2 R24, R24 ;
        /*00d0*/                   F2FP.BF16.F32.PACK_AB R30, R25, R24 ;
        /*00e0*/                   STS [R5+UR13], R30 ;
        /*00f0*/                   R2UR UR9, R7 ;
        /*0100*/                   UIADD3 UR6, UR6, 0x1, URZ ;
        /*0110*/                   IMAD.MOV.U32 R7, RZ, RZ, 0x40000040 ;
        /*0120*/                   ISETP.NE.U32.AND P0, PT, RZ, UR6, PT ;
        /*0130*/               @P0 BRA `(.L_x_1) ;
.L_x_4:
        /*0140*/                   UTMALDG.4D [UR32], [UR38], desc[URZ] ;
        /*0150*/                   UIADD3 UR7, UR7, 0x1, URZ ;
        /*0160*/               @P1 BRA `(.L_x_4) ;
        /*0170*/                   EXIT ;
.L_x_5:
        /*0180*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R2 ;
        /*0190*/              @!P0 NANOSLEEP.SYNCS 0x989680 ;
        /*01a0*/              @!P0 BRA `(.L_x_5) ;
        /*01b0*/                   BRA `(.L_x_2) ;
"""


def test_loops_roles_and_classes():
    budget = sass_budget.budget(LISTING)
    assert sorted(budget) == ["consumer", "producer"]
    consumer = budget["consumer"]
    assert consumer["total"] == 17 and consumer["conditional"] == 2
    assert consumer["conditional_classes"] == {"FP32": 2}
    assert consumer["classes"] == {"sync": 1, "pred/branch": 4, "WARPGROUP": 2, "HGMMA": 1, "FP32": 3, "MUFU": 1,
                                   "convert": 1, "shared": 1, "R2UR": 1, "uniform": 1, "int/address": 1}
    assert budget["producer"]["total"] == 3
    assert budget["producer"]["classes"] == {"global/bulk": 1, "uniform": 1, "pred/branch": 1}
