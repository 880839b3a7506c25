"""llama.cpp's quantized blocks, repacked losslessly into `QuantizedTensor`s the kernels read.

A GGUF weight (..., N, K) is stored row by row, each row a run of fixed-size blocks along K. Each
block type becomes one of our layouts with the same arithmetic, value = code * scale - low_value
(int4 codes without a low value keep the implicit zero 8), so `dequantize` returns exactly the
float32 values llama.cpp (and the `gguf` package) compute, and the Triton kernels read the codes
without ever widening a whole weight:

    type     block  our layout                                     value
    Q8_0     32     int8 codes, float16 scale / 32                  code * d
    Q4_0     32     int4 codes, float16 scale / 32                  (code - 8) * d
    Q4_1     32     int4 codes, float16 scale, low value -m / 32    code * d + m
    Q5_0     32     int8 codes -16..15, float16 scale / 32          code * d
    Q5_1     32     int8 codes 0..31, as Q4_1                       code * d + m
    K-quants 256    `k_quants`: Q2_K, Q3_K (int4, group 16), Q4_K (int4), Q5_K, Q6_K (int8)
    others          `i_quants`: IQ4_NL, IQ4_XS, MXFP4 and the IQ2/IQ3 lattices (int8 table values)

Types whose codes need 5 or more bits, or stand for table values, spend a byte per code (their
bits do not split into nibbles), so they take more memory than the file (Q5_K about 1.8x, Q2_K
with float32 scales and mins for every 16 codes 3x, IQ2_XXS 4.4x), still at most 1.25 bytes a
weight (`repacked_bytes`). Every scale is the file's float16 or a float16 times a small integer
(exact in float32); Q4_1's and Q5_1's m is stored negated, which changes no rounding.
"""

from __future__ import annotations

from functools import lru_cache

import gguf
import torch

from lucebox.checkpoints.gguf.block_bits import bit_fields, half, little_endian, low_then_high_nibbles, pack_int4
from lucebox.checkpoints.gguf.i_quants import I_QUANTS
from lucebox.checkpoints.gguf.k_quants import K_QUANTS
from lucebox.kernels.quant import QuantizedTensor


def _q8_0(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    codes = blocks[..., 2:].contiguous().view(torch.int8)
    return codes, half(blocks[..., 0:2]).to(torch.float16), None, 8, 32


def _q4_0(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    codes = low_then_high_nibbles(blocks[..., 2:])
    return pack_int4(codes), half(blocks[..., 0:2]).to(torch.float16), None, 4, 32


def _q4_1(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    d, m = half(blocks[..., 0:2]), half(blocks[..., 2:4])
    return pack_int4(low_then_high_nibbles(blocks[..., 4:])), d.to(torch.float16), -m, 4, 32


def _five_bit_codes(blocks: torch.Tensor) -> torch.Tensor:
    """Codes 0..31 of Q5_0/Q5_1 from their last 20 bytes: a 32-bit word holding each element's
    fifth bit (bit i for element i), then the low 4 bits as in Q4_0."""
    high = bit_fields(little_endian(blocks[..., -20:-16], 4)[..., 0], 1, 32).to(torch.uint8)
    return low_then_high_nibbles(blocks[..., -16:]) | (high << 4)


def _q5_0(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    codes = (_five_bit_codes(blocks).to(torch.int16) - 16).to(torch.int8)
    return codes, half(blocks[..., 0:2]).to(torch.float16), None, 8, 32


def _q5_1(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    d, m = half(blocks[..., 0:2]), half(blocks[..., 2:4])
    return _five_bit_codes(blocks).view(torch.int8), d.to(torch.float16), -m, 8, 32


_UNPACKERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, **K_QUANTS, **I_QUANTS}
# Bytes per block, elements per block, as the gguf package lists them.
BLOCK_SHAPES = {name: gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]][::-1] for name in _UNPACKERS}


def unpack(raw: torch.Tensor, block_type: str, shape: tuple[int, ...], dtype: torch.dtype) -> QuantizedTensor:
    """The weight of logical `shape` (..., N, K) whose rows are the GGUF blocks `raw` (uint8,
    (..., N, bytes per row)), in `block_type`; `dtype` is the activations' dtype."""
    block_bytes, block_size = BLOCK_SHAPES[block_type]
    *lead, K = shape
    blocks = raw.reshape(*lead, K // block_size, block_bytes)
    codes, scale, low_value, bits, group = _UNPACKERS[block_type](blocks)
    per_row = (*lead, K // group)
    codes = codes.reshape(*lead, K // (2 if bits == 4 else 1)).contiguous()
    low_value = None if low_value is None else low_value.to(torch.float32).reshape(per_row).contiguous()
    return QuantizedTensor(codes, scale.reshape(per_row).contiguous(), None, bits, group, tuple(shape), dtype,
                           low_value)


@lru_cache
def repacked_bytes(block_type: str) -> float:
    """Bytes per weight once repacked (codes, scales, low values): those of one block of zeros."""
    block_bytes, block_size = BLOCK_SHAPES[block_type]
    one = unpack(torch.zeros(1, block_bytes, dtype=torch.uint8), block_type, (1, block_size), torch.float32)
    return one.nbytes() / block_size
