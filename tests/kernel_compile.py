"""Compile every Triton kernel specialization the engine launches for real GPUs, without one.

Run as a script (`python tests/kernel_compile.py`): it imports the kernels compiled (not
interpreted), records each launch the kernel wrappers make at Laguna XS.2 shapes (bf16, fp16,
fp32; plain, int8 and int4 weights; decode, verify and prefill rows) and at Qwen3-Next's Gated
DeltaNet shapes, and compiles each distinct specialization to a cubin for sm_86 (RTX 3090) and
sm_90 (H100/H200) with Triton's own compiler. That catches what the CPU interpreter cannot:
constructs the compiler rejects, type mismatches, and tiles whose shared memory does not fit the
card, and bf16/fp16 decode specializations (at most 16 rows) that spill registers on sm_86 (ptxas's
count).
Prints one JSON line per specialization and exits non-zero if any fails.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# Turns Triton's interpreter off: before any kernel module is imported.
from bench.kernel_specs import CAPABILITY, is_decode, spill_store_bytes  # noqa: E402
from bench.triton_compile import SHARED_MEMORY, Launch, compile_all, compile_launch, record_launches  # noqa: E402


def exercise_engine() -> None:
    """Every kernel launch the engine makes at the widths this file checks."""
    exercise_wrappers()
    exercise_delta_rule()
    exercise_head()
    exercise_route()


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
            variants += [tuple(q), (q[0], q[1], None, None)]  # with and without a shared expert
            for M in (1, 3, 16, 100):  # the GEMV at decode and verify widths, tl.dot tiles for prefill
                quant_triton.quantized_linear(torch.randn(M, H, dtype=dtype), q[2])
            quant_triton.quantized_linear(torch.randn(1, H, dtype=dtype), q[2], torch.randn(2 * F, dtype=dtype))
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
                if window is None:  # int8 K/V (the paged pool's `kv_dtype="int8"`), select and streamed
                    k8, v8, scale8 = k.to(torch.int8), v.to(torch.int8), torch.rand(KV, S)
                    attention_triton.attention_partial(q, k8, v8, positions[-M:], positions, D**-0.5, None,
                                                       positions < 64, 256, k_scale=scale8, v_scale=scale8)
                    attention_triton.attention_partial(q, k8, v8, positions[-M:] + S, positions, D**-0.5, None,
                                                       all_visible=True, k_scale=scale8, v_scale=scale8)
                rope_triton.rotate((q,), positions[:M], torch.rand(D // 4), 1.0)  # partial rotary (full layers)
                rope_triton.rotate((q,), positions[:M], torch.rand(D // 2), 1.0)
                gate_triton.softplus_gate(q, torch.randn(M, heads, dtype=dtype))
                gate_triton.softplus_gate(q, torch.randn(M, heads * D, dtype=dtype))
                exercise_norm_rope_store(M, heads, KV, D, S, window, dtype)
                for width in (heads, heads * D):  # the softplus gate in the merge, its logits a projection's view
                    gate = torch.randn(M, width + KV * D, dtype=dtype)[:, KV * D :]
                    attention_triton.attention_partial(q, k, v, positions[-M:], positions, D**-0.5, window, gate=gate)
                if window is not None:  # a sliding ring's splits over its live window
                    attention_triton.attention_partial(q, k, v, positions[-M:], positions, D**-0.5, window, ring=True)
            norm_triton.rms_norm(x, torch.randn(H, dtype=dtype), 1e-6)
            norm_triton.add_rms_norm(x, x, torch.randn(H, dtype=dtype), 1e-6)
            norm_triton.rms_norm(torch.randn(M, 48, D, dtype=dtype), torch.randn(D, dtype=dtype), 1e-6)


def exercise_norm_rope_store(M: int, heads: int, KV: int, D: int, S: int, window: int | None,
                             dtype: torch.dtype) -> None:
    """The graphed step's norm + RoPE + K/V store, on q, k, v as views of one projection, into a
    ring (sliding layers) or a paged pool (full layers, partial rotary), with and without qk_norm."""
    from lucebox.kernels import rope_store_triton

    from lucebox.caches.base import RowTable

    projected = torch.randn(M, (heads + 2 * KV) * D, dtype=dtype)
    q = projected[:, : heads * D].view(M, heads, D)
    key = projected[:, heads * D : (heads + KV) * D].view(M, KV, D)
    value = projected[:, (heads + KV) * D :].view(M, KV, D)
    table, chunk, rotary = (torch.zeros(1, dtype=torch.int64), S, D // 2) if window else \
        (torch.arange(S // 64), 64, D // 4)
    rows = RowTable(torch.empty(KV, S, D, dtype=dtype), torch.empty(KV, S, D, dtype=dtype),
                    torch.arange(S), table, chunk)
    positions = torch.arange(M)
    for norms in (None, (torch.randn(D, dtype=dtype), torch.randn(D, dtype=dtype))):
        rope_store_triton.norm_rope_store(q, key, value, positions, torch.rand(rotary), 1.0, norms, 1e-6, rows,
                                          positions)


def exercise_delta_rule() -> None:
    """The Gated DeltaNet kernels at Qwen3-Next's widths: the conv over bf16 / fp32 activations, the
    delta rule over float32 inputs (as the mixer passes them), decay per head or per key channel."""
    from lucebox.kernels import delta_rule_triton

    Hv, Dk, Dv, C, K = 32, 128, 128, 8192, 4
    for T, every_row in ((1, True), (16, True), (100, False)):  # decode, a verify block, a prefill chunk
        for dtype in (torch.bfloat16, torch.float32):
            x, weight = torch.randn(T, C, dtype=dtype), torch.randn(C, K, dtype=dtype)
            delta_rule_triton.causal_conv1d(x, weight, torch.zeros(K - 1, C, dtype=dtype), every_row)
        q, v, beta, state = torch.randn(T, Hv, Dk), torch.randn(T, Hv, Dv), torch.rand(T, Hv), torch.zeros(Hv, Dk, Dv)
        for g in (-torch.rand(T, Hv), -torch.rand(T, Hv, Dk)):
            delta_rule_triton.recurrent_gated_delta_rule(q, q, v, g, beta, state, every_row)


def exercise_head() -> None:
    """The greedy choice after the LM head, over XS.2's vocabulary, for decode and a verify block."""
    from lucebox.kernels import greedy_triton

    for dtype in (torch.bfloat16, torch.float32):
        for M in (1, 16):
            greedy_triton.greedy_choices(torch.randn(M, 100352, dtype=dtype))


def exercise_route() -> None:
    """MoE routing at Laguna XS.2's widths: 256 experts, top-8, sigmoid + correction bias, over
    bf16 / fp32 rows and the float32 router; a decode row and a full verify block."""
    from lucebox.kernels import route_triton

    from lucebox.config import MoESpec

    H, E = 2048, 256
    spec = MoESpec(num_experts=E, top_k=8, expert_size=512, router="sigmoid", normalize_topk=True,
                   routed_scaling=2.5, correction_bias=True)
    for M in (1, 16):
        for dtype in (torch.bfloat16, torch.float32):
            route_triton.moe_route(torch.randn(M, H, dtype=dtype), torch.randn(E, H), spec, torch.randn(E))


def compile_one(job: tuple[Launch, int]) -> dict:
    launch, capability = job
    try:
        kernel = compile_launch(launch, capability)
        shared, limit = kernel.metadata.shared, SHARED_MEMORY[capability]
        # A decode kernel that spills registers reads them back from memory every K-loop iteration
        # (RTX 3090). float32 models are the CPU tests' and the CPU's: their attention spills on sm_86.
        activation = next(t for t in launch.signature.values() if t.startswith("*"))
        spilled = (spill_store_bytes(kernel, capability)
                   if capability == CAPABILITY and is_decode(launch) and activation in ("*bf16", "*fp16") else 0)
        ok = shared <= limit and not spilled
        error = (f"needs {shared} bytes of shared memory, sm_{capability} has {limit}" if shared > limit else
                 f"a bf16/fp16 decode kernel spills {spilled} bytes on sm_{capability}" if spilled else None)
    except Exception as e:  # noqa: BLE001 - report every failure, keep compiling the rest
        shared, ok, error = None, False, f"{type(e).__name__}: {str(e)[:800]}"
    return {"kernel": launch.kernel, "sm": capability, "ok": ok, "shared_bytes": shared, "error": error,
            "constexprs": {str(k): v for k, v in launch.constexprs.items()}}


def compiler_crashed(job: tuple[Launch, int]) -> dict:
    return {"kernel": job[0].kernel, "sm": job[1], "ok": False, "shared_bytes": None,
            "error": "the compiler crashed (see stderr)", "constexprs": {}}


def main() -> int:
    launches = record_launches(exercise_engine)
    results = compile_all([(launch, sm) for launch in launches for sm in SHARED_MEMORY], compile_one, compiler_crashed)
    for result in results:
        print(json.dumps(result, default=str))
    failed = [r for r in results if not r["ok"]]
    print(json.dumps({"specializations": len(launches), "compiled": len(results) - len(failed),
                      "failed": len(failed)}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
