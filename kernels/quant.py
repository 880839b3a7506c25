"""Weight-only quantization (int8, int4 with group scales), torch reference.

A weight (N, K) (or experts (E, N, K)) becomes integer codes plus float16 scales, one per `group`
consecutive input features of an output row:

    w[n, k] = (code[n, k] - zero[n, k // group]) * scale[n, k // group]

- int8: codes int8 in -127..127, zero 0 (symmetric);
- int4: codes 0..15 packed two per byte along K (even k in the low nibble), zero 8 when
  symmetric, or an integer zero point 0..15 per group (stored as float16) when asymmetric.

Weights read from GGUF files (`lucebox.checkpoints.gguf.blocks`) keep llama.cpp's arithmetic exactly instead:
their scales are float16 or float32 (a super-block scale times a small sub-scale, a product
float16 cannot hold), and types with a minimum (K-quants, Q4_1, Q5_1) subtract a float32
per-group minimum rather than a zero point:

    w[n, k] = code[n, k] * scale[n, k // group] - min[n, k // group]

with codes 0..15 (int4, no implicit zero), or any int8 value (Q5_K's 0..31, Q6_K's -32..31, the
IQ types' table values).

Activations stay in the model dtype; kernels dequantize a tile at a time, so a matmul reads
1 (int8) or 0.5 (int4) bytes per weight plus the scales.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

SCHEMES = ("int8", "int4")


@dataclass
class QuantizedTensor:
    """Quantized codes of a (..., N, K) weight; `shape` is the logical (dequantized) shape."""

    codes: torch.Tensor  # int8 (..., N, K) or uint8 (..., N, K/2) for int4
    scales: torch.Tensor  # float16 (..., N, K/group); float32 for GGUF weights
    zeros: torch.Tensor | None  # float16 (..., N, K/group), int4 asymmetric only
    bits: int
    group: int
    shape: tuple[int, ...]
    dtype: torch.dtype  # the activations' dtype, what dequantize returns
    mins: torch.Tensor | None = None  # float32 (..., N, K/group), GGUF K-quants; never with zeros
    # On the CPU: `dequantize(self)`, made once by `dense_on_cpu` (host memory the plan does not count)
    dense: torch.Tensor | None = field(default=None, repr=False, compare=False)

    def __getitem__(self, index: int) -> QuantizedTensor:
        """One expert of an (E, N, K) stack."""
        zeros = None if self.zeros is None else self.zeros[index]
        mins = None if self.mins is None else self.mins[index]
        return QuantizedTensor(self.codes[index], self.scales[index], zeros, self.bits, self.group,
                               self.shape[1:], self.dtype, mins)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def nbytes(self) -> int:
        parts = [self.codes, self.scales] + [t for t in (self.zeros, self.mins) if t is not None]
        return sum(t.numel() * t.element_size() for t in parts)


def default_group(K: int, scheme: str) -> int:
    """int8: the whole row; int4: 128 inputs, or the largest of 64 and 32 that divides K (a whole
    row for odd small widths)."""
    if scheme == "int8":
        return K
    return next((g for g in (128, 64, 32) if K % g == 0), K)


def quantized_bytes(shape: tuple[int, ...], scheme: str) -> int:
    """Bytes of codes and scales (symmetric) of a weight of this shape, before it is quantized."""
    n = 1
    for size in shape:
        n *= size
    return n // (1 if scheme == "int8" else 2) + n // default_group(shape[-1], scheme) * 2


def quantize(w: torch.Tensor, scheme: str, group: int | None = None, asymmetric: bool = False) -> QuantizedTensor:
    """Round-to-nearest quantization of w (..., N, K) in groups of `group` (`default_group`)."""
    if scheme not in SCHEMES:
        raise ValueError(f"quantization '{scheme}' is not one of {', '.join(SCHEMES)}")
    K = w.shape[-1]
    group = group or default_group(K, scheme)
    if K % group or (scheme == "int4" and group % 2):
        raise ValueError(f"a weight with {K} input features cannot be split into groups of {group}")
    if asymmetric and scheme != "int4":
        raise ValueError("asymmetric (zero point) quantization is int4 only")
    if w.dim() == 3 and w.shape[0] > 16:  # expert stacks: bound the float32 temporaries
        parts = [quantize(w[i : i + 16], scheme, group, asymmetric) for i in range(0, w.shape[0], 16)]
        zeros = torch.cat([p.zeros for p in parts]) if asymmetric else None
        return QuantizedTensor(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]), zeros,
                               parts[0].bits, group, tuple(w.shape), w.dtype)
    grouped = w.to(torch.float32).reshape(*w.shape[:-1], K // group, group)
    # Codes are computed with the float16 scales (and zero points) that are stored, scales
    # rounded up so the largest magnitude still fits the code range.
    if scheme == "int8":
        scale = _stored(grouped.abs().amax(-1) / 127)
        codes = torch.round(grouped / scale[..., None]).clamp(-127, 127).to(torch.int8)
        zeros = None
    elif asymmetric:  # an integer zero point: the range [min(low, 0), max(high, 0)] spans codes 0..15
        low, high = grouped.amin(-1).clamp_max(0), grouped.amax(-1).clamp_min(0)
        scale = _stored((high - low) / 15)
        zeros = torch.round(-low / scale).clamp(0, 15)
        codes = torch.round(grouped / scale[..., None] + zeros[..., None]).clamp(0, 15).to(torch.uint8)
        zeros = zeros.to(torch.float16)  # small integers: exact in float16
    else:
        scale = _stored(grouped.abs().amax(-1) / 7)
        codes = (torch.round(grouped / scale[..., None]).clamp(-7, 7) + 8).to(torch.uint8)
        zeros = None
    codes = codes.reshape(w.shape)
    if scheme == "int4":
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    bits = 8 if scheme == "int8" else 4
    return QuantizedTensor(codes.contiguous(), scale.to(torch.float16).contiguous(), zeros, bits, group,
                           tuple(w.shape), w.dtype)


def _stored(scale: torch.Tensor) -> torch.Tensor:
    """The float16 value a scale is stored as, in float32: rounded up (never below the exact one,
    to a relative 2**-10) and at least float16's smallest subnormal, so no scale is 0."""
    return (scale * (1 + 2**-10)).clamp_min(2**-24).to(torch.float16).float()


def dequantize(q: QuantizedTensor) -> torch.Tensor:
    if q.bits == 8:
        codes = q.codes.to(torch.float32)
    else:
        codes = torch.stack((q.codes & 0xF, q.codes >> 4), dim=-1).reshape(q.shape).to(torch.float32)
    grouped = codes.reshape(*q.shape[:-1], -1, q.group)
    if q.mins is not None:  # code * scale - min, in this order: llama.cpp's own float32 rounding
        scaled = grouped * q.scales.to(torch.float32)[..., None] - q.mins[..., None]
        return scaled.reshape(q.shape).to(q.dtype)
    zero = q.zeros.to(torch.float32) if q.zeros is not None else (8.0 if q.bits == 4 else 0.0)
    if isinstance(zero, torch.Tensor):
        grouped = grouped - zero[..., None]
    else:
        grouped = grouped - zero
    return (grouped * q.scales.to(torch.float32)[..., None]).reshape(q.shape).to(q.dtype)


Weight = torch.Tensor | QuantizedTensor


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ bias) for a plain or quantized weight."""
    return F.linear(x, dense_on_cpu(w) if isinstance(w, QuantizedTensor) else w, bias)


def dense_on_cpu(w: QuantizedTensor) -> torch.Tensor:
    """`dequantize(w)`, made once and kept where `kept_dense` keeps it."""
    kept = kept_dense(w)
    return dequantize(w) if kept is None else kept


def kept_dense(w: QuantizedTensor) -> torch.Tensor | None:
    """`dequantize(w)`, made once and kept in `w.dense`, for a weight on the CPU (else None). On a
    GPU the Triton kernels read the codes; on the CPU this reference rebuilt every weight at every
    step, most of a quantized model's decode time (a Q4_K_M file decoded at a sixth of its F32
    twin's speed). The values are the same, so the logits are too; the cost is host memory (4 bytes
    a weight in float32), so a weight is kept only while it fits in half of the free host memory."""
    if w.dense is None and w.device.type == "cpu":
        if math.prod(w.shape) * w.dtype.itemsize <= _free_host_bytes() // 2:
            w.dense = dequantize(w)
    return w.dense


def kept_dense_bytes(weights) -> int:
    """Bytes of the dense copies `kept_dense` holds now among `weights` (what the memory plan counts
    as `dense_copies_cpu_max`)."""
    return sum(w.dense.numel() * w.dense.element_size() for w in weights
               if isinstance(w, QuantizedTensor) and w.dense is not None)


def _free_host_bytes() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not Linux: keep nothing
        return 0
