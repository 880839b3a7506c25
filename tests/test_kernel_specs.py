"""`bench/kernel_specs.py` on two real launches compiled for sm_86 (the full run takes minutes, so it is
not run here): a weight-streaming kernel gets registers, spills, its hot loop and instructions per
weight byte; a kernel the STREAMED table does not know gets registers and spills without failing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Run apart: importing bench/triton_compile.py turns Triton's interpreter off for its process.
SCRIPT = """
import json, sys, torch
sys.path.insert(0, "bench")
import kernel_specs
from bench.triton_compile import record_launches
from lucebox.kernels import norm_triton, quant, quant_triton

def exercise():
    w = quant.quantize(torch.randn(512, 2048, dtype=torch.bfloat16), "int4")
    quant_triton.quantized_linear(torch.randn(1, 2048, dtype=torch.bfloat16), w)
    norm_triton.rms_norm(torch.randn(1, 2048, dtype=torch.bfloat16), torch.randn(2048, dtype=torch.bfloat16), 1e-6)

launches = [launch for launch in record_launches(exercise) if kernel_specs.is_decode(launch)]
print(json.dumps([kernel_specs.spec_one(launch) for launch in launches], default=str))
# The MoE up kernel streams a gate and an up tile per iteration; BITS 0 reads the weight pointer's width.
names = ["x_ptr", "w_ptr", "BITS", "BLOCK_I", "BLOCK_H"]
for bits, pointer in ((4, "*u8"), (0, "*bf16")):
    up = kernel_specs.Launch("m", "_up_kernel", dict(zip(names, ["*bf16", pointer] + ["constexpr"] * 3)),
                             {(2,): bits, (3,): 16, (4,): 256}, {}, {})
    print(json.dumps(kernel_specs.streamed_bytes(up, num_warps=4)))
"""


def test_specs_give_per_byte_figures_for_known_kernels_and_registers_for_every_kernel():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    *_, spec_line, int4_up, bf16_up = done.stdout.splitlines()
    assert json.loads(int4_up) == {"role": "experts", "bits": 4, "bytes_per_iteration": 2 * 16 * 256 / 2,
                                   "bytes_per_warp_iteration": 2 * 16 * 256 / 2 / 4}
    assert json.loads(bf16_up)["bits"] == 16 and json.loads(bf16_up)["bytes_per_iteration"] == 2 * 16 * 256 * 2
    specs = {s["kernel"]: s for s in json.loads(spec_line)}
    assert set(specs) == {"_gemv_kernel", "_rms_norm_kernel"}  # a decode row takes the streaming GEMV
    for s in specs.values():
        assert s["registers"] > 0 and s["n_spills"] >= 0 and s["num_warps"] > 0 and "error" not in s
    matmul = specs["_gemv_kernel"]
    c = matmul["constexprs"]
    assert matmul["bits"] == 4 and matmul["role"] == "linear" and matmul["activation"] == "bf16"
    assert matmul["bytes_per_warp_iteration"] == c["BLOCK_N"] * c["BLOCK_K"] * 4 / 8 / matmul["num_warps"]
    assert matmul["hot_loop_instructions"] == max(loop["path_instructions"] for loop in matmul["loops"]) > 0
    assert matmul["instructions_per_byte"] == matmul["hot_loop_instructions"] / matmul["bytes_per_warp_iteration"]
    assert "instructions_per_byte" not in specs["_rms_norm_kernel"]
