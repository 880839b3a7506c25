"""Compile statistics of every decode kernel specialization for sm_86 (RTX 3090), without a GPU: the
CPU-side proxy of how near a kernel can get to the bandwidth roofline.

    python bench/kernel_specs.py                 # prints the table and the JSON
    python bench/kernel_specs.py --out FILE      # writes the JSON to FILE

The launches are those `tests/kernel_compile.py` records at Laguna XS.2 shapes, kept when they are
decode launches (a BLOCK_M of at most 16 rows, or no BLOCK_M: row-wise kernels). Each is compiled
with Triton's compiler; its cubin gives registers per thread, stack and local memory, ptxas run
again on its PTX the bytes of registers spilled (n_spills: spill stores / 4; the stack also holds
small local arrays, which are not spills), and its SASS the hot loop (`bench/sass.py`).

A streaming kernel's cost in issue slots per byte it streams: SASS warp instructions per byte =
hot-loop instructions per iteration / (bytes one warp streams per iteration), the bytes read off
the specialization's constexprs by STREAMED below: tiles x rows x cols x bits / 8 / num_warps.
An RTX 3090 issues 82 SMs x 4 schedulers x 1.7 GHz = 558 G warp instructions/s against 936 GB/s:
above ~0.6 instructions a byte a kernel cannot reach the bandwidth roofline there.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import triton  # noqa: E402

from bench.sass import find_loops, parse_resources, parse_sass  # noqa: E402
from bench.triton_compile import Launch, compile_all, compile_launch, record_launches  # noqa: E402

CAPABILITY = 86
TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
TRITON_VERSION = triton.__version__
SPILL_STORES = re.compile(r"(\d+) bytes spill stores")


@dataclass(frozen=True)
class Streamed:
    """What one hot-loop iteration of a kernel streams: `tiles` tiles of rows x cols elements (constexpr
    names) of the tensor `pointer` points to, `bits` wide (a constexpr name; 0 there means unquantized:
    the pointer's element width; or a number)."""

    role: str  # what the bytes are, for bench/roofline.py: "linear", "experts" (weights) or "kv"
    pointer: str
    rows: str
    cols: str
    bits: str | int
    tiles: int = 1
    repeat: str | None = None  # a constexpr naming how many tiles an iteration streams one after another


# Extend for new kernels: their name -> what one loop iteration streams. Kernels not listed report
# registers, spills and loops without a per-byte figure.
STREAMED = {
    "_matmul_kernel": Streamed("linear", "w_ptr", "BLOCK_N", "BLOCK_K", "BITS"),
    "_up_kernel": Streamed("experts", "w_ptr", "BLOCK_I", "BLOCK_H", "BITS", tiles=2),  # gate and up tiles
    "_down_kernel": Streamed("experts", "w_ptr", "BLOCK_H", "BLOCK_I", "BITS"),
    "_attention_kernel": Streamed("kv", "k_ptr", "BLOCK_N", "BLOCK_D", 0, tiles=2),  # K and V tiles
    # The streaming decode kernels (kernels/gemv_triton.py, kernels/moe_decode_triton.py): the hot loop
    # is the routed experts' (the shared expert's loop streams its own tiles alike).
    "_gemv_kernel": Streamed("linear", "w_ptr", "BLOCK_N", "BLOCK_K", "BITS"),
    "_up_decode_kernel": Streamed("experts", "w_ptr", "BLOCK_I", "BLOCK_R", "BITS", tiles=2),
    "_down_decode_kernel": Streamed("experts", "w_ptr", "BLOCK_H", "BLOCK_R", "BITS"),
}
ELEMENT_BITS = {"i8": 8, "u8": 8, "fp8e4nv": 8, "fp8e5": 8, "bf16": 16, "fp16": 16, "fp32": 32, "i32": 32}
METHOD = ("instructions_per_byte = hot_loop.path_instructions / bytes_per_warp_iteration; "
          "bytes_per_warp_iteration = tiles * constexpr[repeat] * constexpr[rows] * constexpr[cols] * bits / 8 / "
          "num_warps (rule per "
          "kernel in bench/kernel_specs.py STREAMED; bits = constexpr BITS, or the streamed pointer's element width "
          "when it is 0); hot_loop = the innermost SASS loop with the most instructions on its longest path from "
          "header to back edge (an if's arms counted once, BRA.DIV slow paths not counted; bench/sass.py)")


def is_decode(launch: Launch) -> bool:
    return launch.named_constexprs().get("BLOCK_M", 0) <= 16


def streamed_bytes(launch: Launch, num_warps: int) -> dict | None:
    """Bytes one warp streams per hot-loop iteration, and their width, by the STREAMED rule."""
    rule = STREAMED.get(launch.kernel)
    if rule is None:
        return None
    c = launch.named_constexprs()
    bits = c[rule.bits] if isinstance(rule.bits, str) else rule.bits
    if bits == 0:
        bits = ELEMENT_BITS[launch.signature[rule.pointer].lstrip("*")]
    tiles = rule.tiles * (c[rule.repeat] if rule.repeat else 1)
    per_iteration = tiles * c[rule.rows] * c[rule.cols] * bits / 8
    return {"role": rule.role, "bits": bits, "bytes_per_iteration": per_iteration,
            "bytes_per_warp_iteration": per_iteration / num_warps}


def cuobjdump(flag: str, cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(TOOLS / "cuobjdump"), flag, f.name], capture_output=True, text=True,
                              check=True).stdout


def spill_store_bytes(kernel, capability: int) -> int:
    """Bytes of registers a compiled kernel spills, as ptxas reports them for its PTX (the cubin's
    resource counts mix spills with local arrays in the stack)."""
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(kernel.asm["ptx"])
        f.flush()
        log = subprocess.run([str(TOOLS / "ptxas"), "-v", "--regAllocOptLevel=2", f"--gpu-name=sm_{capability}", f.name,
                              "-o", "/dev/null"], capture_output=True, text=True, check=True).stderr
    return int(SPILL_STORES.search(log).group(1))


def spec_one(launch: Launch) -> dict:
    pointers = {k: v for k, v in launch.signature.items() if v.startswith("*")}
    # The first pointer is the activation (x, inter, q): its type tells bf16 from float32 models.
    row = {"kernel": launch.kernel, "activation": next(iter(pointers.values()), "").lstrip("*"),
           "constexprs": launch.named_constexprs(), "pointers": pointers}
    try:
        kernel = compile_launch(launch, CAPABILITY)
    except Exception as e:  # noqa: BLE001 - report it, keep going with the rest
        return {**row, "error": f"{type(e).__name__}: {str(e)[:400]}"}
    resources = parse_resources(cuobjdump("-res-usage", kernel.asm["cubin"]))
    code = parse_sass(cuobjdump("-sass", kernel.asm["cubin"]))
    loops = find_loops(code)
    num_warps = kernel.metadata.num_warps
    row.update(registers=resources["registers"], n_spills=spill_store_bytes(kernel, CAPABILITY) // 4,
               stack_bytes=resources["stack_bytes"], local_bytes=resources["local_bytes"],
               shared_bytes=kernel.metadata.shared, num_warps=num_warps,
               num_stages=kernel.metadata.num_stages, sass_instructions=len(code),
               loops=[vars(loop) for loop in loops])
    hot = max(loops, key=lambda loop: loop.path_instructions, default=None)
    row["hot_loop_instructions"] = hot.path_instructions if hot else None
    stream = streamed_bytes(launch, num_warps)
    if stream and hot:
        row.update(stream, instructions_per_byte=hot.path_instructions / stream["bytes_per_warp_iteration"])
    return row


def crashed(launch: Launch) -> dict:
    return {"kernel": launch.kernel, "constexprs": launch.named_constexprs(), "error": "the compiler crashed"}


def summarize(specs: list[dict]) -> dict:
    """Per role, bits and activation type (e.g. summary["experts"]["4"]["bf16"]): the worst (largest)
    instructions per byte of any kernel specialization, which one it is, and each kernel's worst.
    The worst is conservative: it covers every scheme of that width (int4 zero points too)."""
    summary: dict = {}
    for s in specs:
        if "instructions_per_byte" in s:
            by_bits = summary.setdefault(s["role"], {}).setdefault(str(s["bits"]), {})
            entry = by_bits.setdefault(s["activation"], {"instructions_per_byte": 0.0, "per_kernel": {}})
            per_kernel = entry["per_kernel"]
            per_kernel[s["kernel"]] = max(per_kernel.get(s["kernel"], 0.0), s["instructions_per_byte"])
            if s["instructions_per_byte"] > entry["instructions_per_byte"]:
                entry.update(instructions_per_byte=s["instructions_per_byte"], kernel=s["kernel"],
                             constexprs=s["constexprs"])
    return summary


def table(specs: list[dict]) -> str:
    lines = [f"{'kernel':<20} {'act':>4} {'bits':>4} {'regs':>4} {'spill':>5} {'smem':>6} {'warps':>5} {'loop':>5} "
             f"{'B/warp-it':>9} {'instr/B':>7}  constexprs"]
    for s in specs:
        if "error" in s:
            lines.append(f"{s['kernel']:<20} ERROR {s['error'][:90]}")
            continue
        shown = ("BLOCK", "BITS", "OFFSET", "M", "T", "INT8", "HAS", "ALL")
        short = {k: v for k, v in s["constexprs"].items() if k.startswith(shown)}
        per_byte = f"{s['instructions_per_byte']:.3f}" if "instructions_per_byte" in s else ""
        lines.append(f"{s['kernel']:<20} {s['activation']:>4} {s.get('bits', ''):>4} {s['registers']:>4} "
                     f"{s['n_spills']:>5} {s['shared_bytes']:>6} {s['num_warps']:>5} "
                     f"{s['hot_loop_instructions'] or '':>5} {s.get('bytes_per_warp_iteration', ''):>9} "
                     f"{per_byte:>7}  {short}")
    return "\n".join(lines)


def main() -> int:
    from kernel_compile import exercise_engine  # tests/: the launches the compile test checks

    from lucebox.benchmark.record import commit, machine, utc_now

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="write the JSON here (default: print it)")
    args = p.parse_args()
    launches = [launch for launch in record_launches(exercise_engine) if is_decode(launch)]
    specs = compile_all(launches, spec_one, crashed)
    specs.sort(key=lambda s: (s["kernel"], s.get("bits", 0), json.dumps(s["constexprs"], sort_keys=True)))
    record = {"benchmark": "kernel_specs", "date": utc_now(), "commit": commit(), "machine": machine(),
              "command": " ".join(["python", *sys.argv]), "triton": TRITON_VERSION, "target": f"sm_{CAPABILITY}",
              "measured": "compile statistics on the CPU (no GPU): registers, local memory, shared memory, SASS",
              "method": METHOD, "summary": summarize(specs), "specs": specs}
    print(table(specs))
    text = json.dumps(record, indent=2, default=str) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text)
    return 1 if any("error" in s for s in specs) else 0


if __name__ == "__main__":
    sys.exit(main())
