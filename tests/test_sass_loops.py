"""`bench/sass.py` finds a kernel's hot loop in a SASS listing and costs one iteration as the longest
path through it (a canned listing; nothing is compiled)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_sass", ROOT / "bench" / "sass.py")
sass = sys.modules["bench_sass"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(sass)

# As `cuobjdump -sass` prints it (encodings trimmed after the first two lines): a loop at 0x30 whose
# body branches into two arms (3 and 1 instructions), a shuffle with its BRA.DIV slow path placed
# after the exit (it jumps back into the loop: not a loop of its own), and the trailing self-branch.
LISTING = """
	code for sm_86
		Function : _kernel
        /*0000*/                   IMAD.MOV.U32 R1, RZ, RZ, c[0x0][0x28] ;            /* 0x00000a00ff017624 */
                                                                                      /* 0x000fe400078e00ff */
        /*0010*/                   ISETP.GE.AND P0, PT, R2, R3, PT ;
        /*0020*/               @P0 EXIT ;
        /*0030*/                   LDG.E.128 R4, [R2.64] ;
        /*0040*/               @P1 BRA 0x80 ;
        /*0050*/                   FFMA R5, R4, R4, R5 ;
        /*0060*/                   FFMA R5, R4, R4, R5 ;
        /*0070*/                   BRA 0x90 ;
        /*0080*/                   FADD R5, R4, R5 ;
        /*0090*/                   BRA.DIV ~URZ, 0x100 ;
        /*00a0*/                   SHFL.BFLY PT, R6, R5, 0x1, 0x1f ;
        /*00b0*/                   ISETP.LT.AND P2, PT, R7, R8, PT ;
        /*00c0*/              @!P2 BRA 0x30 ;                                         /* 0xffffff6000007947 */
        /*00d0*/                   STG.E [R2.64], R5 ;
        /*00e0*/                   EXIT ;
        /*00f0*/                   BRA 0xf0;
        /*0100*/                   CALL.REL.NOINC 0x120 ;
        /*0110*/                   BRA 0xa0 ;
        /*0120*/                   RET.REL.NODEC R20 0x0 ;
        ..........
"""


def test_hot_loop_counts_the_longest_arm_once_and_not_the_divergent_slow_path():
    code = sass.parse_sass(LISTING)
    assert len(code) == 19 and code[2].predicated and code[2].opcode == "EXIT"
    # header 2 + longer arm 3 + BRA.DIV 1 + shuffle to back edge 3; the body holds both arms.
    assert sass.find_loops(code) == [sass.Loop(header=0x30, latch=0xc0, path_instructions=9, body_instructions=10)]


def test_nested_loops_report_only_the_innermost():
    listing = "\n".join(f"/*{a:04x}*/ {text} ;" for a, text in [
        (0x00, "MOV R1, R2"), (0x10, "MOV R3, R4"), (0x20, "FADD R5, R5, R6"), (0x30, "@P0 BRA 0x20"),
        (0x40, "@P1 BRA 0x10"), (0x50, "EXIT")])
    assert sass.find_loops(sass.parse_sass(listing)) == [sass.Loop(0x20, 0x30, 2, 2)]


def test_a_branch_taken_when_the_warp_is_converged_skips_the_slow_code():
    listing = "\n".join(f"/*{a:04x}*/ {text} ;" for a, text in [
        (0x00, "MOV R1, R2"), (0x10, "FADD R5, R5, R6"), (0x20, "BRA.CONV ~URZ, 0x50"), (0x30, "CALL.REL.NOINC 0x80"),
        (0x40, "BRA 0x60"), (0x50, "SHFL.BFLY PT, R6, R5, 0x1, 0x1f"), (0x60, "@P0 BRA 0x10"), (0x70, "EXIT"),
        (0x80, "RET.REL.NODEC R20 0x0")])
    assert sass.find_loops(sass.parse_sass(listing)) == [sass.Loop(0x10, 0x60, 4, 4)]


def test_resources_read_registers_and_local_memory():
    usage = " Function _matmul_kernel:\n  REG:128 STACK:0 SHARED:0 LOCAL:8 CONSTANT[0]:448 TEXTURE:0"
    assert sass.parse_resources(usage) == {"registers": 128, "stack_bytes": 0, "static_shared_bytes": 0,
                                           "local_bytes": 8}
