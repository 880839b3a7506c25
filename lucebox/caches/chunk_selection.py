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


class ChunkSelection:
    """KVFlash `select`'s state for one full-attention layer: chunk summaries, the chosen chunks,
    whether a choice is due, and the queries it chooses with. It chooses from committed tokens
    only, every `reselect_every` of them, with the query of the last committed token; its policy
    (`SelectPolicy`) makes the chosen chunks resident and pins their rows.

    A choice is one commit in three parts, so that every layer's ranking is read back at once:
    `begin_commit` (summaries of completed chunks; a crossed boundary makes a choice due),
    `ranking` (the candidates ranked on the device, or None), `choose` (the ranking read back ->
    the chunks to keep)."""

    def __init__(self, settings, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device):
        self.s = settings
        self.summaries = ChunkSummaries(kv_heads, head_dim, dtype, device)
        self.selected: list[int] = []
        self.due = True  # nothing chosen yet
        # The queries of the last rows a step attended with (at most `decode_rows`), in a buffer of
        # fixed address (a CUDA graph writes it), and the position of the first of them.
        self.queries: torch.Tensor | None = None
        self.queries_start = 0
        self._candidates: list[int] = []  # of the ranking last prepared

    def note_step(self, start: int, end: int) -> None:
        self.queries_start = end - min(end - start, self.s.decode_rows)

    def keep_queries(self, q: torch.Tensor) -> None:
        """Copy the step's last queries: q may be a graph's static output, overwritten by its next replay."""
        if self.queries is None:
            self.queries = q.new_zeros((self.s.decode_rows, *q.shape[1:]))
        n = min(q.shape[0], self.s.decode_rows)
        self.queries[:n].copy_(q[q.shape[0] - n :])

    def accept_path(self, src: list[int], dst: list[int]) -> None:
        """A tree step's rows at positions `src` moved to `dst`: their queries move with them."""
        if self.queries is None:
            return
        device = self.queries.device
        rows = [torch.tensor([p - self.queries_start for p in part], device=device) for part in (src, dst)]
        self.queries.index_copy_(0, rows[1], self.queries.index_select(0, rows[0]))

    def begin_commit(self, length: int, committed: int, chunk_keys) -> None:
        """Positions < length are final (were < committed); `chunk_keys(c)` gives chunk c's keys."""
        if length // self.s.reselect_every > committed // self.s.reselect_every:
            self.due = True  # before the caller moves `committed`: an interrupt leaves it due
        for chunk in range(max(1, self.summaries.count), length // self.s.chunk):  # completed, not yet summarized
            self.summaries.add(chunk, chunk_keys(chunk))

    def ranking(self, length: int, written: int) -> torch.Tensor | None:
        """A due choice's candidates ranked on the device (`rank_chunks`; empty when all of them
        are kept), or None when no choice is due or the last committed token's query is not held
        (`written`: rows written, drafts included; the choice then waits for the next commit)."""
        row = length - 1 - self.queries_start
        if not self.due or self.queries is None or not 0 <= row < min(written - self.queries_start,
                                                                      self.s.decode_rows):
            return None
        C, every = self.s.chunk, self.s.reselect_every
        # Chunks that fall out of the tail before the next choice; younger ones the tail covers.
        self._candidates = [c for c in range(1, length // C) if c * C < length + every - self.s.tail_tokens]
        if len(self._candidates) <= self.s.select_k:
            return self.queries.new_zeros((0,), dtype=torch.long)
        return rank_chunks(self.summaries, self.queries[row], self._candidates)

    def choose(self, ranking: list[int]) -> list[int]:
        return pick_chunks(self._candidates, ranking, self.s.select_k)

    def rewind(self, to_position: int) -> None:
        """Committed tokens from `to_position` on are gone (prefix reuse): choose again later."""
        self.due = True
        self.selected = []
        self.summaries.truncate(to_position // self.s.chunk)

    def rows_before_reselect(self, position: int) -> int:
        """How many rows a step starting at `position` may hold without spanning a choice."""
        return self.s.reselect_every - position % self.s.reselect_every
