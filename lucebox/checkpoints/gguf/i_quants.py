"""llama.cpp's non-linear types, repacked as int8 codes: the table value each code stands for.

    IQ4_NL  32   d fp16, 4-bit indices into a 16-value table (-127..113)     table[i] * d
    IQ4_XS  256  the same table, 8 sub-blocks of 32 with 6-bit signed scales  table[i] * (d * sc)
    MXFP4   32   a power-of-two scale (E8M0), FP4 values (doubled: -12..12)  table[i] * 2^(e - 128)
    IQ2_XXS 256  8-value lattice points (8, 25, 43) with sign patterns,       grid * sign * db
    IQ2_XS       sub-block scales db = d * (0.5 + s) / 4 (IQ3_XXS: / 2,
    IQ2_S        IQ3_S: d * (1 + 2s)); IQ3_* lattices hold 4-value points
    IQ3_XXS      (4..62 and 1..15)
    IQ3_S

The tables are the `gguf` package's own (its lattices, sign patterns and value tables), read at
run time. Every scale we form is float16 d (11 significant bits) times at most 6 more, and every
table value has at most 7, so both the scale and value = code * scale are exact in float32: the
very numbers llama.cpp computes, whatever the order of its multiplications.
"""

from __future__ import annotations

from functools import lru_cache

import gguf
import numpy as np
import torch

from lucebox.checkpoints.gguf.block_bits import bit_fields, half, little_endian, low_then_high_nibbles


@lru_cache
def _table(name: str, device: torch.device) -> torch.Tensor:
    """The int8 values of a gguf type's 16-entry table (`kvalues`), or of its lattice (entries, width)."""
    kind = getattr(gguf.quants, name)
    if name in ("IQ4_NL", "MXFP4"):
        return torch.tensor(kind.kvalues, dtype=torch.int8, device=device)
    kind.init_grid()
    grid = np.asarray(kind.grid).reshape(kind.grid_shape)
    return torch.from_numpy(grid.astype(np.int8)).to(device)


@lru_cache
def _sign_patterns(device: torch.device) -> torch.Tensor:
    """±1 (128, 8): the 8 signs each 7-bit sign index stands for (bit j set: element j negative)."""
    ksigns = torch.from_numpy(np.frombuffer(gguf.quants.IQ2_XXS.ksigns, dtype=np.uint8).copy()).to(device)
    return _signs(bit_fields(ksigns, 1, 8))


def _signs(bits: torch.Tensor) -> torch.Tensor:
    return (1 - 2 * bits.to(torch.int8)).to(torch.int8)


def _lattice_codes(name: str, index: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """int8 codes (..., 256): the lattice points `index` (..., points) names, signed element-wise
    by `signs` (any shape holding the 256 in order)."""
    lead = index.shape[:-1]
    points = _table(name, index.device)[index.long()].reshape(*lead, 256)
    return points * signs.reshape(*lead, 256)


def iq4_nl(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    codes = _table("IQ4_NL", blocks.device)[low_then_high_nibbles(blocks[..., 2:18]).long()]
    return codes, half(blocks[..., 0:2]).to(torch.float16), None, 8, 32  # the file's own float16 d


def iq4_xs(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """d, 2 high bits of each sub-block scale in a 16-bit word, 4 low bits in nibbles (sub-block
    2b low, 2b + 1 high), then 8 runs of 16 bytes (32 indices each, low nibbles first)."""
    lead = blocks.shape[:-1]
    d = half(blocks[..., 0:2])
    top2 = bit_fields(little_endian(blocks[..., 2:4], 2)[..., 0], 2, 8)
    low4 = bit_fields(blocks[..., 4:8], 4, 2).reshape(*lead, 8)
    scale = d[..., None] * ((low4.to(torch.int64) | (top2 << 4)) - 32).to(torch.float32)  # exact: 11 x 6 bits
    index = low_then_high_nibbles(blocks[..., 8:136].reshape(*lead, 8, 16)).reshape(*lead, 256)
    return _table("IQ4_NL", blocks.device)[index.long()], scale, None, 8, 32


def mxfp4(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """An E8M0 exponent e, then FP4 codes (low nibbles first); values doubled, so the scale is
    2^(e - 128), built from its bits as llama.cpp does (a subnormal for e < 2)."""
    e = blocks[..., 0].to(torch.int32)
    bits = torch.where(e < 2, torch.bitwise_left_shift(torch.full_like(e, 0x00200000), e), (e - 1) << 23)
    scale = bits.view(torch.float32)[..., None]
    codes = _table("MXFP4", blocks.device)[low_then_high_nibbles(blocks[..., 1:17]).long()]
    return codes, scale, None, 8, 32


def _db(d: torch.Tensor, sub: torch.Tensor, divisor: float) -> torch.Tensor:
    """IQ2/IQ3_XXS sub-block scales d * (0.5 + sub) / divisor: 11 x 5 bits, then a power of two."""
    return d[..., None] * (0.5 + sub.to(torch.float32)) * (1 / divisor)


def iq2_xxs(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """8 sub-blocks of 32, each two 32-bit words: 4 lattice indices (bytes), then 4 7-bit sign
    indices and a 4-bit scale on top."""
    lead = blocks.shape[:-1]
    index = blocks[..., 2:66].reshape(*lead, 8, 8)[..., 0:4]
    words = little_endian(blocks[..., 2:66], 4).reshape(*lead, 8, 2)[..., 1]
    signs = _sign_patterns(blocks.device)[bit_fields(words, 7, 4)]
    codes = _lattice_codes("IQ2_XXS", index.reshape(*lead, 32), signs)
    return codes, _db(half(blocks[..., 0:2]), words >> 28, 4), None, 8, 32


def iq2_xs(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """32 16-bit words (a 9-bit lattice index, a 7-bit sign index), then 16 4-bit scales."""
    lead = blocks.shape[:-1]
    words = little_endian(blocks[..., 2:66], 2)
    codes = _lattice_codes("IQ2_XS", words & 511, _sign_patterns(blocks.device)[words >> 9])
    sub = bit_fields(blocks[..., 66:74], 4, 2).reshape(*lead, 16)
    return codes, _db(half(blocks[..., 0:2]), sub, 4), None, 8, 16


def iq2_s(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """32 low index bytes, 32 bytes of plain sign bits, the indices' 2 high bits (4 a byte), then
    16 4-bit scales; 1024 lattice points."""
    lead = blocks.shape[:-1]
    high = bit_fields(blocks[..., 66:74], 2, 4).reshape(*lead, 32).to(torch.int64)
    index = blocks[..., 2:34].to(torch.int64) | (high << 8)
    codes = _lattice_codes("IQ2_S", index, _signs(bit_fields(blocks[..., 34:66], 1, 8)))
    sub = bit_fields(blocks[..., 74:82], 4, 2).reshape(*lead, 16)
    return codes, _db(half(blocks[..., 0:2]), sub, 4), None, 8, 16


def iq3_xxs(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """64 lattice index bytes (4 elements each), then per sub-block of 32 a 32-bit word of 4 sign
    indices and a 4-bit scale."""
    words = little_endian(blocks[..., 66:98], 4)
    signs = _sign_patterns(blocks.device)[bit_fields(words, 7, 4)]
    codes = _lattice_codes("IQ3_XXS", blocks[..., 2:66], signs)
    return codes, _db(half(blocks[..., 0:2]), words >> 28, 2), None, 8, 32


def iq3_s(blocks: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """64 low index bytes, their high bits (8 a byte), 32 bytes of plain sign bits, then 8 4-bit
    scales: db = d * (1 + 2 * s), exact in float32 (11 x 5 bits)."""
    lead = blocks.shape[:-1]
    high = bit_fields(blocks[..., 66:74], 1, 8).reshape(*lead, 64).to(torch.int64)
    index = blocks[..., 2:66].to(torch.int64) | (high << 8)
    codes = _lattice_codes("IQ3_S", index, _signs(bit_fields(blocks[..., 74:106], 1, 8)))
    sub = bit_fields(blocks[..., 106:110], 4, 2).reshape(*lead, 8)
    scale = half(blocks[..., 0:2])[..., None] * (1 + 2 * sub.to(torch.float32))
    return codes, scale, None, 8, 32


I_QUANTS = {"IQ4_NL": iq4_nl, "IQ4_XS": iq4_xs, "MXFP4": mxfp4, "IQ2_XXS": iq2_xxs, "IQ2_XS": iq2_xs,
            "IQ2_S": iq2_s, "IQ3_XXS": iq3_xxs, "IQ3_S": iq3_s}
