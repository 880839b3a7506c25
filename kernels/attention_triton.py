"""Attention of a block of query rows over one block of cached keys, in Triton (flash attention
with an online softmax), returning the partial result and its log-sum-exp like the reference.

One kernel serves decode (1 row), verify (up to 16 rows, causal inside the block) and prefill
(many rows): a program takes BLOCK_M (query row, head-of-the-group) pairs of one KV head, so the
grouped query heads share every key load (GQA). Visibility comes from the keys' absolute
positions, as in the reference, so rings, pages and host chunks need no layout of their own. For
long blocks the keys are split across programs (split-K); the splits are merged by the same
log-sum-exp rule that merges blocks (in one more launch, `_merge_kernel`), so host-streamed chunks
(KVFlash `exact`) compose with it. A tree-verify step (`tree_bits`) decides its own keys by each
query's ancestor bits, as the reference does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lucebox.kernels.gate_triton import softplus as _softplus
from lucebox.kernels.quant_triton import dot_precision


@triton.jit
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, qpos_ptr, kpos_ptr, pin_ptr, out_ptr, lse_ptr, kscale_ptr, vscale_ptr, tree_ptr,
    T, S, live, D, Hq, group, keys_per_split, window, recent, scale,
    stride_qt, stride_qh, stride_kh, stride_ks, stride_vh, stride_vs, stride_ksh, stride_vsh,
    HAS_WINDOW: tl.constexpr, HAS_PINNED: tl.constexpr, ALL_VISIBLE: tl.constexpr, INT8_KV: tl.constexpr,
    TREE: tl.constexpr, RING: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
):
    kv_head, split = tl.program_id(1), tl.program_id(2)
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # (query row, head in group) pairs
    row_ok = r < T * group
    t = (r // group).to(tl.int64)  # t * stride and (split, t, head) offsets can pass 2**31
    head = kv_head * group + r % group
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(q_ptr + t[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = tl.load(qpos_ptr + t, mask=row_ok, other=-1)
    q_last = tl.max(q_pos, axis=0)
    q_first = tl.min(tl.where(row_ok, q_pos, q_last), axis=0)
    if TREE:  # the step's own rows sit at scratch positions from its root's (row 0's) position on
        tree_start = tl.load(qpos_ptr)
        q_bits = tl.load(tree_ptr + t, mask=row_ok, other=0)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    if RING:  # the live keys: `live` slots on from the oldest visible position's, wrapping
        ring_base = tl.maximum(q_first - window + 1, 0) % S
    begin = split * keys_per_split
    end = tl.minimum(live, begin + keys_per_split)
    k_base = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + kv_head.to(tl.int64) * stride_vh
    for n0 in range(begin, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        if RING:
            n = ((ring_base + n) % S).to(tl.int32)
        k_pos = tl.load(kpos_ptr + n, mask=n_ok, other=-1)
        # Skip a tile no query can see (causal or out of window); ring slots are unordered, so
        # this looks at the tile's positions rather than its index.
        newest = tl.max(k_pos, axis=0)
        oldest = tl.min(tl.where(k_pos >= 0, k_pos, newest), axis=0)
        useful = (newest >= 0) & (oldest <= q_last)
        if TREE:  # scratch rows may sit past every query's true position
            useful = useful | (newest >= tree_start)
        if HAS_WINDOW:
            useful = useful & (newest > q_first - window)
        if useful | ALL_VISIBLE:
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(k_base + n[:, None] * stride_ks + d[None, :], mask=kv_mask, other=0)
            if INT8_KV:  # int8 rows with a float32 scale each (kernels/kv_int8.py), dequantized per tile
                k_scale = tl.load(kscale_ptr + kv_head.to(tl.int64) * stride_ksh + n, mask=n_ok, other=0.0)
                k = (k.to(tl.float32) * k_scale[:, None]).to(q.dtype)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION).to(tl.float32) * scale
            visible = row_ok[:, None] & n_ok[None, :]
            if not ALL_VISIBLE:
                visible = visible & (k_pos[None, :] >= 0) & (k_pos[None, :] <= q_pos[:, None])
                if HAS_WINDOW:
                    visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
                if HAS_PINNED:
                    pinned = tl.load(pin_ptr + n, mask=n_ok, other=0) != 0
                    visible = visible & (pinned[None, :] | (k_pos[None, :] > q_pos[:, None] - recent))
                if TREE:
                    offset = k_pos[None, :] - tree_start
                    bit = (q_bits[:, None] >> tl.minimum(tl.maximum(offset, 0), 62)) & 1
                    own = (bit == 1) & (offset <= 62) & row_ok[:, None] & n_ok[None, :]
                    visible = tl.where(offset >= 0, own, visible)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_base + n[:, None] * stride_vs + d[None, :], mask=kv_mask, other=0)
            if INT8_KV:
                v_scale = tl.load(vscale_ptr + kv_head.to(tl.int64) * stride_vsh + n, mask=n_ok, other=0.0)
                v = (v.to(tl.float32) * v_scale[:, None]).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION).to(tl.float32)
            m_i = m_new
    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
    rows_out = (split * T + t) * Hq + head  # out is (split, T, Hq, D)
    tl.store(out_ptr + rows_out[:, None] * D + d[None, :], out, mask=row_ok[:, None] & d_ok[None, :])
    tl.store(lse_ptr + rows_out, lse, mask=row_ok)


@triton.jit
def _merge_kernel(out_ptr, lse_ptr, merged_ptr, total_ptr, gate_ptr, rows, splits, D, Hq, stride_gt,
                  GATE: tl.constexpr, GATE_PER_HEAD: tl.constexpr, BLOCK_D: tl.constexpr):
    """One (query row, head) per program: the log-sum-exp merge of its `splits` partial results
    (out (splits, rows, D) float32, lse (splits, rows)) into merged (rows, D) and total (rows,);
    a row no split saw gets zeros and -inf, as `merge_stacked` gives. With GATE, merged is then
    multiplied by softplus of its gate logits (one per head, or one per element): Laguna's output
    gate, here rather than in a launch of its own."""
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    top = tl.full((), float("-inf"), tl.float32)
    for s in range(splits):
        top = tl.maximum(top, tl.load(lse_ptr + s * rows + row))
    safe_top = tl.where(top == float("-inf"), 0.0, top)
    weight_sum = tl.zeros((), tl.float32)
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for s in range(splits):
        lse = tl.load(lse_ptr + s * rows + row)
        w = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - safe_top))
        part = tl.load(out_ptr + (s * rows + row) * D + d, mask=d_ok, other=0.0)
        acc += tl.where(w > 0, w * part, 0.0)  # a split that saw nothing may hold anything
        weight_sum += w
    seen = weight_sum > 0
    merged = acc / tl.where(seen, weight_sum, 1.0)
    if GATE:
        t, head = row // Hq, row % Hq
        if GATE_PER_HEAD:
            g = tl.load(gate_ptr + t * stride_gt + head).to(tl.float32)
        else:
            g = tl.load(gate_ptr + t * stride_gt + head * D + d, mask=d_ok, other=0.0).to(tl.float32)
        # Rounded to the output's dtype first, as `kernels.gate` multiplies: out * softplus(g).to(dtype)
        merged = merged.to(merged_ptr.dtype.element_ty).to(tl.float32) * \
            _softplus(g).to(merged_ptr.dtype.element_ty).to(tl.float32)
    tl.store(merged_ptr + row * D + d, merged.to(merged_ptr.dtype.element_ty), mask=d_ok)
    tl.store(total_ptr + row, tl.where(seen, top + tl.log(tl.where(seen, weight_sum, 1.0)), float("-inf")))


def merge_splits(out: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype,
                 gate: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (T, Hq, D) in `dtype`, lse (T, Hq) float32) of split-K partials out (splits, T, Hq, D)
    and lse (splits, T, Hq), both float32 and contiguous: one launch instead of ~7 torch ops. With
    `gate` (T, Hq) or (T, Hq*D) logits, unit stride along features, out is gated by their softplus."""
    splits, T, Hq, D = out.shape
    merged = torch.empty((T, Hq, D), dtype=dtype, device=out.device)
    total = torch.empty((T, Hq), dtype=torch.float32, device=out.device)
    rows = T * Hq
    if gate is not None and gate.stride(1) != 1:
        raise ValueError("the output gate's logits need unit stride along their features")
    if rows:
        _merge_kernel[(rows,)](out, lse, merged, total, gate if gate is not None else lse, rows, splits, D, Hq,
                               gate.stride(0) if gate is not None else 0, GATE=gate is not None,
                               GATE_PER_HEAD=gate is not None and gate.shape[1] == Hq,
                               BLOCK_D=triton.next_power_of_2(D))
    return merged, total


def _splits(S: int, programs: int) -> int:
    """Split long key blocks until there are about 512 programs (a few per SM, so every SM keeps
    loads in flight), each with at least 256 keys."""
    if programs >= 512:
        return 1
    return max(1, min(triton.cdiv(512, programs), S // 256))


def attention_partial(
    q: torch.Tensor,  # (T, Hq, D), RoPE applied
    k: torch.Tensor,  # (KV, S, D)
    v: torch.Tensor,  # (KV, S, D)
    q_positions: torch.Tensor,  # (T,)
    k_positions: torch.Tensor,  # (S,), -1 for empty slots
    scale: float,
    window: int | None = None,
    pinned: torch.Tensor | None = None,
    recent: int = 0,
    all_visible: bool = False,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    tree_bits: torch.Tensor | None = None,
    splits: int | None = None,
    gate: torch.Tensor | None = None,
    ring: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As `kernels.attention.attention_partial`: (out (T, Hq, D), lse (T, Hq) float32). With
    `gate`, the merge launch runs even for one split: it applies the gate (and the cast). With
    `ring` and a window, the splits share the window + T slots that can hold visible keys, found
    from the queries' positions on the device, rather than the whole ring."""
    T, Hq, D = q.shape
    kv_heads, S, _ = k.shape
    group = Hq // kv_heads
    if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("attention needs unit stride along the head dimension")
    block_m = 16 if T * group <= 16 else 64
    m_blocks = triton.cdiv(T * group, block_m)
    live = min(S, window + T) if ring and window else S
    splits = splits or _splits(live, m_blocks * kv_heads)
    keys_per_split = triton.cdiv(triton.cdiv(live, splits), 64) * 64
    splits = triton.cdiv(live, keys_per_split) if live else 1
    out = torch.empty((splits, T, Hq, D), dtype=torch.float32, device=q.device)
    lse = torch.empty((splits, T, Hq), dtype=torch.float32, device=q.device)
    q_positions, k_positions = q_positions.contiguous(), k_positions.contiguous()
    pin = pinned.contiguous() if pinned is not None else k_positions
    # 4-byte keys take half-width tiles and two pipeline stages: three stages of 64 float32 K and V
    # rows of 128 would not fit an RTX 3090's shared memory (tests/kernel_compile.py checks it).
    # int8 keys are dequantized into the query's dtype, which is what the tiles then hold.
    wide = (q if k_scale is not None else k).element_size() <= 2
    int8 = k_scale is not None
    if int8 and (k_scale.stride(1) != 1 or v_scale.stride(1) != 1):
        raise ValueError("int8 K/V scales need unit stride along the keys")
    scales = (k_scale, v_scale) if int8 else (lse, lse)  # valid pointers that are never read
    _attention_kernel[(m_blocks, kv_heads, splits)](
        q, k, v, q_positions, k_positions, pin, out, lse, *scales,
        tree_bits.contiguous() if tree_bits is not None else k_positions,  # a valid pointer, unread without TREE
        T, S, live, D, Hq, group, keys_per_split, window or 0, recent, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        scales[0].stride(0), scales[1].stride(0),
        HAS_WINDOW=window is not None, HAS_PINNED=pinned is not None, ALL_VISIBLE=all_visible, INT8_KV=int8,
        TREE=tree_bits is not None, RING=live < S,
        BLOCK_M=block_m, BLOCK_N=64 if wide else 32, BLOCK_D=triton.next_power_of_2(D),
        PRECISION=dot_precision(q.dtype), num_stages=3 if wide else 2,
    )
    if splits == 1 and gate is None:
        return out[0].to(q.dtype), lse[0]
    return merge_splits(out, lse, q.dtype, gate)
