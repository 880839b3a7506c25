"""The key blocks attention reads from a paged pool (`PagedKV`), by policy and kind of step.

- a prompt prefill, and every step of `exact`: the pool's used part in one block, then the chunks
  that are only on the host, fetched in runs and streamed as blocks merged by log-sum-exp;
- a decode/verify step of `select`: the pool alone, masked to pinned rows (sink and chosen
  chunks) plus the last `tail_tokens` positions before each query;
- a graphed step (`static_block`): the whole pool, the same tensors at every replay.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from lucebox.caches.base import KVBlock, Step
from lucebox.caches.planes import KVPlanes
from lucebox.caches.residency import ChunkResidency
from lucebox.caches.settings import KVFlashSettings

# A decode/verify step streams host chunks in runs this many times longer than a prefill's: its
# scores are at most `decode_rows` rows per head, so a long run costs little memory and saves
# merges. A cache-internal choice.
DECODE_RUN_MULTIPLE = 16


class PagedBlocks:
    """Builds the `KVBlock`s of one paged pool from its `planes` and `residency`.

    Contract: blocks are built when consumed, after the pool's write for the step (and, on CUDA,
    after `residency.wait_for_loads`); they read the pool's tensors and `residency.row_positions`
    as they are, so a graph captured over `static_block` sees what later host bookkeeping wrote.
    With `select`, `pinned` (one flag per pool row: sink and chosen chunks) is owned here, updated
    in place (a graph holds its address) by `refresh_pinned`, which rebuilds it only when residency
    changed (`residency.changes`) or `mark_pinned_stale` was called since it was last built."""

    def __init__(self, settings: KVFlashSettings, planes: KVPlanes, residency: ChunkResidency, select: bool):
        self.s, self.planes, self.residency, self.select = settings, planes, residency, select
        self.pinned = torch.zeros(settings.pool_chunks * settings.chunk, dtype=torch.bool, device=residency.device)
        self._pinned_stale = True
        self._pinned_at = residency.changes  # the residency the pinned rows were built from

    def blocks(self, step: Step) -> Iterator[KVBlock]:
        """The blocks a step's queries attend over (lazily: nothing runs until consumed)."""
        # Free slots are handed out lowest first, so the slots past the highest one in use hold
        # nothing: attention reads the pool up to there (a short context reads a short pool).
        rows = self.residency.used_slots() * self.s.chunk
        pool = [plane[:, :rows] for plane in self.planes.planes]
        if self.select and not step.prefill:
            yield self._block(pool, self.residency.row_positions[:rows], self.pinned[:rows], self.s.tail_tokens)
            return
        yield self._block(pool, self.residency.row_positions[:rows])
        decode = step.count <= self.s.decode_rows
        yield from self._streamed_blocks(self.s.stream_chunks * (DECODE_RUN_MULTIPLE if decode else 1))

    def static_block(self) -> KVBlock:
        """The one block of a graphed decode/verify step: the whole pool."""
        if self.select:
            return self._block(self.planes.planes, self.residency.row_positions, self.pinned, self.s.tail_tokens)
        return self._block(self.planes.planes, self.residency.row_positions)

    @staticmethod
    def _block(planes: Sequence[torch.Tensor], positions: torch.Tensor, *mask, all_visible: bool = False) -> KVBlock:
        """A block of planes (k, v[, k scales, v scales])."""
        k, v, *scales = planes
        return KVBlock(k, v, positions, *mask, all_visible=all_visible,
                       k_scale=scales[0] if scales else None, v_scale=scales[1] if scales else None)

    def _streamed_blocks(self, max_run: int) -> Iterator[KVBlock]:
        """Chunks that are not resident, fetched from the host in runs of at most `max_run` chunks."""
        host = self.residency.host
        if host is None:
            return
        runs: list[list[int]] = []
        for c in self.residency.non_resident():
            if runs and c == runs[-1][-1] + 1 and len(runs[-1]) < max_run:
                runs[-1].append(c)
            else:
                runs.append([c])
        for run in runs:
            planes = host.fetch(run[0], run[-1] + 1)
            positions = torch.arange(run[0] * self.s.chunk, (run[-1] + 1) * self.s.chunk, device=self.residency.device)
            # Streamed chunks are complete and older than the step (the chunks it writes are resident).
            yield self._block(planes, positions, all_visible=True)

    def mark_pinned_stale(self) -> None:
        """The chosen chunks changed (or are about to): `refresh_pinned` rebuilds."""
        self._pinned_stale = True

    def refresh_pinned(self, selected: list[int]) -> None:
        """`pinned`: the rows of the sink and the `selected` chunks, rebuilt if stale."""
        if not self._pinned_stale and self._pinned_at == self.residency.changes:
            return
        changes = self.residency.changes
        pinned = torch.zeros(self.s.pool_chunks, dtype=torch.bool, device=self.residency.device)
        chosen = [self.residency.chunk_slot[c] for c in [0, *selected] if c in self.residency.chunk_slot]
        pinned[chosen] = True
        self.pinned.copy_(pinned.repeat_interleave(self.s.chunk))
        self._pinned_at, self._pinned_stale = changes, False  # last: an interrupt above leaves it stale
