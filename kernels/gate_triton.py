"""Softplus output gate in Triton: out * softplus(g), per head or per element, one pass over a
flat range of elements."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def softplus(g):
    """softplus of float32 g = max(g, 0) + log1p(exp(-|g|)); log1p by its series where 1 + u
    would round to 1. Also run by attention's merge (`attention_triton`), which applies the gate."""
    u = tl.exp(-tl.abs(g))
    return tl.maximum(g, 0.0) + tl.where(u < 1e-4, u - 0.5 * u * u, tl.log(1.0 + u))


@triton.jit
def _gate_kernel(out_ptr, g_ptr, y_ptr, total, N, D, G, PER_HEAD: tl.constexpr, BLOCK: tl.constexpr):
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = e < total
    row, col = e // N, e % N
    out = tl.load(out_ptr + e, mask=mask, other=0.0)
    g_col = col // D if PER_HEAD else col
    g = tl.load(g_ptr + row * G + g_col, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + e, out * softplus(g).to(out.dtype), mask=mask)


def softplus_gate(out: torch.Tensor, gate_logits: torch.Tensor) -> torch.Tensor:
    T, Hq, D = out.shape
    out2, g = out.reshape(T, Hq * D).contiguous(), gate_logits.contiguous()
    y = torch.empty_like(out2)
    total, block = out2.numel(), 4096
    _gate_kernel[(triton.cdiv(total, block),)](out2, g, y, total, Hq * D, D, g.shape[1],
                                               PER_HEAD=g.shape[1] == Hq, BLOCK=block)
    return y.view(T, Hq, D)
