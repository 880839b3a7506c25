"""Which 64-token chunks a query is likely to attend to, from per-chunk key summaries.

For each chunk and KV head we keep the element-wise min and max of its keys. For a query q the
largest score any key of the chunk can reach is bounded by sum_d max(q_d * min_d, q_d * max_d)
(the Quest bound); a chunk's score is the largest bound over the query heads, so a chunk that one
head needs sharply is kept even if the other heads ignore it.
"""

from __future__ import annotations

import torch


class ChunkSummaries:
    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.kmin = torch.empty((0, kv_heads, head_dim), dtype=dtype, device=device)
        self.kmax = torch.empty_like(self.kmin)
        self.count = 0  # chunks summarized so far: [0, count)

    def add(self, chunk_index: int, keys: torch.Tensor) -> None:
        """Summarize one complete chunk's keys (C, KV, D)."""
        if chunk_index >= self.kmin.shape[0]:
            capacity = max(chunk_index + 1, 2 * self.kmin.shape[0], 64)
            for name in ("kmin", "kmax"):
                old = getattr(self, name)
                grown = torch.empty((capacity, *old.shape[1:]), dtype=old.dtype, device=old.device)
                grown[: old.shape[0]] = old
                setattr(self, name, grown)
        self.kmin[chunk_index] = keys.amin(dim=0)
        self.kmax[chunk_index] = keys.amax(dim=0)
        self.count = max(self.count, chunk_index + 1)

    def truncate(self, chunks: int) -> None:
        self.count = min(self.count, chunks)

    def scores(self, q: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """Upper bounds (len(candidates),) for one query row q (Hq, D)."""
        kv_heads = self.kmin.shape[1]
        group = q.shape[0] // kv_heads
        qf = q.to(torch.float32).view(kv_heads, group, -1)  # (KV, G, D)
        lo = self.kmin[candidates].to(torch.float32)[:, :, None, :]  # (N, KV, 1, D)
        hi = self.kmax[candidates].to(torch.float32)[:, :, None, :]
        bound = torch.maximum(qf * lo, qf * hi).sum(-1)  # (N, KV, G)
        return bound.flatten(1).amax(-1)


def top_chunks(summaries: ChunkSummaries, q: torch.Tensor, candidates: list[int], k: int) -> list[int]:
    """The k candidates with the highest bound (all of them when there are at most k)."""
    if len(candidates) <= k:
        return list(candidates)
    idx = torch.tensor(candidates, device=summaries.kmin.device)
    best = torch.topk(summaries.scores(q, idx), k).indices
    return sorted(idx[best].tolist())
