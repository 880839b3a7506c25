"""MoE experts for decode and verify steps (at most `DEDUP_ROWS` rows, the DEDUP layout): two
launches on the tensor cores, weight tiles dequantized in registers as the GEMV does
(`gemv_triton.dequantized_tile`), rows padded to DOT_ROWS whatever the step's rows.

- `_up_decode_kernel`: one program per (routed pair, tile of intermediate features), plus one per
  tile for the shared expert. A pair whose expert already appears in an earlier pair does nothing;
  the others gather every row that chose their expert, so each chosen expert is read once for all
  of them. silu(gate) * up * the row's routing weight -> `inter[pair]` (pair m * K + j; the shared
  expert's rows, weight 1, at M * K + m). Each (choice position, expert) key's first pair also
  files it in the step's slot table (`_file_slot`): the keys in ascending order (by position,
  then expert), and per slot each row's pair (or inter's last row, zeros, for rows that did not
  choose that expert at that position).
- `_down_decode_kernel`: one program per tile of hidden features, one flat loop over every
  (slot, tile of intermediate features), so the pipeline streams the next expert's tiles while
  it multiplies the current one's (never a round trip per expert); then the shared expert. Every
  row's sum runs into one accumulator in a fixed order: its experts in choice order (a row has
  one expert a position), then the shared expert; a slot a row did not choose adds exact zeros
  (its inputs are the zero row). So a row's bits depend neither on the step's other rows nor on
  how experts are numbered (an expert cache renumbers them by slot). An expert two rows chose at
  different positions is read once a position (at one row, every expert once).
  It writes the layer's output (M, H) in the activation dtype.

Shapes: M rows, H hidden features, E experts of F intermediate features (Fs for the shared
expert), K choices per row. No host sync: the launches fit in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lucebox.kernels.gemv_triton import DOT_ROWS, dequantized_tile, dot_tile, load_input_tile, tile_shape, word_args

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
def _slot(b, ids_ptr, P, K, BLOCK_P: tl.constexpr):
    """(first, slot, slots) of routed pair b by its key (choice position, expert): whether b is
    the key's first pair, how many distinct keys of the step's P pairs are smaller, and how many
    there are. Sixteen pairs at a time against all (registers)."""
    q = tl.arange(0, BLOCK_P)
    keys_q = tl.where(q < P, (q % K) * (1 << 20) + tl.load(ids_ptr + q, mask=q < P, other=0), -1)
    key = (b % K) * (1 << 20) + tl.load(ids_ptr + b)
    smaller = 0
    distinct = 0
    CHUNK: tl.constexpr = 16 if BLOCK_P > 16 else BLOCK_P
    for start in tl.static_range(0, BLOCK_P, CHUNK):
        p = start + tl.arange(0, CHUNK)
        keys_p = tl.where(p < P, (p % K) * (1 << 20) + tl.load(ids_ptr + p, mask=p < P, other=0), -1)
        repeated = tl.sum(((keys_q[None, :] == keys_p[:, None]) & (q[None, :] < p[:, None])).to(tl.int32), axis=1)
        first = (p < P) & (repeated == 0)
        smaller += tl.sum((first & (keys_p < key)).to(tl.int32), axis=0)
        distinct += tl.sum(first.to(tl.int32), axis=0)
    first_b = tl.sum(((keys_q == key) & (q < b)).to(tl.int32), axis=0) == 0
    return first_b, smaller, distinct


@triton.jit
def _file_slot(slots_ptr, b, expert, ids_ptr, M, K, zero_row, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr):
    """Files pair b's (choice position, expert) in the slot table if b is its first pair: the
    expert, and for each row the pair through which it chose the expert at that position (else
    inter's zero row); pair 0 also files how many slots there are."""
    first, slot, slots = _slot(b, ids_ptr, M * K, K, BLOCK_P)
    tl.store(slots_ptr, slots, mask=b == 0)
    if first:
        tl.store(slots_ptr + 1 + slot, expert.to(tl.int32))
        r = tl.arange(0, BLOCK_M)
        pair = r * K + b % K
        hit = tl.load(ids_ptr + pair, mask=r < M, other=-1) == expert
        tl.store(slots_ptr + 1 + BLOCK_P + slot * BLOCK_M + r, tl.where(hit, pair, zero_row).to(tl.int32))


@triton.jit
def _gate_up(x_ptr, inter_ptr, pair, valid, row_weight, w_ptr, s_ptr, z_ptr, stride_w, stride_s, M, H, width,
             stride_inter, BITS: tl.constexpr, GROUP: tl.constexpr, OFFSET: tl.constexpr, BLOCK_R: tl.constexpr,
             TILE_GROUPS: tl.constexpr, EVEN_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr,
             STAGES: tl.constexpr):
    """inter[pair, tile] = silu(gate) * up * row_weight for one matrix's tile of BLOCK_I intermediate
    features."""
    rows = tl.minimum(tl.arange(0, BLOCK_M), M - 1).to(tl.int64)
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    loaded_i = tl.minimum(i, width - 1).to(tl.int64)
    gate = tl.zeros((BLOCK_M, BLOCK_I), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_I), dtype=tl.float32)
    for h in tl.range(0, H, BLOCK_R, num_stages=STAGES):
        x = load_input_tile(x_ptr, rows, H, h, H, BLOCK_R, EVEN_R)
        gate = dot_tile(x, dequantized_tile(w_ptr, s_ptr, z_ptr, loaded_i, h, H, stride_w, stride_s, BITS, GROUP,
                                            OFFSET, BLOCK_I, BLOCK_R, TILE_GROUPS, EVEN_R, x.dtype), gate)
        up = dot_tile(x, dequantized_tile(w_ptr, s_ptr, z_ptr, width + loaded_i, h, H, stride_w, stride_s, BITS,
                                          GROUP, OFFSET, BLOCK_I, BLOCK_R, TILE_GROUPS, EVEN_R, x.dtype), up)
    act = gate / (1.0 + tl.exp(-gate)) * up * row_weight[:, None]
    tl.store(inter_ptr + pair[:, None] * stride_inter + i[None, :], act.to(inter_ptr.dtype.element_ty),
             mask=valid[:, None] & (i < width)[None, :])


@triton.jit
def _up_decode_kernel(
    x_ptr, inter_ptr, slots_ptr, ids_ptr, weights_ptr, w_ptr, s_ptr, z_ptr, stride_we, stride_se, stride_w, stride_s,
    sw_ptr, ss_ptr, sz_ptr, stride_sw, stride_ss, M, K, H, F, F_SHARED, stride_inter, scaling,
    BITS: tl.constexpr, GROUP: tl.constexpr, OFFSET: tl.constexpr, BLOCK_R: tl.constexpr,
    TILE_GROUPS: tl.constexpr, EVEN_R: tl.constexpr,
    S_BITS: tl.constexpr, S_GROUP: tl.constexpr, S_OFFSET: tl.constexpr, S_BLOCK_R: tl.constexpr,
    S_TILE_GROUPS: tl.constexpr, S_EVEN_R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_I: tl.constexpr,
    SHARED: tl.constexpr, STAGES: tl.constexpr,
):
    b = tl.program_id(0)
    P = M * K
    tile_start = tl.program_id(1) * BLOCK_I
    if b == 0:  # inter's zero row (see the module doc), a tile a program
        i = tile_start + tl.arange(0, BLOCK_I)
        tl.store(inter_ptr + (P + M * SHARED) * stride_inter + i, tl.zeros((BLOCK_I,), tl.float32).to(
            inter_ptr.dtype.element_ty), mask=i < stride_inter)
    # The matrix is chosen before the K loop: each branch runs one loop, in its own weight format.
    if b < P:
        expert, pair, valid, first = _expert_rows(b, ids_ptr, M, K, BLOCK_M, BLOCK_P, BLOCK_C)
        if tl.program_id(1) == 0:  # the slot table (see the module doc)
            _file_slot(slots_ptr, b, expert, ids_ptr, M, K, P + M * SHARED, BLOCK_M, BLOCK_P)
        if first & (tile_start < F):
            row_weight = tl.load(weights_ptr + pair, mask=valid, other=0.0).to(tl.float32) * scaling
            _gate_up(x_ptr, inter_ptr, pair, valid, row_weight, w_ptr + expert * stride_we,
                     s_ptr + expert * stride_se, z_ptr + expert * stride_se, stride_w, stride_s, M, H, F, stride_inter,
                     BITS, GROUP, OFFSET, BLOCK_R, TILE_GROUPS, EVEN_R, BLOCK_M, BLOCK_I, STAGES)
    elif tile_start < F_SHARED:
        rows = tl.arange(0, BLOCK_M)
        _gate_up(x_ptr, inter_ptr, P + rows.to(tl.int64), rows < M, tl.full((BLOCK_M,), 1.0, tl.float32), sw_ptr,
                 ss_ptr, sz_ptr, stride_sw, stride_ss, M, H, F_SHARED, stride_inter, S_BITS, S_GROUP, S_OFFSET,
                 S_BLOCK_R, S_TILE_GROUPS, S_EVEN_R, BLOCK_M, BLOCK_I, STAGES)


@triton.jit
def _down_decode_kernel(
    inter_ptr, out_ptr, slots_ptr, w_ptr, s_ptr, z_ptr, stride_we, stride_se, stride_w, stride_s,
    sw_ptr, ss_ptr, sz_ptr, stride_sw, stride_ss, M, K, H, F, F_SHARED, stride_inter,
    BITS: tl.constexpr, GROUP: tl.constexpr, OFFSET: tl.constexpr, BLOCK_R: tl.constexpr,
    TILE_GROUPS: tl.constexpr, EVEN_R: tl.constexpr,
    S_BITS: tl.constexpr, S_GROUP: tl.constexpr, S_OFFSET: tl.constexpr, S_BLOCK_R: tl.constexpr,
    S_TILE_GROUPS: tl.constexpr, S_EVEN_R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr, TILES_R: tl.constexpr,
    SHARED: tl.constexpr, STAGES: tl.constexpr,
):
    rows = tl.arange(0, BLOCK_M)
    h = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    loaded_h = tl.minimum(h, H - 1).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_H), dtype=tl.float32)
    # One flat loop over (slot, tile): TILES_R tiles of BLOCK_R intermediate features an expert.
    for t in tl.range(0, tl.load(slots_ptr) * TILES_R, num_stages=STAGES):
        slot = t // TILES_R
        i = (t % TILES_R) * BLOCK_R
        expert = tl.load(slots_ptr + 1 + slot).to(tl.int64)
        a = load_input_tile(inter_ptr, tl.load(slots_ptr + 1 + BLOCK_P + slot * BLOCK_M + rows), stride_inter, i, F,
                            BLOCK_R, EVEN_R)
        acc = dot_tile(a, dequantized_tile(w_ptr + expert * stride_we, s_ptr + expert * stride_se,
                                           z_ptr + expert * stride_se, loaded_h, i, F, stride_w, stride_s, BITS, GROUP,
                                           OFFSET, BLOCK_H, BLOCK_R, TILE_GROUPS, EVEN_R, a.dtype), acc)
    if SHARED:
        shared_rows = (M * K + tl.minimum(rows, M - 1)).to(tl.int64)
        for i in tl.range(0, F_SHARED, S_BLOCK_R, num_stages=STAGES):
            a = load_input_tile(inter_ptr, shared_rows, stride_inter, i, F_SHARED, S_BLOCK_R, S_EVEN_R)
            acc = dot_tile(a, dequantized_tile(sw_ptr, ss_ptr, sz_ptr, loaded_h, i, F_SHARED, stride_sw, stride_ss,
                                               S_BITS, S_GROUP, S_OFFSET, BLOCK_H, S_BLOCK_R, S_TILE_GROUPS,
                                               S_EVEN_R, a.dtype), acc)
    tl.store(out_ptr + rows[:, None] * H + h[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (h < H)[None, :])


# The down kernel's int4 tiles are twice the GEMV's: its loop also gathers each slot's rows, a cost
# per iteration that wider tiles spread over more bytes.
DOWN_TILE_INPUTS = {4: 512}


def _matrix_args(routed: tuple, alone: tuple | None, width: int, s_width: int,
                 inputs: dict[int, int] | None = None):
    """(pointers and strides, formats) of an expert stack and of the shared expert's matrix, for
    reductions over `width` (routed) and `s_width` (shared) inputs. Formats: (BITS, GROUP, OFFSET,
    BLOCK_R, TILE_GROUPS, EVEN_R) each (`tile_shape`). Without a shared expert its slots take the
    stack's own arguments: placeholders never read."""
    w_args, expert_strides = word_args(*routed)
    s_args = word_args(alone)[0] if alone is not None else w_args
    bits, group, offset = w_args[5:]
    s_bits, s_group, s_offset = s_args[5:]
    formats = (bits, group, offset, *tile_shape(width, group, bits, inputs),
               s_bits, s_group, s_offset, *tile_shape(s_width, s_group, s_bits, inputs))
    return (*w_args[:3], *expert_strides, *w_args[3:5], *s_args[:5]), formats


def moe_decode(x: torch.Tensor, gate_up: tuple, down: tuple, shared_gate_up: tuple | None,
               shared_down: tuple | None, weights: torch.Tensor, ids: torch.Tensor, scaling: float,
               sizes: tuple[int, int, int]) -> torch.Tensor:
    """The MoE layer's output (M, H) in x's dtype. Weights are given as (`weight_args`, expert
    strides) for the stacks and `weight_args` for the shared expert's matrices (None without one);
    sizes: (E, F, Fs). Rows are padded to DOT_ROWS whatever the step's rows."""
    M, H = x.shape
    if M == 0:  # no rows: nothing to launch (the shared expert's program would read row -1)
        return torch.empty((0, H), dtype=x.dtype, device=x.device)
    K = ids.shape[1]
    _, F, f_shared = sizes
    shared = shared_gate_up is not None
    P = M * K
    block_p = triton.next_power_of_2(P)
    # Outputs a program (tl.dot's least): 512 / 16 * 9 up and 2048 / 16 down programs at Laguna XS.2.
    up_i, down_h = 16, 16
    inter = torch.empty((P + M * shared + 1, max(F, f_shared)), dtype=x.dtype, device=x.device)  # + the zero row
    slots = torch.empty(1 + block_p * (1 + DOT_ROWS), dtype=torch.int32, device=x.device)  # see the module doc
    out = torch.empty((M, H), dtype=x.dtype, device=x.device)
    sizes = (M, K, H, F, f_shared, inter.stride(0))
    shape = dict(BLOCK_M=DOT_ROWS, BLOCK_P=block_p, STAGES=3)
    pointers, formats = _matrix_args(gate_up, shared_gate_up, H, H)
    _up_decode_kernel[(P + shared, triton.cdiv(max(F, f_shared), up_i))](
        x, inter, slots, ids, weights, *pointers, *sizes, scaling, *formats, BLOCK_C=triton.next_power_of_2(K),
        BLOCK_I=up_i, SHARED=shared, **shape)
    # float32 inputs (the CPU tests' models) keep the GEMV's tiles: 512 of theirs overflow sm_86's shared memory.
    wide = DOWN_TILE_INPUTS if x.element_size() <= 2 else None
    pointers, formats = _matrix_args(down, shared_down, F, max(f_shared, 1), wide)
    _down_decode_kernel[(triton.cdiv(H, down_h),)](
        inter, out, slots, *pointers, *sizes, *formats, BLOCK_H=down_h, TILES_R=triton.cdiv(F, formats[3]),
        SHARED=shared, **shape)
    return out
