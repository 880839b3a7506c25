"""Attention of a block of query rows over cached keys, torch reference.

Keys carry their absolute positions, so the same code serves contiguous caches, rings and pages:
a query at position p sees a key at position k when k <= p, and p - k < window on sliding layers.
Slots holding no key are marked with position -1.
"""

from __future__ import annotations

import torch


def attention(
    q: torch.Tensor,  # (T, Hq, D), RoPE applied
    k: torch.Tensor,  # (S, KV, D)
    v: torch.Tensor,  # (S, KV, D)
    q_positions: torch.Tensor,  # (T,)
    k_positions: torch.Tensor,  # (S,), -1 for empty slots
    scale: float,
    window: int | None = None,
) -> torch.Tensor:  # (T, Hq, D)
    T, Hq, D = q.shape
    kv_heads = k.shape[1]
    group = Hq // kv_heads
    visible = (k_positions[None, :] <= q_positions[:, None]) & (k_positions[None, :] >= 0)
    if window is not None:
        visible &= k_positions[None, :] > q_positions[:, None] - window
    # Query heads of one KV group side by side: (KV, group*T, D) against (KV, S, D).
    qg = q.view(T, kv_heads, group, D).permute(1, 2, 0, 3).reshape(kv_heads, group * T, D)
    scores = torch.matmul(qg, k.transpose(0, 1).transpose(1, 2)) * scale  # (KV, group*T, S)
    scores = scores.view(kv_heads, group, T, -1)
    compute = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    scores = scores.to(compute).masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(kv_heads, group * T, -1)
    out = torch.matmul(probs, v.transpose(0, 1))  # (KV, group*T, D)
    return out.view(kv_heads, group, T, D).permute(2, 0, 1, 3).reshape(T, Hq, D)
