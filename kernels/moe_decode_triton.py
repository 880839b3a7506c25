"""MoE experts for decode and verify steps (at most `DEDUP_ROWS` rows, the DEDUP layout): two
launches, streaming weight tiles and multiply-add reductions as the quantized GEMV does.

- `_up_decode_kernel`: one program per (routed pair, tile of intermediate features), plus one per
  tile for the shared expert. A pair whose expert already appears in an earlier pair does nothing;
  the others gather every row that chose their expert, so each chosen expert is read once.
  silu(gate) * up -> `inter[pair]` (pair m * K + j; the shared expert's rows at M * K + m).
- `_down_decode_kernel`: one program per tile of hidden features, looping over the distinct
  chosen experts (each read once per tile) and then the shared expert. Each (row, choice) result
  is kept apart until the end, then a row's choices are summed in choice order, plus the shared
  expert: a fixed order (no atomics) that does not depend on the step's other rows. It writes
  the layer's output (M, H) in the activation dtype.

Shapes: M rows, H hidden features, E experts of F intermediate features (Fs for the shared
expert), K choices per row. No host sync: the launches fit in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lucebox.kernels.gemv_triton import (
    DOT_ROWS,
    dequantized_tile,
    dot_tile,
    fixed_order_sum,
    load_input_tile,
    tile_shape,
    word_args,
)

from lucebox.limits import DECODE_ROWS

# The most rows a step may have for this layout; wider steps take the sorted (prefill) layout.
DEDUP_ROWS = DECODE_ROWS


@triton.jit
def _expert_rows(b, ids_ptr, M, K, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
    """(expert, pair (BLOCK_M,), valid (BLOCK_M,), first) of routed pair b: the rows that chose
    pair b's expert and the pair through which they did (row 0's first pair, always written, for
    rows that did not); first: b is the expert's first pair."""
    expert = tl.load(ids_ptr + b)
    earlier = tl.arange(0, BLOCK_P)
    seen = tl.load(ids_ptr + earlier, mask=earlier < b, other=-1)
    first = tl.sum((seen == expert).to(tl.int32), axis=0) == 0
    r = tl.arange(0, BLOCK_M)
    c = tl.arange(0, BLOCK_C)
    chosen = tl.load(ids_ptr + r[:, None] * K + c[None, :], mask=(r[:, None] < M) & (c[None, :] < K), other=-1)
    match = chosen == expert
    valid = tl.sum(match.to(tl.int32), axis=1) > 0
    pair = tl.where(valid, r * K + tl.sum(tl.where(match, c[None, :], 0), axis=1), 0)
    return expert.to(tl.int64), pair.to(tl.int64), valid, first


@triton.jit
def _gate_up(x_ptr, inter_ptr, pair, valid, w_ptr, s_ptr, z_ptr, stride_w, stride_s, M, H, width, stride_inter,
             BITS: tl.constexpr, GROUP: tl.constexpr, OFFSET: tl.constexpr, BLOCK_R: tl.constexpr,
             SUB_R: tl.constexpr, TILE_GROUPS: tl.constexpr, EVEN_R: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, STAGES: tl.constexpr):
    """inter[pair, tile] = silu(gate) * up for one matrix's tile of BLOCK_I intermediate features."""
    rows = tl.minimum(tl.arange(0, BLOCK_M), M - 1).to(tl.int64)
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    loaded_i = tl.minimum(i, width - 1).to(tl.int64)
    gate = tl.zeros((BLOCK_M, BLOCK_I), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_I), dtype=tl.float32)
    for h0 in tl.range(0, H, BLOCK_R * SUB_R, num_stages=STAGES):
        for sub in tl.static_range(SUB_R):
            h = h0 + sub * BLOCK_R
            x = load_input_tile(x_ptr, rows, H, h, H, BLOCK_R, EVEN_R)
            gate = dot_tile(x, dequantized_tile(w_ptr, s_ptr, z_ptr, loaded_i, h, H, stride_w, stride_s, BITS, GROUP,
                                                OFFSET, BLOCK_I, BLOCK_R, TILE_GROUPS, EVEN_R, x.dtype), gate)
            up = dot_tile(x, dequantized_tile(w_ptr, s_ptr, z_ptr, width + loaded_i, h, H, stride_w, stride_s, BITS,
                                              GROUP, OFFSET, BLOCK_I, BLOCK_R, TILE_GROUPS, EVEN_R, x.dtype), up)
    act = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(inter_ptr + pair[:, None] * stride_inter + i[None, :], act.to(inter_ptr.dtype.element_ty),
             mask=valid[:, None] & (i < width)[None, :])


@triton.jit
def _up_decode_kernel(
    x_ptr, inter_ptr, ids_ptr, w_ptr, s_ptr, z_ptr, stride_we, stride_se, stride_w, stride_s,
    sw_ptr, ss_ptr, sz_ptr, stride_sw, stride_ss, M, K, H, F, F_SHARED, stride_inter,
    BITS: tl.constexpr, GROUP: tl.constexpr, OFFSET: tl.constexpr, BLOCK_R: tl.constexpr, SUB_R: tl.constexpr,
    TILE_GROUPS: tl.constexpr, EVEN_R: tl.constexpr,
    S_BITS: tl.constexpr, S_GROUP: tl.constexpr, S_OFFSET: tl.constexpr, S_BLOCK_R: tl.constexpr,
    S_SUB_R: tl.constexpr, S_TILE_GROUPS: tl.constexpr, S_EVEN_R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_I: tl.constexpr,
    STAGES: tl.constexpr,
):
    b = tl.program_id(0)
    P = M * K
    tile_start = tl.program_id(1) * BLOCK_I
    # The matrix is chosen before the K loop: each branch runs one loop, in its own weight format.
    if b < P:
        expert, pair, valid, first = _expert_rows(b, ids_ptr, M, K, BLOCK_M, BLOCK_P, BLOCK_C)
        if first & (tile_start < F):
            _gate_up(x_ptr, inter_ptr, pair, valid, w_ptr + expert * stride_we, s_ptr + expert * stride_se,
                     z_ptr + expert * stride_se, stride_w, stride_s, M, H, F, stride_inter,
                     BITS, GROUP, OFFSET, BLOCK_R, SUB_R, TILE_GROUPS, EVEN_R, BLOCK_M, BLOCK_I, STAGES)
    elif tile_start < F_SHARED:
        rows = tl.arange(0, BLOCK_M)
        _gate_up(x_ptr, inter_ptr, P + rows.to(tl.int64), rows < M, sw_ptr, ss_ptr, sz_ptr, stride_sw, stride_ss,
                 M, H, F_SHARED, stride_inter, S_BITS, S_GROUP, S_OFFSET, S_BLOCK_R, S_SUB_R, S_TILE_GROUPS,
                 S_EVEN_R,
                 BLOCK_M, BLOCK_I, STAGES)


@triton.jit
def _down(inter_ptr, pair, w_ptr, s_ptr, z_ptr, stride_w, stride_s, width, stride_inter, loaded_h,
          BITS: tl.constexpr, GROUP: tl.constexpr, OFFSET: tl.constexpr, BLOCK_R: tl.constexpr,
          SUB_R: tl.constexpr, TILE_GROUPS: tl.constexpr, EVEN_R: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, STAGES: tl.constexpr):
    """inter[pair] @ w[loaded_h].T: (BLOCK_M, BLOCK_H) float32, one matrix's hidden tile."""
    acc = tl.zeros((BLOCK_M, BLOCK_H), dtype=tl.float32)
    for i0 in tl.range(0, width, BLOCK_R * SUB_R, num_stages=STAGES):
        for sub in tl.static_range(SUB_R):
            i = i0 + sub * BLOCK_R
            a = load_input_tile(inter_ptr, pair, stride_inter, i, width, BLOCK_R, EVEN_R)
            acc = dot_tile(a, dequantized_tile(w_ptr, s_ptr, z_ptr, loaded_h, i, width, stride_w, stride_s, BITS,
                                               GROUP, OFFSET, BLOCK_H, BLOCK_R, TILE_GROUPS, EVEN_R, a.dtype), acc)
    return acc


@triton.jit
def _down_decode_kernel(
    inter_ptr, out_ptr, weights_ptr, ids_ptr, w_ptr, s_ptr, z_ptr, stride_we, stride_se, stride_w, stride_s,
    sw_ptr, ss_ptr, sz_ptr, stride_sw, stride_ss, M, K, H, F, F_SHARED, stride_inter, scaling,
    BITS: tl.constexpr, GROUP: tl.constexpr, OFFSET: tl.constexpr, BLOCK_R: tl.constexpr, SUB_R: tl.constexpr,
    TILE_GROUPS: tl.constexpr, EVEN_R: tl.constexpr,
    S_BITS: tl.constexpr, S_GROUP: tl.constexpr, S_OFFSET: tl.constexpr, S_BLOCK_R: tl.constexpr,
    S_SUB_R: tl.constexpr, S_TILE_GROUPS: tl.constexpr, S_EVEN_R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr,
    SHARED: tl.constexpr, STAGES: tl.constexpr,
):
    rows = tl.arange(0, BLOCK_M)
    c = tl.arange(0, BLOCK_C)
    h = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    loaded_h = tl.minimum(h, H - 1).to(tl.int64)
    pairs = rows[:, None] * K + c[None, :]
    in_step = (rows[:, None] < M) & (c[None, :] < K)
    chosen = tl.load(ids_ptr + pairs, mask=in_step, other=-1)  # (BLOCK_M, BLOCK_C)
    weight = tl.load(weights_ptr + pairs, mask=in_step, other=0.0).to(tl.float32) * scaling
    # Each (row, choice)'s weighed result apart: (BLOCK_M, BLOCK_C, BLOCK_H).
    by_choice = tl.zeros((BLOCK_M, BLOCK_C, BLOCK_H), tl.float32)
    for b in range(0, M * K):
        expert, pair, valid, first = _expert_rows(b, ids_ptr, M, K, BLOCK_M, BLOCK_P, BLOCK_C)
        if first:
            y = _down(inter_ptr, pair, w_ptr + expert * stride_we, s_ptr + expert * stride_se,
                      z_ptr + expert * stride_se, stride_w, stride_s, F, stride_inter, loaded_h,
                      BITS, GROUP, OFFSET, BLOCK_R, SUB_R, TILE_GROUPS, EVEN_R, BLOCK_M, BLOCK_H, STAGES)
            # A select, not a product: rows that did not choose the expert read another row's values.
            by_choice += tl.where((chosen == expert)[:, :, None], weight[:, :, None] * y[:, None, :], 0.0)
    out = fixed_order_sum(tl.permute(by_choice, (0, 2, 1)), BLOCK_C)  # in choice order, whatever the layout
    if SHARED:
        shared_rows = (M * K + tl.minimum(rows, M - 1)).to(tl.int64)
        out += _down(inter_ptr, shared_rows, sw_ptr, ss_ptr, sz_ptr, stride_sw, stride_ss, F_SHARED, stride_inter,
                     loaded_h, S_BITS, S_GROUP, S_OFFSET, S_BLOCK_R, S_SUB_R, S_TILE_GROUPS, S_EVEN_R, BLOCK_M,
                     BLOCK_H, STAGES)
    tl.store(out_ptr + rows[:, None] * H + h[None, :], out.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (h < H)[None, :])


def _streaming_tile(width: int, group: int, bits: int) -> tuple:
    """(BLOCK_R, SUB_R, TILE_GROUPS, EVEN_R) of a reduction over `width` inputs (`tile_shape`; SUB_R
    only unrolls the loop)."""
    block_r, tile_groups, even = tile_shape(width, group, bits)
    return block_r, 1, tile_groups, even


def _matrix_args(routed: tuple, alone: tuple | None, width: int, s_width: int):
    """(pointers and strides, formats) of an expert stack and of the shared expert's matrix, for
    reductions over `width` (routed) and `s_width` (shared) inputs. Formats: (BITS, GROUP, OFFSET,
    BLOCK_R, SUB_R, TILE_GROUPS, EVEN_R) each. Without a shared expert its slots take the stack's own
    arguments: placeholders never read."""
    w_args, expert_strides = word_args(*routed)
    s_args = word_args(alone)[0] if alone is not None else w_args
    bits, group, offset = w_args[5:]
    s_bits, s_group, s_offset = s_args[5:]
    formats = (bits, group, offset, *_streaming_tile(width, group, bits),
               s_bits, s_group, s_offset, *_streaming_tile(s_width, s_group, s_bits))
    return (*w_args[:3], *expert_strides, *w_args[3:5], *s_args[:5]), formats


def moe_decode(x: torch.Tensor, gate_up: tuple, down: tuple, shared_gate_up: tuple | None,
               shared_down: tuple | None, weights: torch.Tensor, ids: torch.Tensor, scaling: float,
               sizes: tuple[int, int, int]) -> torch.Tensor:
    """The MoE layer's output (M, H) in x's dtype. Weights are given as (`weight_args`, expert
    strides) for the stacks and `weight_args` for the shared expert's matrices (None without one);
    sizes: (E, F, Fs). Rows are padded to DOT_ROWS whatever the step's rows (a row's bits do not
    depend on them)."""
    M, H = x.shape
    if M == 0:  # no rows: nothing to launch (the shared expert's program would read row -1)
        return torch.empty((0, H), dtype=x.dtype, device=x.device)
    K = ids.shape[1]
    _, F, f_shared = sizes
    shared = shared_gate_up is not None
    P = M * K
    # Outputs a program (tl.dot's least): 512 / 16 * 9 up and 2048 / 16 down programs at Laguna XS.2.
    up_i, down_h = 16, 16
    inter = torch.empty((P + M * shared, max(F, f_shared)), dtype=x.dtype, device=x.device)
    out = torch.empty((M, H), dtype=x.dtype, device=x.device)
    sizes = (M, K, H, F, f_shared, inter.stride(0))
    shape = dict(BLOCK_M=DOT_ROWS, BLOCK_P=triton.next_power_of_2(P), BLOCK_C=triton.next_power_of_2(K), STAGES=3)
    pointers, formats = _matrix_args(gate_up, shared_gate_up, H, H)
    _up_decode_kernel[(P + shared, triton.cdiv(max(F, f_shared), up_i))](
        x, inter, ids, *pointers, *sizes, *formats, BLOCK_I=up_i, **shape)
    pointers, formats = _matrix_args(down, shared_down, F, max(f_shared, 1))
    _down_decode_kernel[(triton.cdiv(H, down_h),)](
        inter, out, weights, ids, *pointers, *sizes, scaling, *formats, BLOCK_H=down_h, SHARED=shared, **shape)
    return out
