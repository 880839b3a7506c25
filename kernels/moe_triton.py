"""Fused MoE expert GEMMs in Triton: only the chosen experts' weights are read, each once per
block of rows that chose it.

Decode and verify steps (at most DEDUP_ROWS rows) take `moe_decode_triton` (two launches, the
layer's output written by the second; `quant_triton.streamed`); wider steps take the prefill layout
(SORTED) here:
pairs (row, choice j) sorted by expert and cut into blocks of BLOCK_M rows of one expert
(moe-align style), a grouped GEMM over experts; the block table is built on the device with a
fixed upper bound on the block count, so it needs no host sync either.

- `_up_kernel`: for one block and a tile of its intermediate features, gate and up projections
  of the block's rows, then silu(gate) * up -> `inter[pair]`;
- `_down_kernel`: for one block and a tile of hidden features, the down projection of those
  pairs, times the routing weight -> `out_pairs[pair]`; the k choices of a row are summed after,
  in a fixed order, so results are deterministic (no atomics).

Shapes: M rows, H hidden features, E experts of F intermediate features, K choices per row.

A shared expert (Laguna, Qwen2-MoE style) rides in the same launches: a few more blocks whose
rows are all M rows, with weight 1, reading the shared weights instead of an expert's, so it
costs no extra launch and overlaps with the routed experts. Its results land in M extra pair
rows after the M * K routed ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lucebox.kernels.moe_decode_triton import DEDUP_ROWS, moe_decode
from lucebox.kernels.quant import Weight
from lucebox.kernels.quant_triton import dot_precision, expert_strides, load_weight_tile, streamed, weight_args


@triton.jit
def _block_rows(b, order_ptr, block_expert_ptr, block_start_ptr, block_rows_ptr, M, K, BLOCK_M: tl.constexpr):
    """(expert, pair index (BLOCK_M,), token (BLOCK_M,), row mask (BLOCK_M,), active, shared) of
    block b. Pairs m * K + j are routed choices; pairs M * K + m are the shared expert's rows."""
    r = tl.arange(0, BLOCK_M)
    P = M * K
    expert = tl.load(block_expert_ptr + b)
    shared = expert < 0
    rows = tl.load(block_rows_ptr + b)
    active = rows > 0
    valid = r < rows
    pair = tl.load(order_ptr + tl.load(block_start_ptr + b) + r, mask=valid, other=0)
    token = tl.where(pair >= P, pair - P, pair // K)
    # int64 offsets: pair * H passes 2**31 for prefill chunks of ~100K rows at Laguna widths.
    return tl.maximum(expert, 0).to(tl.int64), pair.to(tl.int64), token.to(tl.int64), valid, active, shared


@triton.jit
def _weight_tile(shared, expert, rows, cols, mask,
                 w_ptr, s_ptr, z_ptr, stride_we, stride_se, stride_w, stride_s,
                 sw_ptr, ss_ptr, sz_ptr, stride_sw, stride_ss,
                 BITS: tl.constexpr, GROUP: tl.constexpr, OFFSET: tl.constexpr,
                 S_BITS: tl.constexpr, S_GROUP: tl.constexpr, S_OFFSET: tl.constexpr):
    """A float32 tile of the shared expert's weight or of `expert`'s (plain or quantized)."""
    if shared:
        tile = load_weight_tile(sw_ptr, ss_ptr, sz_ptr, rows, cols, mask, stride_sw, stride_ss,
                                S_BITS, S_GROUP, S_OFFSET)
    else:
        tile = load_weight_tile(w_ptr + expert * stride_we, s_ptr + expert * stride_se, z_ptr + expert * stride_se,
                                rows, cols, mask, stride_w, stride_s, BITS, GROUP, OFFSET)
    return tile


@triton.jit
def _up_kernel(
    x_ptr, inter_ptr, order_ptr, block_expert_ptr, block_start_ptr, block_rows_ptr,
    w_ptr, s_ptr, z_ptr, stride_we, stride_se, stride_w, stride_s,
    sw_ptr, ss_ptr, sz_ptr, stride_sw, stride_ss,
    M, K, H, F, F_SHARED, stride_inter,
    BITS: tl.constexpr, GROUP: tl.constexpr, OFFSET: tl.constexpr,
    S_BITS: tl.constexpr, S_GROUP: tl.constexpr, S_OFFSET: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr,
):
    expert, pair, token, valid, active, shared = _block_rows(
        tl.program_id(0), order_ptr, block_expert_ptr, block_start_ptr, block_rows_ptr, M, K, BLOCK_M)
    width = tl.where(shared, F_SHARED, F)
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    i_ok = i < width
    if active & (tl.program_id(1) * BLOCK_I < width):
        gate = tl.zeros((BLOCK_M, BLOCK_I), tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_I), tl.float32)
        for h0 in range(0, H, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            h_ok = h < H
            x = tl.load(x_ptr + token[:, None] * H + h[None, :], mask=valid[:, None] & h_ok[None, :], other=0.0)
            w_mask = i_ok[:, None] & h_ok[None, :]
            w_gate = _weight_tile(shared, expert, i, h, w_mask, w_ptr, s_ptr, z_ptr, stride_we, stride_se,
                                  stride_w, stride_s, sw_ptr, ss_ptr, sz_ptr, stride_sw, stride_ss,
                                  BITS, GROUP, OFFSET, S_BITS, S_GROUP, S_OFFSET)
            w_up = _weight_tile(shared, expert, width + i, h, w_mask, w_ptr, s_ptr, z_ptr, stride_we, stride_se,
                                stride_w, stride_s, sw_ptr, ss_ptr, sz_ptr, stride_sw, stride_ss,
                                BITS, GROUP, OFFSET, S_BITS, S_GROUP, S_OFFSET)
            gate += tl.dot(x, tl.trans(w_gate.to(x.dtype)), input_precision=PRECISION)
            up += tl.dot(x, tl.trans(w_up.to(x.dtype)), input_precision=PRECISION)
        act = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(inter_ptr + pair[:, None] * stride_inter + i[None, :], act.to(inter_ptr.dtype.element_ty),
                 mask=valid[:, None] & i_ok[None, :])


@triton.jit
def _down_kernel(
    inter_ptr, out_ptr, weights_ptr, order_ptr, block_expert_ptr, block_start_ptr, block_rows_ptr,
    w_ptr, s_ptr, z_ptr, stride_we, stride_se, stride_w, stride_s,
    sw_ptr, ss_ptr, sz_ptr, stride_sw, stride_ss,
    M, K, H, F, F_SHARED, stride_inter, scaling,
    BITS: tl.constexpr, GROUP: tl.constexpr, OFFSET: tl.constexpr,
    S_BITS: tl.constexpr, S_GROUP: tl.constexpr, S_OFFSET: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr, PRECISION: tl.constexpr,
):
    expert, pair, token, valid, active, shared = _block_rows(
        tl.program_id(0), order_ptr, block_expert_ptr, block_start_ptr, block_rows_ptr, M, K, BLOCK_M)
    if active:
        width = tl.where(shared, F_SHARED, F)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        h_ok = h < H
        acc = tl.zeros((BLOCK_M, BLOCK_H), tl.float32)
        for i0 in range(0, width, BLOCK_I):
            i = i0 + tl.arange(0, BLOCK_I)
            i_ok = i < width
            a = tl.load(inter_ptr + pair[:, None] * stride_inter + i[None, :], mask=valid[:, None] & i_ok[None, :],
                        other=0.0)
            w = _weight_tile(shared, expert, h, i, h_ok[:, None] & i_ok[None, :], w_ptr, s_ptr, z_ptr, stride_we,
                             stride_se, stride_w, stride_s, sw_ptr, ss_ptr, sz_ptr, stride_sw, stride_ss,
                             BITS, GROUP, OFFSET, S_BITS, S_GROUP, S_OFFSET)
            acc += tl.dot(a, tl.trans(w.to(a.dtype)), input_precision=PRECISION)
        routed = pair < M * K
        weight = tl.load(weights_ptr + pair, mask=valid & routed, other=0.0).to(tl.float32) * scaling
        weight = tl.where(routed, weight, 1.0)  # the shared expert is not weighted
        tl.store(out_ptr + pair[:, None] * H + h[None, :], acc * weight[:, None], mask=valid[:, None] & h_ok[None, :])


def _sorted_blocks(ids: torch.Tensor, num_experts: int, block_m: int, shared_rows: int = 0):
    """Device-side block table of the prefill layout: pairs sorted by expert, each expert's run
    cut into blocks of block_m, then blocks of the shared expert's `shared_rows` rows (expert
    -1). Returns (order, block_expert, block_start, block_rows); unused blocks (the count is an
    upper bound, so no host sync) have 0 rows."""
    flat = ids.reshape(-1)
    pairs = flat.numel()
    order = torch.argsort(flat, stable=True).to(torch.int32)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    blocks = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)
    b = torch.arange(pairs // block_m + min(num_experts, pairs), device=ids.device)
    expert = torch.searchsorted(block_end, b, right=True)
    used = expert < num_experts
    expert = expert.clamp_max(num_experts - 1)
    nth = b - (block_end[expert] - blocks[expert])  # which block of its expert's run
    start = torch.cumsum(counts, 0)[expert] - counts[expert] + nth * block_m
    rows = torch.where(used, (counts[expert] - nth * block_m).clamp(0, block_m), 0)
    if shared_rows:
        first = torch.arange(0, shared_rows, block_m, device=ids.device)
        order = torch.cat((order, torch.arange(pairs, pairs + shared_rows, dtype=torch.int32, device=ids.device)))
        expert = torch.cat((expert, torch.full_like(first, -1)))
        start = torch.cat((start, pairs + first))
        rows = torch.cat((rows, (shared_rows - first).clamp_max(block_m)))
    return order, expert.to(torch.int32), start.to(torch.int32), rows.to(torch.int32)


def _weight_args(experts: Weight, shared_weight: Weight | None, shared: bool) -> tuple:
    """Pointers and strides of an expert stack and of the shared expert's matrix (the first
    expert's when there is none: a placeholder the kernel never reads)."""
    w_ptr, s_ptr, z_ptr, stride_w, stride_s = weight_args(experts)[:5]
    sw_ptr, ss_ptr, sz_ptr, stride_sw, stride_ss = weight_args(shared_weight if shared else experts[0])[:5]
    return (w_ptr, s_ptr, z_ptr, *expert_strides(experts), stride_w, stride_s,
            sw_ptr, ss_ptr, sz_ptr, stride_sw, stride_ss)


def _weight_flags(experts: Weight, shared_weight: Weight | None, shared: bool) -> tuple:
    """(BITS, GROUP, OFFSET) of the experts, then of the shared expert."""
    return (*weight_args(experts)[5:], *weight_args(shared_weight if shared else experts[0])[5:])


def moe_experts(
    x: torch.Tensor,  # (M, H)
    gate_up: Weight,  # (E, 2F, H)
    down: Weight,  # (E, H, F)
    weights: torch.Tensor,  # (M, k)
    ids: torch.Tensor,  # (M, k)
    scaling: float = 1.0,
    shared_gate_up: Weight | None = None,  # (2Fs, H)
    shared_down: Weight | None = None,  # (H, Fs)
    layout_of: tuple[int, int] | None = None,
) -> torch.Tensor:  # (M, H)
    """As `kernels.moe.moe_experts` (the layout, and so its tiles, follows `layout_of`'s rows)."""
    M, H = x.shape
    E, K, F = gate_up.shape[0], ids.shape[1], down.shape[2]
    P = M * K
    shared = shared_gate_up is not None
    f_shared = shared_down.shape[1] if shared else 0
    x = x.contiguous()
    ids = ids.contiguous()
    rows = layout_of[0] if layout_of else M
    if rows <= DEDUP_ROWS:
        routed = [(weight_args(w), expert_strides(w)) for w in (streamed(gate_up, H), streamed(down, F))]
        alone = [weight_args(streamed(w, width)) if shared else None
                 for w, width in ((shared_gate_up, H), (shared_down, f_shared))]
        return moe_decode(x, *routed, *alone, weights.contiguous(), ids, scaling, (E, F, f_shared))
    block_m = 64
    table = _sorted_blocks(ids, E, block_m, M if shared else 0)
    n_blocks = table[1].numel()
    width = max(F, f_shared)
    inter = torch.empty((P + M * shared, width), dtype=x.dtype, device=x.device)
    out_pairs = torch.empty((P + M * shared, H), dtype=torch.float32, device=x.device)
    shape = dict(BLOCK_M=block_m, PRECISION=dot_precision(x.dtype))
    # Square 64-wide tiles for the tensor cores. Untuned guesses until measured on a GPU.
    up_i, up_h, down_h, down_i = 64, 64, 64, 64
    sizes = (M, K, H, F, f_shared, width)
    _up_kernel[(n_blocks, triton.cdiv(width, up_i))](
        x, inter, *table, *_weight_args(gate_up, shared_gate_up, shared), *sizes,
        *_weight_flags(gate_up, shared_gate_up, shared), BLOCK_I=up_i, BLOCK_H=up_h, **shape)
    _down_kernel[(n_blocks, triton.cdiv(H, down_h))](
        inter, out_pairs, weights.contiguous(), *table, *_weight_args(down, shared_down, shared), *sizes, scaling,
        *_weight_flags(down, shared_down, shared), BLOCK_I=down_i, BLOCK_H=down_h, **shape)
    out = out_pairs[:P].view(M, K, H).sum(1)
    if shared:
        out += out_pairs[P:]
    return out.to(x.dtype)
