"""Streaming quantized GEMV for decode and verify steps (at most `GEMV_ROWS` rows), one launch
per matmul: y (M, N) = x (M, K) @ dequantize(w).T (+ bias), cast to x's dtype in the kernel.

A step this narrow is bound by reading the weight, so each program owns a few output rows and
streams their whole K once: contiguous loads of the packed codes, nibbles unpacked in registers,
group scales (and zero points or mins) loaded once per group and broadcast over it, and a
multiply-add reduction (tl.dot's tensor-core tiles would be mostly empty at these widths).

`fma_weight_tile` is the one tile step; the MoE decode kernels use it too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lucebox.kernels.step_rows import DECODE_STEP_ROWS

# The most rows a step may have to take the GEMV; wider steps take tl.dot tiles.
GEMV_ROWS = DECODE_STEP_ROWS


@triton.jit
def load_inputs(x_ptr, rows, stride_x, k0, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, BITS: tl.constexpr):
    """x[rows, k0:k0 + BLOCK_K] in float32 as the pair `fma_weight_tile` takes: for int4 codes the
    even and odd inputs apart (R, BLOCK_K // 2) each, loaded with a stride of 2 so they meet the low
    and high nibbles without a reshape; else the inputs twice (R, BLOCK_K). `rows` must be in range
    (callers clamp them); inputs past K read as 0."""
    if BITS == 4:
        ks = k0 + 2 * tl.arange(0, BLOCK_K // 2)
        ptrs = x_ptr + rows[:, None] * stride_x + ks[None, :]
        if EVEN_K:
            pair = (tl.load(ptrs).to(tl.float32), tl.load(ptrs + 1).to(tl.float32))
        else:
            pair = (tl.load(ptrs, mask=ks[None, :] < K, other=0.0).to(tl.float32),
                    tl.load(ptrs + 1, mask=ks[None, :] + 1 < K, other=0.0).to(tl.float32))
    else:
        ks = k0 + tl.arange(0, BLOCK_K)
        ptrs = x_ptr + rows[:, None] * stride_x + ks[None, :]
        if EVEN_K:
            xs = tl.load(ptrs).to(tl.float32)
        else:
            xs = tl.load(ptrs, mask=ks[None, :] < K, other=0.0).to(tl.float32)
        pair = (xs, xs)
    return pair


@triton.jit
def _dequantize(codes, scale, offset, OFFSET: tl.constexpr, ZERO: tl.constexpr):
    """Codes (float32) times their scales, less their offsets (see `quant_triton.OFFSET_KINDS`).
    (Every branch assigns one result: the compiler traces on past a `return` inside a constexpr if.)"""
    if OFFSET == 2:
        w = codes * scale - offset
    elif OFFSET == 1:
        w = (codes - offset) * scale
    elif ZERO == 0:
        w = codes * scale
    else:
        w = (codes - ZERO) * scale
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
    """Zeros for `fma_weight_tile`'s running products: (BLOCK_M, BLOCK_N, BLOCK_K // 2) for int4
    (a product per byte: a pair of inputs), (BLOCK_M, BLOCK_N, BLOCK_K) otherwise. The sum over
    the last axis waits until after the K loop (`fixed_order_sum`): summing each tile inside the
    loop would cost cross-lane shuffles every iteration, more instructions than the products."""
    PACK: tl.constexpr = 2 if BITS == 4 else 1
    return tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K // PACK), dtype=tl.float32)


# A float32 whose bits are 0x4B000000 | c is 2**23 + c for c < 2**23: an integer code becomes a float
# by one OR and one subtraction (of 2**23 and the implicit zero at once, exactly), without the
# slow int-to-float conversion.
MAGIC_BITS = tl.constexpr(0x4B000000)
MAGIC = tl.constexpr(8388608.0)


@triton.jit
def _nibble_value(nibbles, ZERO: tl.constexpr):
    """int32 nibbles (0..15) as float32 codes less ZERO."""
    return (nibbles | MAGIC_BITS).to(tl.float32, bitcast=True) - (MAGIC + ZERO)


@triton.jit
def fma_weight_tile(
    acc, xs,  # acc from `tile_accumulator`; xs: the pair `load_inputs` gives
    w_ptr, scale_ptr, offset_ptr, outs, k0, K, stride_w, stride_scale,  # outs (BLOCK_N,), in range
    BITS: tl.constexpr, GROUP: tl.constexpr, OFFSET: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TILE_GROUPS: tl.constexpr, EVEN_K: tl.constexpr,
):
    """acc + the products of xs @ dequantize(w)[outs, k0:k0 + BLOCK_K].T, not yet summed over the
    tile (`tile_accumulator`). BITS 0: plain weights; 8: int8 codes;
    4: two codes per byte (even input in the low nibble). TILE_GROUPS: the scale groups one tile
    spans (1 when a group holds whole tiles)."""
    PACK: tl.constexpr = 2 if BITS == 4 else 1
    WIDTH: tl.constexpr = BLOCK_K // PACK  # bytes (or elements) of a tile row
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
            w = _dequantize(stored.to(tl.float32), scale, offset, OFFSET, 0)
            products = xs[0][:, None, :] * w[None, :, :]
        else:
            # int4: implicit zero 8 unless the codes carry zero points or mins. The inputs split
            # into even and odd halves to meet the low and high nibbles (no per-element indexing).
            packed = stored.to(tl.int32)
            if OFFSET == 0:  # the implicit zero 8 leaves with the magic number
                low = _nibble_value(packed & 0xF, 8) * scale
                high = _nibble_value(packed >> 4, 8) * scale
            else:
                low = _dequantize(_nibble_value(packed & 0xF, 0), scale, offset, OFFSET, 8)
                high = _dequantize(_nibble_value(packed >> 4, 0), scale, offset, OFFSET, 8)
            x_even, x_odd = xs
            # Added to acc one product at a time: two fused multiply-adds a byte.
            products = acc + x_even[:, None, :] * low[None, :, :]
            products = products + x_odd[:, None, :] * high[None, :, :]
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
    acc = fixed_order_sum(products, BLOCK_K // (2 if BITS == 4 else 1))
    if HAS_BIAS:  # by `outs`, masked: `loaded_outs` then dies with the loop (one register fewer in it)
        acc += tl.load(bias_ptr + outs, mask=outs < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_y + outs[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (outs[None, :] < N))


def tile_shape(rows: int, K: int, group: int, bits: int, products: int) -> tuple[int, int, int, bool]:
    """(BLOCK_K, SUB, TILE_GROUPS, EVEN_K) for `rows` rows of x. A loop iteration streams SUB
    tiles of BLOCK_K inputs, as many as a budget of `products` running products per output row
    allows (a program's registers; an int4 byte's two inputs share one, so int4 tiles are twice as
    wide), up to 512 inputs and no wider than K. BLOCK_K, the running products'
    width, is what the budget allows at GEMV_ROWS rows whatever `rows` is: each output's sum then
    takes the same order in a one-row step and in a verify step, so the verified rows carry the
    bits plain decoding computes. Tiles are aligned to the groups: a tile holds whole groups, or
    lies inside one."""
    widest = triton.next_power_of_2(K)
    products *= 2 if bits == 4 else 1
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


def gemv(x: torch.Tensor, w_args: tuple, N: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x (M <= GEMV_ROWS, K) contiguous @ a weight given as `quant_triton.weight_args` -> (M, N)."""
    M, K = x.shape
    if M == 0:  # no rows: nothing to launch (the kernel would clamp row indices to -1)
        return torch.empty((0, N), dtype=x.dtype, device=x.device)
    w_ptr, s_ptr, z_ptr, stride_w, stride_s, bits, group, offset = w_args
    block_m = triton.next_power_of_2(M)
    # 16 outputs a program: 128 programs at N = 2048, about 1.6 per SM on an 82-SM RTX 3090; each input
    # loaded serves 16 outputs. 128-input int4 tiles stream at 0.50 SASS instructions per byte at one row
    # on sm_86 (64-input tiles: 0.57; bench/kernel_specs.py).
    block_n = 16
    block_k, sub, tile_groups, even_k = tile_shape(block_m, K, group, bits, products=16384 // block_n)
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(N, block_n),)](
        x, y, bias if bias is not None else y, w_ptr, s_ptr, z_ptr, M, N, K, x.stride(0), y.stride(0),
        stride_w, stride_s, bits, group, offset, bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, SUB=sub, TILE_GROUPS=tile_groups, EVEN_K=even_k, STAGES=3)
    return y
