"""Which 64-token chunks a query is likely to attend to, from per-chunk key summaries.

For each chunk and KV head we keep the mean and the element-wise min and max of its keys, and
rank chunks two ways for one query q:
- by q . mean: a chunk whose keys consistently point where q looks (a passage about the topic);
- by sum_d max(q_d * min_d, q_d * max_d), the largest score any key of the chunk can reach (the
  Quest bound): a chunk holding one key that q matches sharply.
Neither ranking alone serves both cases (the bound is loose for many ordinary chunks, the mean
hides single keys), so the chosen set alternates between the two rankings. A chunk's score is
its best over the query heads, so a chunk one head needs is kept even if the others ignore it.
"""

from __future__ import annotations

import torch


class ChunkSummaries:
    def __init__(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.stats = torch.empty((0, 3, kv_heads, head_dim), dtype=dtype, device=device)  # mean, min, max
        self.count = 0  # chunks summarized so far: [0, count)

    def add(self, chunk_index: int, keys: torch.Tensor) -> None:
        """Summarize one complete chunk's keys (KV, C, D)."""
        if chunk_index >= self.stats.shape[0]:
            capacity = max(chunk_index + 1, 2 * self.stats.shape[0], 64)
            grown = torch.empty((capacity, *self.stats.shape[1:]), dtype=self.stats.dtype, device=self.stats.device)
            grown[: self.stats.shape[0]] = self.stats
            self.stats = grown
        self.stats[chunk_index, 0] = keys.to(torch.float32).mean(dim=1).to(keys.dtype)
        self.stats[chunk_index, 1] = keys.amin(dim=1)
        self.stats[chunk_index, 2] = keys.amax(dim=1)
        self.count = max(self.count, chunk_index + 1)

    def truncate(self, chunks: int) -> None:
        self.count = min(self.count, chunks)

    def nbytes(self) -> int:
        return self.stats.numel() * self.stats.element_size()

    def scores(self, q: torch.Tensor, candidates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean score, upper bound), each (len(candidates),), for one query row q (Hq, D)."""
        kv_heads = self.stats.shape[2]
        group = q.shape[0] // kv_heads
        qf = q.to(torch.float32).view(kv_heads, group, -1)  # (KV, G, D)
        s = self.stats[candidates].to(torch.float32)[:, :, :, None, :]  # (N, 3, KV, 1, D)
        mean = (qf * s[:, 0]).sum(-1)  # (N, KV, G)
        bound = torch.maximum(qf * s[:, 1], qf * s[:, 2]).sum(-1)
        return mean.flatten(1).amax(-1), bound.flatten(1).amax(-1)


def rank_chunks(summaries: ChunkSummaries, q: torch.Tensor, candidates: list[int]) -> torch.Tensor:
    """(2, len(candidates)) on the device: candidate indices best first by mean score, then by bound."""
    idx = torch.tensor(candidates, device=summaries.stats.device)
    return torch.stack([torch.argsort(s, descending=True) for s in summaries.scores(q, idx)])


def pick_chunks(candidates: list[int], ranking: list[int], k: int) -> list[int]:
    """k candidates, alternating between the best by mean score and the best by bound, from
    `rank_chunks`' ranking read back as one flat list."""
    if len(candidates) <= k:
        return list(candidates)
    n = len(candidates)
    chosen: dict[int, None] = {}
    for a, b in zip(ranking[:n], ranking[n:], strict=True):
        for i in (a, b):
            if len(chosen) < k:
                chosen.setdefault(i)
        if len(chosen) == k:
            break
    return sorted(candidates[i] for i in chosen)
