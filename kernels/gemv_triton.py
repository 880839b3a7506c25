"""Quantized GEMV for decode and verify steps (at most `GEMV_ROWS` rows), one launch per matmul:
y (M, N) = x (M, K) @ dequantize(w).T (+ bias), cast to x's dtype in the kernel.

One path for every row count, on the tensor cores: each program owns BLOCK_N outputs and streams
their whole K once, dequantizing each weight tile in registers to x's dtype (`dequantized_tile`)
and multiplying it with `tl.dot`. The rows are always padded to `DOT_ROWS`, the MMA tile's 16, and
K is walked in one fixed order, so a row's bits never depend on how many rows share its step nor
on what they hold: greedy speculation and batched requests keep plain decoding's results. The
dequantization costs the same at 1 and at 16 rows (it is per weight, not per row), so a 16-row
verify step issues about the instructions of a one-row step.

`dequantized_tile`, `load_input_tile` and `dot_tile` are the tile steps; the MoE decode kernels use
them too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lucebox.limits import DECODE_ROWS

# The most rows a step may have to take the GEMV; wider steps take the prefill tiles.
GEMV_ROWS = DECODE_ROWS
# Rows of every decode tile: the MMA's 16 (and tl.dot's least), whatever the step's rows.
DOT_ROWS = 16
# One tile holds a whole step: a wider one would leave rows past DOT_ROWS unwritten (here and in the
# MoE decode kernels), so widening the engine's steps must widen the tile too.
assert GEMV_ROWS <= DOT_ROWS, f"DECODE_ROWS {DECODE_ROWS} is more than a decode tile's {DOT_ROWS} rows"

# A float32 whose bits are 0x4B000000 | c is 2**23 + c for c < 2**23: an integer code becomes a float
# by one OR (or AND) and one subtraction (exact), without the slow int-to-float conversion.
MAGIC_BITS = tl.constexpr(0x4B000000)
MAGIC = tl.constexpr(8388608.0)


@triton.jit
def load_input_tile(x_ptr, rows, stride_x, k0, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """x[rows, k0:k0 + BLOCK_K] in x's dtype; `rows` must be in range (callers clamp them), inputs
    past K read as 0."""
    ks = k0 + tl.arange(0, BLOCK_K)
    ptrs = x_ptr + rows[:, None] * stride_x + ks[None, :]
    if EVEN_K:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=ks[None, :] < K, other=0.0)
    return x


@triton.jit
def dot_tile(x, w, acc):
    """acc + x (DOT_ROWS, BLOCK_K) @ w (BLOCK_N, BLOCK_K).T on the tensor cores; float32 models in
    full float32 (not TF32), comparable to the reference."""
    if x.dtype == tl.float32:
        acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
    else:
        acc = tl.dot(x, tl.trans(w), acc)
    return acc


@triton.jit
def _group_values(ptr, outs, stride_scale, k0, K, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                  WIDTH: tl.constexpr, PACK: tl.constexpr, TILE_GROUPS: tl.constexpr, EVEN_K: tl.constexpr):
    """Per-group values (scales, zero points or mins) of a tile's (BLOCK_N, WIDTH) words (or
    elements): loaded once per group when the tile holds whole groups or lies inside one
    (TILE_GROUPS of them, (BLOCK_N, TILE_GROUPS) float32, spread later by `_spread`), else once per
    word (TILE_GROUPS 0: groups that neither divide nor hold a tile; never in released models)."""
    if TILE_GROUPS == 0:
        g = (k0 + PACK * tl.arange(0, WIDTH)) // GROUP
    else:
        g = k0 // GROUP + tl.arange(0, TILE_GROUPS)
    ptrs = ptr + outs[:, None] * stride_scale + g[None, :]
    if EVEN_K:
        values = tl.load(ptrs).to(tl.float32)
    else:
        values = tl.load(ptrs, mask=(g * GROUP < K)[None, :], other=0.0).to(tl.float32)
    return values


@triton.jit
def _spread(values, BLOCK_N: tl.constexpr, WIDTH: tl.constexpr, TILE_GROUPS: tl.constexpr):
    """`_group_values` repeated over each group's words: (BLOCK_N, WIDTH)."""
    if TILE_GROUPS == 0:
        spread = values
    else:
        SPAN: tl.constexpr = WIDTH // TILE_GROUPS
        spread = tl.reshape(tl.broadcast_to(values[:, :, None], (BLOCK_N, TILE_GROUPS, SPAN)), (BLOCK_N, WIDTH))
    return spread


@triton.jit
def _dequantize(codes, scale, offset, OFFSET: tl.constexpr):
    """int8 codes (float32) times their scales, less their offsets (see `quant_triton.OFFSET_KINDS`).
    (Every branch assigns one result: the compiler traces on past a `return` inside a constexpr if.)"""
    if OFFSET == 2:
        w = codes * scale - offset
    elif OFFSET == 1:
        w = (codes - offset) * scale
    else:
        w = codes * scale
    return w


@triton.jit
def _nibble(half, scale, offset, SHIFT: tl.constexpr, OFFSET: tl.constexpr, BLOCK_N: tl.constexpr,
            WIDTH: tl.constexpr, TILE_GROUPS: tl.constexpr, DTYPE: tl.constexpr):
    """Nibble SHIFT / 4 of `half` (four nibbles at bits 0..15 under MAGIC_BITS) dequantized, in DTYPE.
    Read in place by one AND it is 2**23 + code * 2**SHIFT; the subtraction of 2**23 and the
    code's zero (times 2**SHIFT) is exact, and the scale, divided by 2**SHIFT (exact), is applied
    to the group's values before they are spread: the product is (code - zero) * scale rounded
    once, as `quant.dequantize` computes it."""
    field = (half & (MAGIC_BITS | (0xF << SHIFT))).to(tl.float32, bitcast=True)
    UNIT: tl.constexpr = 1 << SHIFT
    scaled = _spread(scale * (1.0 / UNIT), BLOCK_N, WIDTH, TILE_GROUPS)
    if OFFSET == 0:
        w = (field - (MAGIC + 8.0 * UNIT)) * scaled
    elif OFFSET == 1:
        w = (field - _spread(offset * UNIT + MAGIC, BLOCK_N, WIDTH, TILE_GROUPS)) * scaled
    else:
        w = (field - MAGIC) * scaled - _spread(offset, BLOCK_N, WIDTH, TILE_GROUPS)
    return w.to(DTYPE)


@triton.jit
def _int4_tile(stored, scale, offset, OFFSET: tl.constexpr, BLOCK_N: tl.constexpr, WIDTH: tl.constexpr,
               TILE_GROUPS: tl.constexpr, DTYPE: tl.constexpr):
    """Words (BLOCK_N, WIDTH) of eight codes (input 8j + n in nibble n of word j) -> the dequantized
    tile (BLOCK_N, 8 * WIDTH) in input order."""
    low = (stored & 0xFFFF) | MAGIC_BITS
    high = (stored.to(tl.uint32, bitcast=True) >> 16).to(tl.int32, bitcast=True) | MAGIC_BITS
    w0 = _nibble(low, scale, offset, 0, OFFSET, BLOCK_N, WIDTH, TILE_GROUPS, DTYPE)
    w1 = _nibble(low, scale, offset, 4, OFFSET, BLOCK_N, WIDTH, TILE_GROUPS, DTYPE)
    w2 = _nibble(low, scale, offset, 8, OFFSET, BLOCK_N, WIDTH, TILE_GROUPS, DTYPE)
    w3 = _nibble(low, scale, offset, 12, OFFSET, BLOCK_N, WIDTH, TILE_GROUPS, DTYPE)
    w4 = _nibble(high, scale, offset, 0, OFFSET, BLOCK_N, WIDTH, TILE_GROUPS, DTYPE)
    w5 = _nibble(high, scale, offset, 4, OFFSET, BLOCK_N, WIDTH, TILE_GROUPS, DTYPE)
    w6 = _nibble(high, scale, offset, 8, OFFSET, BLOCK_N, WIDTH, TILE_GROUPS, DTYPE)
    w7 = _nibble(high, scale, offset, 12, OFFSET, BLOCK_N, WIDTH, TILE_GROUPS, DTYPE)
    # join adds a last axis: nested so that axis (a, b, c) holds nibble 4a + 2b + c, in input order.
    tile = tl.join(tl.join(tl.join(w0, w4), tl.join(w2, w6)), tl.join(tl.join(w1, w5), tl.join(w3, w7)))
    return tl.reshape(tile, (BLOCK_N, 8 * WIDTH))


@triton.jit
def dequantized_tile(
    w_ptr, scale_ptr, offset_ptr, outs, k0, K, stride_w, stride_scale,  # outs (BLOCK_N,), in range
    BITS: tl.constexpr, GROUP: tl.constexpr, OFFSET: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    TILE_GROUPS: tl.constexpr, EVEN_K: tl.constexpr, DTYPE: tl.constexpr,
):
    """dequantize(w)[outs, k0:k0 + BLOCK_K] (BLOCK_N, BLOCK_K) in DTYPE, 0 past K. BITS 0: plain
    weights; 8: int8 codes; 4: int32 words of eight codes (`word_args`), input 8j + n in nibble n of
    word j. TILE_GROUPS: see `_group_values`."""
    PACK: tl.constexpr = 8 if BITS == 4 else 1
    WIDTH: tl.constexpr = BLOCK_K // PACK  # words (or elements) of a tile row
    j = tl.arange(0, WIDTH)
    ptrs = w_ptr + outs[:, None] * stride_w + k0 // PACK + j[None, :]
    if EVEN_K:
        stored = tl.load(ptrs)
    else:
        stored = tl.load(ptrs, mask=((k0 + j * PACK) < K)[None, :], other=0)
    if BITS == 0:
        w = stored.to(DTYPE)
    else:
        scale = _group_values(scale_ptr, outs, stride_scale, k0, K, GROUP, BLOCK_N, WIDTH, PACK, TILE_GROUPS, EVEN_K)
        offset = scale  # read only when OFFSET > 0
        if OFFSET > 0:
            offset = _group_values(offset_ptr, outs, stride_scale, k0, K, GROUP, BLOCK_N, WIDTH, PACK, TILE_GROUPS,
                                   EVEN_K)
        if BITS == 8:
            w = _dequantize(stored.to(tl.float32), _spread(scale, BLOCK_N, WIDTH, TILE_GROUPS),
                            _spread(offset, BLOCK_N, WIDTH, TILE_GROUPS), OFFSET).to(DTYPE)
        else:
            w = _int4_tile(stored, scale, offset, OFFSET, BLOCK_N, WIDTH, TILE_GROUPS, DTYPE)
    return w


@triton.jit
def _gemv_kernel(
    x_ptr, y_ptr, bias_ptr, w_ptr, scale_ptr, offset_ptr,
    M, N, K, stride_x, stride_y, stride_w, stride_scale,
    BITS: tl.constexpr, GROUP: tl.constexpr, OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILE_GROUPS: tl.constexpr,
    EVEN_K: tl.constexpr, STAGES: tl.constexpr,
):
    """y[:, BLOCK_N outputs] for all M rows (padded to BLOCK_M = DOT_ROWS); rows and outputs past
    the ends are clamped for the loads (no masks in the loop) and masked only at the store."""
    rows = tl.arange(0, BLOCK_M)
    outs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    loaded_rows = tl.minimum(rows, M - 1).to(tl.int64)
    loaded_outs = tl.minimum(outs, N - 1).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        x = load_input_tile(x_ptr, loaded_rows, stride_x, k, K, BLOCK_K, EVEN_K)
        w = dequantized_tile(w_ptr, scale_ptr, offset_ptr, loaded_outs, k, K, stride_w, stride_scale,
                             BITS, GROUP, OFFSET, BLOCK_N, BLOCK_K, TILE_GROUPS, EVEN_K, x.dtype)
        acc = dot_tile(x, w, acc)
    if HAS_BIAS:  # by `outs`, masked: `loaded_outs` then dies with the loop (one register fewer in it)
        acc += tl.load(bias_ptr + outs, mask=outs < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_y + outs[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (outs[None, :] < N))


def tile_shape(K: int, group: int, bits: int, inputs: dict[int, int] | None = None) -> tuple[int, int, bool]:
    """(BLOCK_K, TILE_GROUPS, EVEN_K) for a reduction over K inputs in tiles of inputs[bits]
    (TILE_INPUTS by default; no wider than K, at least tl.dot's 16). The same whatever the step's
    rows: each output's sum takes one order in a one-row step and in a verify step. Tiles are
    aligned to the groups: a tile holds whole groups (TILE_GROUPS of them) or lies inside one (1);
    groups that do neither (never in released models) are read per word (0)."""
    block_k = max(16, min((inputs or TILE_INPUTS).get(bits, 128), triton.next_power_of_2(K)))
    if not bits or group >= K:
        tile_groups = 1
    elif block_k % group == 0:
        tile_groups = block_k // group
    else:
        tile_groups = 1 if group % block_k == 0 else 0
    return block_k, tile_groups, K % block_k == 0


def streams(w_args: tuple, K: int) -> bool:
    """Whether the streaming kernels read this weight (`quant_triton.weight_args`) of K inputs as
    it is stored: int4 codes are read as 32-bit words of eight, so a row and a scale group must hold
    whole words (true of every released model's shapes) and the codes must start and step on whole
    words; other formats always."""
    codes, bits, group = w_args[0], w_args[5], w_args[6]
    return bits != 4 or (K % 8 == 0 and (group >= K or group % 8 == 0) and codes.stride(-1) == 1
                         and codes.storage_offset() % 4 == 0 and all(s % 4 == 0 for s in codes.stride()[:-1]))


def word_args(w_args: tuple, expert_strides: tuple[int, int] = (0, 0)) -> tuple[tuple, tuple[int, int]]:
    """`weight_args` and a stack's (codes, scales) elements between experts as the streaming
    kernels read them: int4 codes as int32 words, their strides in words (see `streams`)."""
    if w_args[5] != 4:
        return w_args, expert_strides
    words = (w_args[0].view(torch.int32), *w_args[1:3], w_args[3] // 4, *w_args[4:])
    return words, (expert_strides[0] // 4, expert_strides[1])


def gemv(x: torch.Tensor, w_args: tuple, N: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x (M <= GEMV_ROWS, K) contiguous @ a weight given as `quant_triton.weight_args` -> (M, N)."""
    M, K = x.shape
    if M == 0:  # no rows: nothing to launch (the kernel would clamp row indices to -1)
        return torch.empty((0, N), dtype=x.dtype, device=x.device)
    w_ptr, s_ptr, z_ptr, stride_w, stride_s, bits, group, offset = word_args(w_args)[0]
    # 16 outputs a program (tl.dot's least): 128 programs at N = 2048, about 1.6 per SM on an 82-SM
    # RTX 3090.
    block_n = 16
    block_k, tile_groups, even_k = tile_shape(K, group, bits)
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(N, block_n),)](
        x, y, bias if bias is not None else y, w_ptr, s_ptr, z_ptr, M, N, K, x.stride(0), y.stride(0),
        stride_w, stride_s, bits, group, offset, bias is not None, BLOCK_M=DOT_ROWS, BLOCK_N=block_n,
        BLOCK_K=block_k, TILE_GROUPS=tile_groups, EVEN_K=even_k, STAGES=3)
    return y


# Inputs of a decode tile by weight bits: int4 tiles of 256 (128 bytes a weight row), others 128.
TILE_INPUTS = {4: 256}
