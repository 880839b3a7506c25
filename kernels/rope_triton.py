"""Rotary embedding in Triton: angles computed in float32 from the positions and the frequency
vector (so no cos/sin table is built or read), rotate-half layout, partial rotary. A program
rotates a tile of (token, head) rows."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(x_ptr, y_ptr, pos_ptr, freq_ptr, R, heads, D, scaling, stride_t, stride_h,
                 HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)  # row = token * heads + head
    r_ok = r < R
    t = r // heads
    src = x_ptr + (t.to(tl.int64) * stride_t + (r % heads) * stride_h)[:, None]
    dst = y_ptr + (r.to(tl.int64) * D)[:, None]
    i = tl.arange(0, BLOCK_HALF)[None, :]
    rot = r_ok[:, None] & (i < HALF)
    angle = tl.load(pos_ptr + t, mask=r_ok, other=0).to(tl.float32)[:, None] * tl.load(freq_ptr + i, mask=i < HALF,
                                                                                      other=0.0)
    cos, sin = tl.cos(angle) * scaling, tl.sin(angle) * scaling
    x1 = tl.load(src + i, mask=rot, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + i, mask=rot, other=0.0).to(tl.float32)
    tl.store(dst + i, (x1 * cos - x2 * sin).to(y_ptr.dtype.element_ty), mask=rot)
    tl.store(dst + HALF + i, (x2 * cos + x1 * sin).to(y_ptr.dtype.element_ty), mask=rot)
    rest = 2 * HALF + tl.arange(0, BLOCK_D)[None, :]
    keep = r_ok[:, None] & (rest < D)
    tl.store(dst + rest, tl.load(src + rest, mask=keep, other=0.0), mask=keep)


def rotate(xs: tuple[torch.Tensor, ...], positions: torch.Tensor, inv_freq: torch.Tensor,
           scaling: float) -> tuple[torch.Tensor, ...]:
    """As `kernels.rope.rotate`; the kernel computes its angles itself, one launch per tensor."""
    positions, inv_freq = positions.contiguous(), inv_freq.contiguous()
    return tuple(_rotate(x, positions, inv_freq, scaling) for x in xs)


def _rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float) -> torch.Tensor:
    T, heads, D = x.shape
    if x.stride(2) != 1:
        x = x.contiguous()
    half = inv_freq.shape[0]
    y = torch.empty((T, heads, D), dtype=x.dtype, device=x.device)
    rows, block_r = T * heads, 64
    _rope_kernel[(triton.cdiv(rows, block_r),)](
        x, y, positions, inv_freq, rows, heads, D, scaling, x.stride(0), x.stride(1),
        HALF=half, BLOCK_R=block_r, BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_D=triton.next_power_of_2(max(D - 2 * half, 1)))
    return y
