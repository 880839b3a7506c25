"""int8 K/V rows (`kv_dtype="int8"`) for the paged pool and its host chunks.

Each (token, KV head) row of D values is stored as int8 codes and one float32 scale: its largest
magnitude / 127, so the row's largest value is exact and every other value is off by at most
half a step, max|row| / 254 (plus, in bfloat16 or float16, the rounding of the dequantized
value to the model dtype that attention computes in). Rows are quantized once, when a step stores them, and attention
dequantizes a tile at a time; the host copies hold the same codes, so a chunk leaving the pool
and coming back is unchanged. Sliding rings keep the model dtype: they are small and bounded.
"""

from __future__ import annotations

import torch

STEPS = 127


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int8 (..., D), scales float32 (...)) of rows x (..., D)."""
    work = torch.promote_types(x.dtype, torch.float32)
    scales = x.to(work).abs().amax(-1).to(torch.float32) / STEPS
    # A row of zeros gets scale 0 and codes 0: dividing by the clamped scale keeps it finite.
    codes = torch.round(x.to(work) / scales.clamp_min(torch.finfo(torch.float32).tiny).to(work)[..., None])
    # A row holding inf or NaN gets an inf or NaN scale, so it dequantizes to NaN, as the float row
    # would poison attention (tests/test_kv_int8.py), never to plausible finite keys.
    return codes.clamp(-STEPS, STEPS).to(torch.int8), scales


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows (..., D) in `dtype`, computed in at least float32 (as the attention kernels do)."""
    work = torch.promote_types(dtype, torch.float32)
    return (codes.to(work) * scales.to(work)[..., None]).to(dtype)
