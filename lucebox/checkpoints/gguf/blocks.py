"""llama.cpp's quantized blocks, repacked losslessly into `QuantizedTensor`s the kernels read.

A GGUF weight (..., N, K) is stored row by row, each row a run of fixed-size blocks along K. Each
block type becomes one of our layouts with the same arithmetic, so `dequantize` returns exactly the
float32 values llama.cpp (and the `gguf` package) compute, and the Triton kernels read the codes
without ever widening a whole weight:

    type   block  our layout                        value
    Q8_0   32     int8 codes, float16 scale / 32    code * d
    Q4_0   32     int4 codes, float16 scale / 32    (code - 8) * d
    Q4_K   256    int4 codes, float32 scale + min / 32   code * (d * sc) - dmin * m
    Q5_K   256    int8 codes 0..31, same as Q4_K    code * (d * sc) - dmin * m
    Q6_K   256    int8 codes -32..31, float32 scale / 16  code * (d * sc)

Q5_K and Q6_K spend a byte per code (their 5 and 6 bits do not split into nibbles), so they take
about 1.6x (Q5_K) and 1.3x (Q6_K) the memory of the file, still half of a 16-bit weight.
"""

from __future__ import annotations

import torch

from lucebox.kernels.quant import QuantizedTensor

SUPER_BLOCK = 256  # elements per K-quant block
# Bytes per block, elements per block.
BLOCK_SHAPES = {"Q8_0": (34, 32), "Q4_0": (18, 32), "Q4_K": (144, 256), "Q5_K": (176, 256), "Q6_K": (210, 256)}


def _half(raw: torch.Tensor) -> torch.Tensor:
    """Little-endian float16 from (..., 2) bytes, as float32."""
    return raw.contiguous().view(torch.float16)[..., 0].to(torch.float32)


def _nibbles(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return packed & 0xF, packed >> 4


def _pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 (..., K) into our packing: two per byte, even feature in the low nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit (scale, min) pairs of a Q4_K/Q5_K block from its 12 bytes (..., 12).

    Bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins 0-3 likewise; scales and mins
    4-7 keep their low 4 bits in the nibbles of bytes 8-11 and their top 2 bits in the spare top
    bits of bytes 0-3 (scales) and 4-7 (mins)."""
    first, second, rest = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = torch.cat((first & 63, (rest & 0xF) | ((first >> 6) << 4)), dim=-1)
    mins = torch.cat((second & 63, (rest >> 4) | ((second >> 6) << 4)), dim=-1)
    return scales, mins


def _q8_0(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    scale = _half(blocks[..., 0:2])
    codes = blocks[..., 2:].contiguous().view(torch.int8)
    return codes, scale.to(torch.float16), None, 8, 32


def _q4_0(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    scale = _half(blocks[..., 0:2])
    low, high = _nibbles(blocks[..., 2:])  # elements 0-15 low nibbles, 16-31 high nibbles
    codes = torch.cat((low, high), dim=-1)
    return _pack_int4(codes), scale.to(torch.float16), None, 4, 32


def _k_quant_sub_blocks(blocks: torch.Tensor, high_bits: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """Codes (..., 256) and float32 (scale, min) per 32-element sub-block (..., 8) of Q4_K / Q5_K."""
    d, dmin = _half(blocks[..., 0:2]), _half(blocks[..., 2:4])
    sc, m = _k_scales(blocks[..., 4:16])
    packed = blocks[..., -128:].reshape(*blocks.shape[:-1], 4, 32)  # 4 runs of 32 bytes
    low, high = _nibbles(packed)  # each run: sub-block 2r in low nibbles, 2r + 1 in high nibbles
    codes = torch.stack((low, high), dim=-2).reshape(*blocks.shape[:-1], 8, 32)
    if high_bits is not None:  # Q5_K: bit s of byte i is the fifth bit of element i of sub-block s
        shifts = torch.arange(8, dtype=torch.uint8, device=blocks.device)[:, None]
        codes = codes | (((high_bits[..., None, :] >> shifts) & 1) << 4)
    scale = d[..., None] * sc.to(torch.float32)  # exact in float32: 11 x 6 significant bits
    low_value = dmin[..., None] * m.to(torch.float32)
    return codes.reshape(*blocks.shape[:-1], SUPER_BLOCK), scale, low_value


def _q4_k(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    codes, scale, low_value = _k_quant_sub_blocks(blocks, None)
    return _pack_int4(codes), scale, low_value, 4, 32


def _q5_k(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    codes, scale, low_value = _k_quant_sub_blocks(blocks, blocks[..., 16:48])
    return codes.view(torch.int8), scale, low_value, 8, 32


def _q6_k(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    lead = blocks.shape[:-1]
    low4 = blocks[..., 0:128].reshape(*lead, 2, 64)  # per half of 128 elements
    top2 = blocks[..., 128:192].reshape(*lead, 2, 32)
    sub_scales = blocks[..., 192:208].contiguous().view(torch.int8)
    d = _half(blocks[..., 208:210])
    # In a half: elements 0-63 are the low nibbles of its 64 bytes, 64-127 the high nibbles; the top
    # two bits of element 32j + i (j = 0..3) are bits 2j, 2j + 1 of byte i of its 32.
    low = torch.cat(_nibbles(low4), dim=-1)  # (..., 2, 128)
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=blocks.device)[:, None]
    high = ((top2[..., None, :] >> shifts) & 3).reshape(*lead, 2, 128)
    codes = ((low | (high << 4)).to(torch.int16) - 32).to(torch.int8).reshape(*lead, SUPER_BLOCK)
    scale = d[..., None] * sub_scales.to(torch.float32)  # exact in float32: 11 x 8 significant bits
    return codes, scale, None, 8, 16


_UNPACKERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}


def unpack(raw: torch.Tensor, block_type: str, shape: tuple[int, ...], dtype: torch.dtype) -> QuantizedTensor:
    """The weight of logical `shape` (..., N, K) whose rows are the GGUF blocks `raw` (uint8,
    (..., N, bytes per row)), in `block_type`; `dtype` is the activations' dtype."""
    block_bytes, block_size = BLOCK_SHAPES[block_type]
    *lead, K = shape
    blocks = raw.reshape(*lead, K // block_size, block_bytes)
    codes, scale, low_value, bits, group = _UNPACKERS[block_type](blocks)
    per_row = (*lead, K // group)
    codes = codes.reshape(*lead, K // (2 if bits == 4 else 1)).contiguous()
    low_value = None if low_value is None else low_value.reshape(per_row).contiguous()
    return QuantizedTensor(codes, scale.reshape(per_row).contiguous(), None, bits, group, tuple(shape), dtype,
                           low_value)
