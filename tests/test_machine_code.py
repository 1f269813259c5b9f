"""The machine-code readers of the compile gate, on listings written here: ptxas's notes
and the SASS hot loop (the gate's own builds exercise them on real kernels)."""

from fusedpar.testing import machine_code as mc

# A loop at 0x30..0xd0 whose body skips a masked block's code (0x70..0x90) on its fast
# path; 0x90 is a divergence test (falls through), 0xd0 the back edge. A second loop
# (0x100..0x110) has no tensor-core instruction.
LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;          /* 0x0000 */
        /*0010*/                   ISETP.GE.AND P0, PT, R2, R3, PT ;
        /*0020*/               @P0 BRA 0x100 ;
        /*0030*/                   WARPGROUP.ARRIVE ;
        /*0040*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24, gsb0 ;
        /*0050*/                   UTMALDG.2D [UR8], [UR10] ;
        /*0060*/              @!P1 BRA 0xa0 ;
        /*0070*/                   FSEL R5, R5, -INF , P2 ;
        /*0080*/                   FSEL R6, R6, -INF , P2 ;
        /*0090*/                   BRA.DIV UR6, 0x120 ;
        /*00a0*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*00b0*/                   IADD3.X R7, R8, R9, RZ, P4, !PT ;
        /*00c0*/                   LDL R8, [R1] ;
        /*00d0*/              @!P3 BRA 0x30 ;
        /*00e0*/                   EXIT ;
        /*0100*/                   LDG.E R2, desc[UR4][R2.64] ;
        /*0110*/               @P0 BRA 0x100 ;
        /*0120*/                   BRA 0x90 ;
"""


def test_hot_loop_takes_the_fast_path_through_the_body():
    insts = mc.parse_sass(LISTING)
    assert [i.address for i in insts][:3] == [0x0, 0x10, 0x20]
    assert insts[2].predicate == "@P0" and insts[2].target == 0x100
    assert mc.hot_loop(insts) == {
        "hgmma": {"64x128x16": 1},
        "wgmma_waits": 1,
        "loads": {"tma": 1, "cp_async": 0, "global": 0},
        "tma_reduces": 0,
        "local": 1,
        "int64": 1,
        "insts_min": 8,  # 0x30-0x60, then 0xa0-0xd0
        "insts_max": 11,  # the masked code too
    }


def test_no_tensor_core_loop_is_no_hot_loop():
    plain = "\n".join(line for line in LISTING.splitlines() if "HGMMA" not in line)
    assert mc.hot_loop(mc.parse_sass(plain)) is None


def test_ptxas_notes_and_serialized_wgmma():
    log = """ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized due to non wgmma instructions defining accumulator registers of a wgmma between start and end of the pipeline stage in the function 'k'
ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized due to the same cause again
ptxas info    : (C9999) some other note
ptxas info    : Used 168 registers, used 1 barriers"""  # noqa: E501
    assert mc.ptxas_notes(log) == ["C7515", "C9999"]
    assert mc.wgmma_serialized(log)
    assert not mc.wgmma_serialized(log.replace("serialized", "pipelined"))
