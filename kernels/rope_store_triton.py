"""A decode step's q/k RMSNorm, RoPE and K/V cache store in one Triton launch (`kernels.rope_store`).

A program takes one (token, head) row: a query head's is normed, rotated and written out; a KV
head's key is normed and rotated and stored with its value at the slot the cache's `RowTable`
gives the token's row position, and KV head 0 then stores the position. Angles are computed in
float32 from the positions and frequencies, as `rope_triton` does; the norm rounds where
`norm_triton` does, so the fused and unfused Triton paths agree.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _norm_rope_store_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, rowpos_ptr, freq_ptr, qw_ptr, kw_ptr, qout_ptr,
    kcache_ptr, vcache_ptr, cachepos_ptr, table_ptr,
    Hq, D, chunk, table_len, eps, scaling,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_kch, stride_vch,
    NORM: tl.constexpr, HALF: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    is_q = h < Hq
    kv = tl.maximum(h - Hq, 0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    # Rotate-half: feature i < HALF pairs with i + HALF (sign -1), i < 2 HALF with i - HALF.
    partner = tl.where(d < HALF, d + HALF, tl.where(d < 2 * HALF, d - HALF, d))
    if is_q:
        src, w_ptr = q_ptr + t * stride_qt + h * stride_qh, qw_ptr
    else:
        src, w_ptr = k_ptr + t * stride_kt + kv * stride_kh, kw_ptr
    x = tl.load(src + d, mask=d_ok, other=0.0)
    x32 = x.to(tl.float32)
    x_partner = tl.load(src + partner, mask=d_ok, other=0.0).to(tl.float32)
    if NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / D + eps)
        w = tl.load(w_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
        w_partner = tl.load(w_ptr + partner, mask=d_ok, other=0.0).to(tl.float32)
        x32 = ((x32 * rstd).to(x.dtype).to(tl.float32) * w).to(x.dtype).to(tl.float32)
        x_partner = ((x_partner * rstd).to(x.dtype).to(tl.float32) * w_partner).to(x.dtype).to(tl.float32)
    rotated = d < 2 * HALF
    angle = tl.load(pos_ptr + t).to(tl.float32) * tl.load(freq_ptr + d % HALF, mask=rotated, other=0.0)
    sign = tl.where(d < HALF, -1.0, 1.0)
    y = tl.where(rotated, x32 * (tl.cos(angle) * scaling) + sign * x_partner * (tl.sin(angle) * scaling), x32)
    if is_q:
        tl.store(qout_ptr + (t * Hq + h) * D + d, y.to(qout_ptr.dtype.element_ty), mask=d_ok)
    else:
        row_pos = tl.load(rowpos_ptr + t)
        slot = tl.load(table_ptr + (row_pos // chunk) % table_len) * chunk + row_pos % chunk
        tl.store(kcache_ptr + kv * stride_kch + slot * D + d, y.to(kcache_ptr.dtype.element_ty), mask=d_ok)
        value = tl.load(v_ptr + t * stride_vt + kv * stride_vh + d, mask=d_ok, other=0.0)
        tl.store(vcache_ptr + kv * stride_vch + slot * D + d, value.to(vcache_ptr.dtype.element_ty), mask=d_ok)
        if kv == 0:  # after this program's rows; attention reads them only after the whole launch
            tl.store(cachepos_ptr + slot, row_pos)


def norm_rope_store(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor,
                    inv_freq: torch.Tensor, scaling: float, norms: tuple[torch.Tensor, torch.Tensor] | None,
                    eps: float, rows, row_positions: torch.Tensor) -> torch.Tensor:
    """As `kernels.rope_store.norm_rope_store`, in one launch."""
    T, Hq, D = q.shape
    kv_heads = key.shape[1]
    for x in (q, key, value):
        if x.stride(2) != 1:
            raise ValueError("norm_rope_store needs unit stride along the head dimension")
    for plane in (rows.k, rows.v):
        if plane.stride(2) != 1 or plane.stride(1) != D:
            raise ValueError("norm_rope_store needs (KV, S, D) cache planes with rows of D")
    q_out = torch.empty((T, Hq, D), dtype=q.dtype, device=q.device)
    q_norm, k_norm = norms if norms is not None else (inv_freq, inv_freq)  # valid pointers, unread without NORM
    half = inv_freq.shape[0]
    if T:
        _norm_rope_store_kernel[(T, Hq + kv_heads)](
            q, key, value, positions.contiguous(), row_positions.contiguous(), inv_freq.contiguous(),
            q_norm, k_norm, q_out, rows.k, rows.v, rows.positions, rows.table,
            Hq, D, rows.chunk, rows.table.shape[0], eps, scaling,
            q.stride(0), q.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            rows.k.stride(0), rows.v.stride(0),
            NORM=norms is not None, HALF=half, BLOCK_D=triton.next_power_of_2(D))
    return q_out
