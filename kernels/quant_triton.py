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
from lucebox.kernels.gemv_triton import GEMV_ROWS, gemv, streams
from lucebox.kernels.quant import QuantizedTensor, Weight, dequantize


@triton.jit
def load_weight_tile(
    w_ptr, scale_ptr, offset_ptr,  # one matrix's base pointers (an expert's, for stacks)
    rows, cols, mask,  # rows (R,) output features, cols (C,) input features, mask (R, C)
    stride_row, stride_scale_row,
    BITS: tl.constexpr, GROUP: tl.constexpr, OFFSET: tl.constexpr,
):
    """Tile (R, C) of the weight in float32. BITS 0: a plain (unquantized) weight; 8: int8 codes;
    4: two codes per byte along the input features (even feature in the low nibble). OFFSET (see
    `OFFSET_KINDS`) 0: (code - implicit zero) * scale; 1: (code - zero[group]) * scale; 2: code *
    scale - min[group] (GGUF K-quants; codes have no implicit zero)."""
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
    if OFFSET == 2:
        low = tl.load(offset_ptr + group_offsets, mask=mask, other=0.0).to(tl.float32)
        return codes * scale - low
    if OFFSET == 1:
        zero = tl.load(offset_ptr + group_offsets, mask=mask, other=0.0).to(tl.float32)
    return (codes - zero) * scale


# How a quantized weight's codes are offset (the OFFSET argument of `load_weight_tile`).
OFFSET_KINDS = {"none": 0, "zero_points": 1, "mins": 2}


def offset_kind(w: QuantizedTensor) -> tuple[torch.Tensor | None, int]:
    """(the tensor the kernel reads the per-group offsets from, OFFSET) of a quantized weight."""
    if w.mins is not None:
        return w.mins, OFFSET_KINDS["mins"]
    if w.zeros is not None:
        return w.zeros, OFFSET_KINDS["zero_points"]
    return None, OFFSET_KINDS["none"]


def dot_precision(dtype: torch.dtype) -> str:
    """`tl.dot`'s input precision: float32 models multiply in full float32 (not TF32), so they stay
    comparable to the reference; for 16-bit inputs the setting has no effect ("tf32" is Triton's
    default)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def weight_args(w: torch.Tensor | QuantizedTensor) -> tuple:
    """(w_ptr, scale_ptr, offset_ptr, stride_row, stride_scale_row, BITS, GROUP, OFFSET) of a
    matrix or a stack of matrices (strides of one matrix's rows). Offsets (zero points or mins)
    are laid out like the scales, so they share the scales' strides."""
    if isinstance(w, QuantizedTensor):
        offsets, kind = offset_kind(w)
        if offsets is not None and offsets.stride() != w.scales.stride():
            raise ValueError("a quantized weight's zero points or mins must be laid out like its scales")
        offsets = offsets if offsets is not None else w.scales  # a valid pointer that is never read
        return (w.codes, w.scales, offsets, w.codes.stride(-2), w.scales.stride(-2), w.bits, w.group, kind)
    if w.stride(-1) != 1:
        raise ValueError("weights must be contiguous along their input features")
    return (w, w, w, w.stride(-2), 0, 0, 1, OFFSET_KINDS["none"])


def expert_strides(w: torch.Tensor | QuantizedTensor) -> tuple[int, int]:
    """(elements between experts in the codes/weight, in the scales) of an (E, N, K) stack."""
    if isinstance(w, QuantizedTensor):
        return w.codes.stride(0), w.scales.stride(0)
    return w.stride(0), 0


@triton.jit
def _matmul_kernel(
    x_ptr, y_ptr, w_ptr, scale_ptr, offset_ptr,
    M, N, K, stride_x, stride_y, stride_w, stride_scale,
    BITS: tl.constexpr, GROUP: tl.constexpr, OFFSET: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    """y (M, N) = x @ dequantize(w).T for prefill rows (tensor-core tiles)."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    outs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=(rows[:, None] < M) & (ks[None, :] < K),
                    other=0.0)
        w = load_weight_tile(w_ptr, scale_ptr, offset_ptr, outs, ks, (outs[:, None] < N) & (ks[None, :] < K),
                             stride_w, stride_scale, BITS, GROUP, OFFSET)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=PRECISION)
    tl.store(y_ptr + rows[:, None] * stride_y + outs[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (outs[None, :] < N))


def linear(x: torch.Tensor, w: torch.Tensor | QuantizedTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """As `kernels.quant.linear`: plain weights go to the vendor GEMM (already at the bandwidth
    roofline), quantized ones to the kernel that dequantizes in registers."""
    if isinstance(w, QuantizedTensor):
        return quantized_linear(x, w, bias)
    return F.linear(x, w, bias)


def streamed(w: Weight, K: int) -> Weight:
    """w as the streaming decode kernels take it: as stored, or dequantized for the step where they
    cannot read its codes (`gemv_triton.streams`: int4 rows or groups of part words, never a released
    model's shapes). Slow, but a row keeps the bits of a one-row step whatever the step's rows, which
    greedy speculation needs and the tile kernels do not promise."""
    if isinstance(w, QuantizedTensor) and not streams(weight_args(w), K):
        return dequantize(w)
    return w


def quantized_linear(x: torch.Tensor, w: QuantizedTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) @ dequantize(w).T (+ bias) for a quantized (N, K) weight. Decode and verify
    steps (at most `GEMV_ROWS` rows) take the streaming GEMV, one launch (`streamed`); wider ones
    tl.dot tiles."""
    N, K = w.shape
    x2 = x.reshape(-1, K).contiguous()
    M = x2.shape[0]
    if M <= GEMV_ROWS:
        return gemv(x2, weight_args(streamed(w, K)), N, bias).reshape(*x.shape[:-1], N)
    block_m, block_n, block_k = 64, 64, 64
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    w_ptr, s_ptr, z_ptr, stride_w, stride_s, bits, group, offset = weight_args(w)
    _matmul_kernel[(triton.cdiv(M, block_m), triton.cdiv(N, block_n))](
        x2, y, w_ptr, s_ptr, z_ptr, M, N, K, x2.stride(0), y.stride(0), stride_w, stride_s, bits, group, offset,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=dot_precision(x.dtype))
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], N)
