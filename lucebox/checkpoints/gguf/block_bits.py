"""Reading the packed fields of llama.cpp's blocks: float16 scales, nibbles, little-endian words,
bit fields; and our own int4 packing. Every tensor here is uint8 bytes (..., n) unless said."""

from __future__ import annotations

import torch


def half(raw: torch.Tensor) -> torch.Tensor:
    """Little-endian float16 from (..., 2) bytes, as float32."""
    return raw.contiguous().view(torch.float16)[..., 0].to(torch.float32)


def nibbles(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return packed & 0xF, packed >> 4


def low_then_high_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The codes of llama.cpp's 32-element blocks from their 16 bytes (..., 16): elements 0-15 in
    the low nibbles, 16-31 in the high ones (..., 32)."""
    return torch.cat(nibbles(packed), dim=-1)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 (..., K) into our packing: two per byte, even feature in the low nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


def little_endian(raw: torch.Tensor, width: int) -> torch.Tensor:
    """Unsigned little-endian integers of `width` bytes from (..., n * width) bytes, as int64 (..., n)."""
    parts = raw.reshape(*raw.shape[:-1], -1, width).to(torch.int64)
    return (parts << (8 * torch.arange(width, device=raw.device))).sum(-1)  # disjoint bits: a sum is an or


def bit_fields(values: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """The `count` fields of `width` bits of each integer in `values` (...), lowest first: (..., count)."""
    shifts = width * torch.arange(count, device=values.device, dtype=values.dtype)
    return (values[..., None] >> shifts) & ((1 << width) - 1)


def two_bit_codes(packed: torch.Tensor) -> torch.Tensor:
    """Q2_K's and Q3_K's 2-bit codes from their 64 bytes (..., 64) as (..., 256): in each half of
    128 elements, element 32j + i is bits 2j, 2j + 1 of byte i of the half's 32."""
    fields = bit_fields(packed.reshape(*packed.shape[:-1], 2, 32), 2, 4)  # (..., half, byte, field)
    return fields.transpose(-1, -2).reshape(*packed.shape[:-1], 256)
