"""Streaming quantized GEMV for decode and verify steps (at most `GEMV_ROWS` rows), one launch
per matmul: y (M, N) = x (M, K) @ dequantize(w).T (+ bias), cast to x's dtype in the kernel.

A step this narrow is bound by reading the weight, so each program owns a few output rows and
streams their whole K once: contiguous loads of the packed codes (int4 as 32-bit words of eight
codes, unpacked in registers by one AND each), group scales (and zero points or mins) loaded once
per group, and a multiply-add reduction (tl.dot's tensor-core tiles would be mostly empty at these
widths). A word's eight products are summed before its scale multiplies them: one multiply per
word, not per code.

`fma_weight_tile` is the one tile step; the MoE decode kernels use it too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lucebox.limits import DECODE_ROWS

# The most rows a step may have to take the GEMV; wider steps take tl.dot tiles.
GEMV_ROWS = DECODE_ROWS


@triton.jit
def _input_column(ptrs, mask, n: tl.constexpr, EVEN_K: tl.constexpr):
    """Input 8j + n of each word j, float32."""
    if EVEN_K:
        x = tl.load(ptrs + n).to(tl.float32)
    else:
        x = tl.load(ptrs + n, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def load_inputs(x_ptr, rows, stride_x, k0, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, BITS: tl.constexpr):
    """x[rows, k0:k0 + BLOCK_K] in float32 as the tuple `fma_weight_tile` takes: for int4 codes
    nine (R, BLOCK_K // 8): input 8j + n of each word j for n = 0..7, each divided by the power of
    16 its nibble is read at (`_nibble_field`), then their plain sum (for zero points and mins);
    else the inputs twice (R, BLOCK_K). `rows` must be in range (callers clamp them); inputs past K
    read as 0."""
    if BITS == 4:
        ks = k0 + 8 * tl.arange(0, BLOCK_K // 8)
        ptrs = x_ptr + rows[:, None] * stride_x + ks[None, :]
        mask = ks[None, :] < K
        x0 = _input_column(ptrs, mask, 0, EVEN_K)
        x1 = _input_column(ptrs, mask, 1, EVEN_K)
        x2 = _input_column(ptrs, mask, 2, EVEN_K)
        x3 = _input_column(ptrs, mask, 3, EVEN_K)
        x4 = _input_column(ptrs, mask, 4, EVEN_K)
        x5 = _input_column(ptrs, mask, 5, EVEN_K)
        x6 = _input_column(ptrs, mask, 6, EVEN_K)
        x7 = _input_column(ptrs, mask, 7, EVEN_K)
        # Nibble n of a word is read in place as its code times 16 ** (n % 4) (`_nibble_field`): its
        # input is divided by as much (exact: a power of two).
        inputs = (x0, x1 * (1.0 / 16), x2 * (1.0 / 256), x3 * (1.0 / 4096),
                  x4, x5 * (1.0 / 16), x6 * (1.0 / 256), x7 * (1.0 / 4096),
                  ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)))
    else:
        ks = k0 + tl.arange(0, BLOCK_K)
        ptrs = x_ptr + rows[:, None] * stride_x + ks[None, :]
        if EVEN_K:
            xs = tl.load(ptrs).to(tl.float32)
        else:
            xs = tl.load(ptrs, mask=ks[None, :] < K, other=0.0).to(tl.float32)
        inputs = (xs, xs)
    return inputs


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
def _group_values(ptr, group_ptrs, g, K, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, TILE_GROUPS: tl.constexpr,
                  SPAN: tl.constexpr, EVEN_K: tl.constexpr):
    """Per-group values (scales, zero points or mins) of a tile, loaded once per group and
    repeated over each group's SPAN columns: (BLOCK_N, TILE_GROUPS * SPAN) float32."""
    if EVEN_K:
        values = tl.load(ptr + group_ptrs).to(tl.float32)
    else:
        values = tl.load(ptr + group_ptrs, mask=(g * GROUP < K)[None, :], other=0.0).to(tl.float32)
    return tl.reshape(tl.broadcast_to(values[:, :, None], (BLOCK_N, TILE_GROUPS, SPAN)), (BLOCK_N, TILE_GROUPS * SPAN))


@triton.jit
def tile_accumulator(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BITS: tl.constexpr):
    """Zeros for `fma_weight_tile`'s running products: (BLOCK_M, BLOCK_N, BLOCK_K // 8) for int4
    (a product per word of eight codes), (BLOCK_M, BLOCK_N, BLOCK_K) otherwise. The sum over
    the last axis waits until after the K loop (`fixed_order_sum`): summing each tile inside the
    loop would cost cross-lane shuffles every iteration, more instructions than the products."""
    PACK: tl.constexpr = 8 if BITS == 4 else 1
    return tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K // PACK), dtype=tl.float32)


# A float32 whose bits are 0x4B000000 | c is 2**23 + c for c < 2**23: an integer code becomes a float
# by one OR and one subtraction (of 2**23 and the implicit zero at once, exactly), without the
# slow int-to-float conversion.
MAGIC_BITS = tl.constexpr(0x4B000000)
MAGIC = tl.constexpr(8388608.0)


@triton.jit
def _nibble_field(half, SHIFT: tl.constexpr):
    """Nibble SHIFT / 4 of `half` (four nibbles at bits 0..15 under MAGIC_BITS), left in place:
    2 ** 23 + code * 16 ** (SHIFT / 4) as float32, by one AND."""
    return (half & (MAGIC_BITS | (0xF << SHIFT))).to(tl.float32, bitcast=True)


@triton.jit
def fma_weight_tile(
    acc, xs,  # acc from `tile_accumulator`; xs: the tuple `load_inputs` gives
    w_ptr, scale_ptr, offset_ptr, outs, k0, K, stride_w, stride_scale,  # outs (BLOCK_N,), in range
    BITS: tl.constexpr, GROUP: tl.constexpr, OFFSET: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILE_GROUPS: tl.constexpr, EVEN_K: tl.constexpr,
):
    """acc + the products of xs @ dequantize(w)[outs, k0:k0 + BLOCK_K].T, not yet summed over the
    tile (`tile_accumulator`). BITS 0: plain weights; 8: int8 codes; 4: int32 words of eight
    codes (`word_args`), input 8j + n in nibble n of word j. TILE_GROUPS: the scale groups one tile
    spans (1 when a group holds whole tiles)."""
    PACK: tl.constexpr = 8 if BITS == 4 else 1
    WIDTH: tl.constexpr = BLOCK_K // PACK  # words (or elements) of a tile row
    j = tl.arange(0, WIDTH)
    ptrs = w_ptr + outs[:, None] * stride_w + k0 // PACK + j[None, :]
    if EVEN_K:
        stored = tl.load(ptrs)
    else:
        stored = tl.load(ptrs, mask=((k0 + j * PACK) < K)[None, :], other=0)
    if BITS == 0:
        products = xs[0][:, None, :] * stored.to(tl.float32)[None, :, :]
    else:
        g = k0 // GROUP + tl.arange(0, TILE_GROUPS)
        group_ptrs = outs[:, None] * stride_scale + g[None, :]
        SPAN: tl.constexpr = WIDTH // TILE_GROUPS
        scale = _group_values(scale_ptr, group_ptrs, g, K, GROUP, BLOCK_N, TILE_GROUPS, SPAN, EVEN_K)
        offset = scale  # read only when OFFSET > 0
        if OFFSET > 0:
            offset = _group_values(offset_ptr, group_ptrs, g, K, GROUP, BLOCK_N, TILE_GROUPS, SPAN, EVEN_K)
        if BITS == 8:
            w = _dequantize(stored.to(tl.float32), scale, offset, OFFSET)
            products = xs[0][:, None, :] * w[None, :, :]
        else:
            # Nibble n of a word is input 8j + n. The scale (and offset) multiply a word's eight
            # products once: sum(x * (c - z)) * s, or sum(x * c) * s - sum(x) * m for mins.
            low = (stored & 0xFFFF) | MAGIC_BITS
            high = (stored.to(tl.uint32, bitcast=True) >> 16).to(tl.int32, bitcast=True) | MAGIC_BITS
            ZERO: tl.constexpr = 8 if OFFSET == 0 else 0
            codes = 0.0
            for n in tl.static_range(8):
                field = _nibble_field(low if n < 4 else high, 4 * (n % 4))
                codes = codes + xs[n][:, None, :] * (field - (MAGIC + ZERO * (1 << (4 * (n % 4)))))[None, :, :]
            if OFFSET == 0:
                products = acc + codes * scale[None, :, :]
            elif OFFSET == 1:
                products = acc + (codes - xs[8][:, None, :] * offset[None, :, :]) * scale[None, :, :]
            else:
                products = acc + (codes * scale[None, :, :] - xs[8][:, None, :] * offset[None, :, :])
    if BITS != 4:
        products = acc + products
    return products


@triton.jit
def _gemv_kernel(
    x_ptr, y_ptr, bias_ptr, w_ptr, scale_ptr, offset_ptr,
    M, N, K, stride_x, stride_y, stride_w, stride_scale,
    BITS: tl.constexpr, GROUP: tl.constexpr, OFFSET: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr,
    TILE_GROUPS: tl.constexpr, EVEN_K: tl.constexpr, STAGES: tl.constexpr,
):
    """y[:, BLOCK_N outputs] for all M rows; rows and outputs past the ends are clamped for the
    loads (no masks in the loop) and masked only at the store."""
    rows = tl.arange(0, BLOCK_M)
    outs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    loaded_rows = tl.minimum(rows, M - 1).to(tl.int64)
    loaded_outs = tl.minimum(outs, N - 1).to(tl.int64)
    products = tile_accumulator(BLOCK_M, BLOCK_N, BLOCK_K, BITS)
    for k0 in tl.range(0, K, BLOCK_K * SUB, num_stages=STAGES):
        for sub in tl.static_range(SUB):
            k = k0 + sub * BLOCK_K
            xs = load_inputs(x_ptr, loaded_rows, stride_x, k, K, BLOCK_K, EVEN_K, BITS)
            products = fma_weight_tile(products, xs, w_ptr, scale_ptr, offset_ptr, loaded_outs, k, K, stride_w,
                                       stride_scale, BITS, GROUP, OFFSET, BLOCK_N, BLOCK_K, TILE_GROUPS, EVEN_K)
    acc = fixed_order_sum(products, BLOCK_K // (8 if BITS == 4 else 1))
    if HAS_BIAS:  # by `outs`, masked: `loaded_outs` then dies with the loop (one register fewer in it)
        acc += tl.load(bias_ptr + outs, mask=outs < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_y + outs[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (outs[None, :] < N))


def tile_shape(rows: int, K: int, group: int, bits: int, products: int) -> tuple[int, int, int, bool]:
    """(BLOCK_K, SUB, TILE_GROUPS, EVEN_K) for `rows` rows of x. A loop iteration streams SUB
    tiles of BLOCK_K inputs, as many as a budget of `products` running products per output row
    allows (a program's registers; an int4 word's eight inputs share one, but a 16-row step also
    holds those inputs, so int4 tiles are four times as wide, not eight: wider ones spill on sm_86),
    up to 512 inputs and no wider than K. BLOCK_K, the running products'
    width, is what the budget allows at GEMV_ROWS rows whatever `rows` is: each output's sum then
    takes the same order in a one-row step and in a verify step, so the verified rows carry the
    bits plain decoding computes. Tiles are aligned to the groups: a tile holds whole groups, or
    lies inside one."""
    widest = triton.next_power_of_2(K)
    products *= 4 if bits == 4 else 1
    block_k = max(32, min(512, products // GEMV_ROWS, widest))
    if bits and group < K and group % block_k and block_k % group:
        block_k = group & -group  # an odd group (never in real models): tiles inside one group
    sub = max(1, min(512, products // triton.next_power_of_2(rows), widest) // block_k)
    tile_groups = 1 if not bits or group >= K else max(1, block_k // group)
    return block_k, sub, tile_groups, K % (block_k * sub) == 0


@triton.jit
def _halve(t):
    """(R, C, L) -> (R, C, L // 2): each adjacent pair of the last axis added."""
    first, second = tl.split(tl.reshape(t, (t.shape[0], t.shape[1], t.shape[2] // 2, 2)))
    return first + second


@triton.jit
def fixed_order_sum(products, LANES: tl.constexpr):
    """The sum over the last axis (LANES wide, a power of two) as a fixed pairwise tree: the same
    additions in the same order whatever layout the compiler gives the tensor (`tl.sum`'s order
    follows the layout, which follows the number of rows)."""
    for _ in tl.static_range(LANES.bit_length() - 1):
        products = _halve(products)
    return tl.reshape(products, (products.shape[0], products.shape[1]))


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
    block_m = triton.next_power_of_2(M)
    # 16 outputs a program: 128 programs at N = 2048, about 1.6 per SM on an 82-SM RTX 3090. int4 tiles
    # of 256 inputs stream at 0.34 SASS instructions per byte at one row on sm_86 (bench/kernel_specs.py).
    block_n = 16
    block_k, sub, tile_groups, even_k = tile_shape(block_m, K, group, bits, products=16384 // block_n)
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(N, block_n),)](
        x, y, bias if bias is not None else y, w_ptr, s_ptr, z_ptr, M, N, K, x.stride(0), y.stride(0),
        stride_w, stride_s, bits, group, offset, bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, SUB=sub, TILE_GROUPS=tile_groups, EVEN_K=even_k, STAGES=3)
    return y
