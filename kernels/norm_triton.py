"""RMSNorm, and residual add + RMSNorm in one pass, in Triton (a tile of whole rows per program)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, delta_ptr, sum_ptr, y_ptr, w_ptr, R, N, eps,
                     ADD: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < R) & (cols[None, :] < N)
    offsets = rows[:, None].to(tl.int64) * N + cols[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    if ADD:
        # The sum is rounded to the activations' dtype before it is normalized, as `x + delta` is.
        x = (x.to(tl.float32) + tl.load(delta_ptr + offsets, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + offsets, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=1) / N + eps)
    w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
    y = (x32 * rstd[:, None]).to(x.dtype).to(tl.float32) * w[None, :]
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float):
    N = x.shape[-1]
    x2 = x.reshape(-1, N).contiguous()
    R = x2.shape[0]
    y = torch.empty_like(x2)
    total = torch.empty_like(x2) if delta is not None else y
    d2 = delta.reshape(-1, N).contiguous() if delta is not None else x2
    block_n = triton.next_power_of_2(N)
    block_r = max(1, min(64, 8192 // block_n))  # about 8K elements a program: small rows share one
    _rms_norm_kernel[(triton.cdiv(R, block_r),)](x2, d2, total, y, weight.contiguous(), R, N, eps,
                                                 ADD=delta is not None, BLOCK_R=block_r, BLOCK_N=block_n)
    return total.view(x.shape), y.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)[1]


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """(x + delta, rms_norm(x + delta)) in one read of each input."""
    return _launch(x, delta, weight, eps)
