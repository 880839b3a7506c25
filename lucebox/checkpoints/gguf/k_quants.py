"""llama.cpp's K-quants (256-element super-blocks with 6- or 8-bit sub-block scales), repacked.

Each unpacker takes blocks (..., bytes) and returns (codes, scale, low_value, bits, group) as
`blocks.unpack` expects: value = code * scale - low_value (int4 codes without a low value keep
the implicit zero 8). Every scale we form is a float16 super-block scale (11 significant bits)
times a small integer, a product float32 holds exactly, so it equals the one llama.cpp forms and
the value's one rounding (code * scale, then - low_value) is llama.cpp's own.
"""

from __future__ import annotations

import torch

from lucebox.checkpoints.gguf.block_bits import bit_fields, half, nibbles, pack_int4, two_bit_codes

SUPER_BLOCK = 256  # elements per K-quant block


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit (scale, min) pairs of a Q4_K/Q5_K block from its 12 bytes (..., 12).

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3 likewise; scales and mins
    4-7 keep their low 4 bits in the nibbles of bytes 8-11 and their top 2 bits in the spare top
    bits of bytes 0-3 (scales) and 4-7 (mins)."""
    first, second, rest = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = torch.cat((first & 63, (rest & 0xF) | ((first >> 6) << 4)), dim=-1)
    mins = torch.cat((second & 63, (rest >> 4) | ((second >> 6) << 4)), dim=-1)
    return scales, mins


def q2_k(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """16 sub-blocks of 16: a byte each of 4-bit scale (low nibble) and 4-bit min (high), then
    2-bit codes 0..3, then d and dmin: int4 codes, value = code * (d * sc) - dmin * m."""
    sub = blocks[..., 0:16]
    d, dmin = half(blocks[..., 80:82]), half(blocks[..., 82:84])
    scale = d[..., None] * (sub & 0xF).to(torch.float32)  # exact in float32: 11 x 4 significant bits
    low_value = dmin[..., None] * (sub >> 4).to(torch.float32)
    return pack_int4(two_bit_codes(blocks[..., 16:80])), scale, low_value, 4, 16


def q3_k(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Codes -4..3 (2 low bits, and a high-bit mask where a set bit means no -4) times d * sc with
    16 signed 6-bit sub-block scales: int4 codes + 8 with the implicit zero 8, group 16."""
    lead = blocks.shape[:-1]
    hmask, packed_scales, d = blocks[..., 0:32], blocks[..., 96:108], half(blocks[..., 108:110])
    # element 32j + i has its high bit in bit j of mask byte i
    high = bit_fields(hmask, 1, 8).transpose(-1, -2).reshape(*lead, SUPER_BLOCK)
    codes = (two_bit_codes(blocks[..., 32:96]) | (high << 2)) + 4  # code - 8 = low + 4 * high - 4
    # scales 0-7 in the low nibbles of bytes 0-7, 8-15 in the high ones; scale 4j + b has its top
    # two bits in bits 2j, 2j + 1 of byte 8 + b
    low4 = torch.cat(nibbles(packed_scales[..., 0:8]), dim=-1)
    top2 = bit_fields(packed_scales[..., 8:12], 2, 4).transpose(-1, -2).reshape(*lead, 16)
    sc = (low4 | (top2 << 4)).to(torch.float32) - 32
    scale = d[..., None] * sc  # exact in float32: 11 x 6 significant bits
    return pack_int4(codes), scale, None, 4, 16


def _q4_q5_sub_blocks(blocks: torch.Tensor, high_bits: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """Codes (..., 256) and float32 (scale, min) per 32-element sub-block (..., 8) of Q4_K / Q5_K."""
    d, dmin = half(blocks[..., 0:2]), half(blocks[..., 2:4])
    sc, m = _k_scales(blocks[..., 4:16])
    packed = blocks[..., -128:].reshape(*blocks.shape[:-1], 4, 32)  # 4 runs of 32 bytes
    low, high = nibbles(packed)  # each run: sub-block 2r in low nibbles, 2r + 1 in high nibbles
    codes = torch.stack((low, high), dim=-2).reshape(*blocks.shape[:-1], 8, 32)
    if high_bits is not None:  # Q5_K: bit s of byte i is the fifth bit of element i of sub-block s
        codes = codes | (bit_fields(high_bits, 1, 8).transpose(-1, -2) << 4)
    scale = d[..., None] * sc.to(torch.float32)  # exact in float32: 11 x 6 significant bits
    low_value = dmin[..., None] * m.to(torch.float32)
    return codes.reshape(*blocks.shape[:-1], SUPER_BLOCK), scale, low_value


def q4_k(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    codes, scale, low_value = _q4_q5_sub_blocks(blocks, None)
    return pack_int4(codes), scale, low_value, 4, 32


def q5_k(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    codes, scale, low_value = _q4_q5_sub_blocks(blocks, blocks[..., 16:48])
    return codes.view(torch.int8), scale, low_value, 8, 32


def q6_k(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    lead = blocks.shape[:-1]
    low4 = blocks[..., 0:128].reshape(*lead, 2, 64)  # per half of 128 elements
    top2 = blocks[..., 128:192].reshape(*lead, 2, 32)
    sub_scales = blocks[..., 192:208].contiguous().view(torch.int8)
    d = half(blocks[..., 208:210])
    # In a half: elements 0-63 are the low nibbles of its 64 bytes, 64-127 the high nibbles; the top
    # two bits of element 32j + i (j = 0..3) are bits 2j, 2j + 1 of byte i of its 32.
    low = torch.cat(nibbles(low4), dim=-1)  # (..., 2, 128)
    high = bit_fields(top2, 2, 4).transpose(-1, -2).reshape(*lead, 2, 128)
    codes = ((low | (high << 4)).to(torch.int16) - 32).to(torch.int8).reshape(*lead, SUPER_BLOCK)
    scale = d[..., None] * sub_scales.to(torch.float32)  # exact in float32: 11 x 8 significant bits
    return codes, scale, None, 8, 16


K_QUANTS = {"Q2_K": q2_k, "Q3_K": q3_k, "Q4_K": q4_k, "Q5_K": q5_k, "Q6_K": q6_k}
