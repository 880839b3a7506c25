"""Softplus output gate in Triton: out * softplus(g), per head or per element, one pass."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gate_kernel(out_ptr, g_ptr, y_ptr, N, D, G, PER_HEAD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    out = tl.load(out_ptr + row * N + cols, mask=mask, other=0.0)
    g_cols = cols // D if PER_HEAD else cols
    g = tl.load(g_ptr + row * G + g_cols, mask=mask, other=0.0).to(tl.float32)
    # softplus = max(g, 0) + log1p(exp(-|g|)); log1p by its series where 1 + u would round to 1.
    u = tl.exp(-tl.abs(g))
    soft = tl.maximum(g, 0.0) + tl.where(u < 1e-4, u - 0.5 * u * u, tl.log(1.0 + u))
    tl.store(y_ptr + row * N + cols, out * soft.to(out.dtype), mask=mask)


def softplus_gate(out: torch.Tensor, gate_logits: torch.Tensor) -> torch.Tensor:
    T, Hq, D = out.shape
    out2, g = out.reshape(T, Hq * D).contiguous(), gate_logits.contiguous()
    y = torch.empty_like(out2)
    grid = (T, triton.cdiv(Hq * D, 1024))
    _gate_kernel[grid](out2, g, y, Hq * D, D, g.shape[1], PER_HEAD=g.shape[1] == Hq, BLOCK=1024)
    return y.view(T, Hq, D)
