"""Weight-only quantized matmul in Triton: y = x @ dequantize(w).T, codes dequantized one tile at a
time in registers, so the weight is read from memory once in its packed form.

`load_weight_tile` is the one place that turns codes (or plain weights) into a float tile; the
MoE kernels use it too, so experts can be quantized the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from lucebox.kernels.quant import QuantizedTensor


@triton.jit
def load_weight_tile(
    w_ptr, scale_ptr, zero_ptr,  # one matrix's base pointers (an expert's, for stacks)
    rows, cols, mask,  # rows (R,) output features, cols (C,) input features, mask (R, C)
    stride_row, stride_scale_row,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
):
    """Tile (R, C) of the weight in float32. BITS 0: a plain (unquantized) weight; 8: int8 codes;
    4: two codes per byte along the input features (even feature in the low nibble)."""
    if BITS == 0:
        return tl.load(w_ptr + rows[:, None] * stride_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if BITS == 8:
        codes = tl.load(w_ptr + rows[:, None] * stride_row + cols[None, :], mask=mask, other=0).to(tl.float32)
        zero = 0.0
    else:
        packed = tl.load(w_ptr + rows[:, None] * stride_row + cols[None, :] // 2, mask=mask, other=0).to(tl.int32)
        codes = ((packed >> ((cols[None, :] % 2) * 4)) & 0xF).to(tl.float32)
        zero = 8.0
    group_offsets = rows[:, None] * stride_scale_row + cols[None, :] // GROUP
    scale = tl.load(scale_ptr + group_offsets, mask=mask, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        zero = tl.load(zero_ptr + group_offsets, mask=mask, other=0.0).to(tl.float32)
    return (codes - zero) * scale


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot`'s input precision: float32 models multiply in full float32 (not TF32), so they stay
    comparable to the reference; for 16-bit inputs the setting has no effect ("tf32" is Triton's
    default)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def weight_args(w: torch.Tensor | QuantizedTensor) -> tuple:
    """(w_ptr, scale_ptr, zero_ptr, stride_row, stride_scale_row, BITS, GROUP, HAS_ZEROS) of a
    matrix or a stack of matrices (strides of one matrix's rows)."""
    if isinstance(w, QuantizedTensor):
        zeros = w.zeros if w.zeros is not None else w.scales  # a valid pointer that is never read
        return (w.codes, w.scales, zeros, w.codes.stride(-2), w.scales.stride(-2), w.bits, w.group,
                w.zeros is not None)
    if w.stride(-1) != 1:
        raise ValueError("weights must be contiguous along their input features")
    return (w, w, w, w.stride(-2), 0, 0, 1, False)


def expert_strides(w: torch.Tensor | QuantizedTensor) -> tuple[int, int]:
    """(elements between experts in the codes/weight, in the scales) of an (E, N, K) stack."""
    if isinstance(w, QuantizedTensor):
        return w.codes.stride(0), w.scales.stride(0)
    return w.stride(0), 0


@triton.jit
def _matmul_kernel(
    x_ptr, y_ptr, w_ptr, scale_ptr, zero_ptr,
    M, N, K, stride_x, stride_y, stride_w, stride_scale,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    outs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K),
                    other=0.0)
        w = load_weight_tile(w_ptr, scale_ptr, zero_ptr, outs, ks, (outs[:, None] < N) & (ks[None, :] < K),
                             stride_w, stride_scale, BITS, GROUP, HAS_ZEROS)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=PRECISION)
    tl.store(y_ptr + rows[:, None] * stride_y + outs[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (outs[None, :] < N))


def linear(x: torch.Tensor, w: torch.Tensor | QuantizedTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """As `kernels.quant.linear`: plain weights go to the vendor GEMM (already at the bandwidth
    roofline), quantized ones to the kernel that dequantizes in registers."""
    if isinstance(w, QuantizedTensor):
        return quantized_linear(x, w, bias)
    return F.linear(x, w, bias)


def quantized_linear(x: torch.Tensor, w: QuantizedTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) @ dequantize(w).T (+ bias) for a quantized (N, K) weight."""
    N, K = w.shape
    x2 = x.reshape(-1, K).contiguous()
    M = x2.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    block_m = 16 if M <= 16 else 64
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, 64))
    w_ptr, s_ptr, z_ptr, stride_w, stride_s, bits, group, has_zeros = weight_args(w)
    _matmul_kernel[grid](x2, y, w_ptr, s_ptr, z_ptr, M, N, K, x2.stride(0), y.stride(0), stride_w, stride_s,
                         bits, group, has_zeros, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=64,
                         PRECISION=dot_precision(x.dtype))
    if bias is not None:
        y += bias
    return y.reshape(*x.shape[:-1], N)
