"""Compile every Triton kernel specialization the engine launches for real GPUs, without one.

Run as a script (`python tests/kernel_compile.py`): it imports the kernels compiled (not
interpreted), records each launch the kernel wrappers make at Laguna XS.2 shapes (bf16, fp16,
fp32; plain, int8 and int4 weights; decode, verify and prefill rows), and compiles each distinct
specialization to a cubin for sm_86 (RTX 3090) and sm_90 (H100/H200) with Triton's own
compiler. That catches what the CPU interpreter cannot: constructs the compiler rejects, type
mismatches, and tiles whose shared memory does not fit the card. Prints one JSON line per
specialization and exits non-zero if any fails.
"""

from __future__ import annotations

import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor

os.environ.pop("TRITON_INTERPRET", None)  # before any kernel module is imported
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

# Shared memory one block may use: RTX 3090 (sm_86) and Hopper (sm_90).
TARGETS = {86: 101376, 90: 232448}
_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
          torch.int64: "i64", torch.int32: "i32", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1"}


def record_launches() -> list[tuple[str, str, dict, dict]]:
    """(module, kernel name, signature, constexprs, launch options) of every launch the wrappers make."""
    launches = {}

    def run(self, *args, grid, warmup, **kwargs):
        signature, constexprs = {}, {}
        values = dict(zip(self.arg_names, args, strict=False)) | kwargs
        for param in self.params:
            value = values[param.name]
            if param.is_constexpr:
                signature[param.name], constexprs[param.name] = "constexpr", value
            elif isinstance(value, torch.Tensor):
                signature[param.name] = "*" + _TYPES[value.dtype]
            elif isinstance(value, bool):
                signature[param.name] = "i1"
            elif isinstance(value, int):
                if value == 1:  # Triton specializes integer arguments equal to 1
                    signature[param.name], constexprs[param.name] = "constexpr", 1
                else:
                    signature[param.name] = "i64" if abs(value) >= 2**31 else "i32"
            elif isinstance(value, float):
                signature[param.name] = "fp32"
            else:
                raise TypeError(f"{self.fn.__name__}: argument {param.name} of type {type(value)}")
        options = {k: v for k, v in kwargs.items() if k in ("num_warps", "num_stages")}
        key = (self.fn.__module__, self.fn.__name__, json.dumps(signature, sort_keys=True),
               json.dumps({k: v for k, v in constexprs.items()}, sort_keys=True, default=str),
               json.dumps(options, sort_keys=True))
        launches[key] = (self.fn.__module__, self.fn.__name__, signature, constexprs, options)

    JITFunction.run = run
    exercise_wrappers()
    return list(launches.values())


def exercise_wrappers() -> None:
    from lucebox.kernels import attention_triton, gate_triton, moe_triton, norm_triton, quant, quant_triton, rope_triton

    H, E, F, K, KV, D = 2048, 8, 512, 8, 8, 128  # Laguna XS.2 widths (8 of its 256 experts suffice)
    for dtype in (torch.bfloat16, torch.float32):  # float16 compiles like bfloat16
        gate_up = torch.randn(E, 2 * F, H, dtype=dtype)
        down = torch.randn(E, H, F, dtype=dtype)
        shared_gate_up, shared_down = torch.randn(2 * F, H, dtype=dtype), torch.randn(H, F, dtype=dtype)
        variants = [(gate_up, down, None, None), (gate_up, down, shared_gate_up, shared_down)]
        for scheme, asymmetric in (("int8", False), ("int4", False), ("int4", True)):
            q = [quant.quantize(w, scheme, asymmetric=asymmetric) for w in (gate_up, down, shared_gate_up, shared_down)]
            variants.append(tuple(q))
            quant_triton.quantized_linear(torch.randn(3, H, dtype=dtype), q[2])
            quant_triton.quantized_linear(torch.randn(100, H, dtype=dtype), q[2])
        for M in (1, 16, 100):  # decode, a full verify block, a prefill chunk
            x = torch.randn(M, H, dtype=dtype)
            ids = torch.stack([torch.randperm(E)[:K] for _ in range(M)])
            for g, d, sg, sd in variants:
                moe_triton.moe_experts(x, g, d, torch.rand(M, K), ids, 2.5, sg, sd)
            for heads, window, S in ((48, None, 65536), (64, 512, 528)):
                q = torch.randn(M, heads, D, dtype=dtype)
                k, v = torch.randn(KV, S, D, dtype=dtype), torch.randn(KV, S, D, dtype=dtype)
                positions = torch.arange(S)
                attention_triton.attention_partial(q, k, v, positions[-M:], positions, D**-0.5, window)
                attention_triton.attention_partial(q, k, v, positions[-M:], positions, D**-0.5, None,
                                                   positions < 64, 256)
                attention_triton.attention_partial(q, k, v, positions[-M:] + S, positions, D**-0.5, None,
                                                   all_visible=True)
                rope_triton.rotate(q, positions[:M], torch.rand(D // 4), 1.0)  # partial rotary (full layers)
                rope_triton.rotate(q, positions[:M], torch.rand(D // 2), 1.0)
                gate_triton.softplus_gate(q, torch.randn(M, heads, dtype=dtype))
                gate_triton.softplus_gate(q, torch.randn(M, heads * D, dtype=dtype))
            norm_triton.rms_norm(x, torch.randn(H, dtype=dtype), 1e-6)
            norm_triton.add_rms_norm(x, x, torch.randn(H, dtype=dtype), 1e-6)
            norm_triton.rms_norm(torch.randn(M, 48, D, dtype=dtype), torch.randn(D, dtype=dtype), 1e-6)


def compile_one(job: tuple) -> dict:
    module, name, signature, constexprs, options, capability = job
    fn = getattr(sys.modules.get(module) or __import__(module, fromlist=[name]), name)
    try:
        kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                                target=GPUTarget("cuda", capability, 32), options=options)
        shared = kernel.metadata.shared
        ok = shared <= TARGETS[capability]
        error = None if ok else f"needs {shared} bytes of shared memory, sm_{capability} has {TARGETS[capability]}"
    except Exception as e:  # noqa: BLE001 - report every failure, keep compiling the rest
        shared, ok, error = None, False, f"{type(e).__name__}: {str(e)[:800]}"
    return {"kernel": name, "sm": capability, "ok": ok, "shared_bytes": shared, "error": error,
            "constexprs": {k: v for k, v in constexprs.items() if k.isupper()}}


def main() -> int:
    launches = record_launches()
    jobs = [(*launch, capability) for launch in launches for capability in TARGETS]
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = list(pool.map(compile_one, jobs))
    for result in results:
        print(json.dumps(result, default=str))
    failed = [r for r in results if not r["ok"]]
    print(json.dumps({"specializations": len(launches), "compiled": len(results) - len(failed),
                      "failed": len(failed)}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
