"""RMSNorm, and residual add + RMSNorm in one pass, in Triton (one program per row)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, delta_ptr, sum_ptr, y_ptr, w_ptr, N, eps,
                     ADD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * N
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row + cols, mask=mask, other=0.0)
    if ADD:
        # The sum is rounded to the activations' dtype before it is normalized, as `x + delta` is.
        x = (x.to(tl.float32) + tl.load(delta_ptr + row + cols, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + row + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row + cols, ((x32 * rstd).to(x.dtype).to(tl.float32) * w).to(y_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float):
    N = x.shape[-1]
    x2 = x.reshape(-1, N).contiguous()
    y = torch.empty_like(x2)
    total = torch.empty_like(x2) if delta is not None else y
    d2 = delta.reshape(-1, N).contiguous() if delta is not None else x2
    _rms_norm_kernel[(x2.shape[0],)](x2, d2, total, y, weight, N, eps, ADD=delta is not None,
                                     BLOCK=triton.next_power_of_2(N))
    return total.view(x.shape), y.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)[1]


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """(x + delta, rms_norm(x + delta)) in one read of each input."""
    return _launch(x, delta, weight, eps)
