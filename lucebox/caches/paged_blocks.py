"""The key blocks attention reads from a paged pool (`PagedKV`), by policy and kind of step.

- a prompt prefill, and a decode/verify step its policy does not mask (`exact`): the pool's used
  part in one block, then the chunks that are only on the host, fetched in runs and streamed as
  blocks merged by log-sum-exp;
- a decode/verify step its policy masks (`select`): the pool alone, masked to pinned rows (sink
  and chosen chunks) plus the last `tail_tokens` positions before each query;
- a graphed step (`static_block`): the whole pool, the same tensors at every replay.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from lucebox.caches.base import KVBlock, Step
from lucebox.caches.kvflash_policy import KVFlashPolicy
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
    A decode/verify step's view of the pool is its `policy`'s (`KVFlashPolicy.mask`)."""

    def __init__(self, settings: KVFlashSettings, planes: KVPlanes, residency: ChunkResidency, policy: KVFlashPolicy):
        self.s, self.planes, self.residency, self.policy = settings, planes, residency, policy

    def blocks(self, step: Step) -> Iterator[KVBlock]:
        """The blocks a step's queries attend over (lazily: nothing runs until consumed)."""
        # Free slots are handed out lowest first, so the slots past the highest one in use hold
        # nothing: attention reads the pool up to there (a short context reads a short pool).
        rows = self.residency.used_slots() * self.s.chunk
        pool = [plane[:, :rows] for plane in self.planes.planes]
        mask = () if step.prefill else self.policy.mask(rows)
        yield self._block(pool, self.residency.row_positions[:rows], *mask)
        if mask:  # a masked step sees the pool alone: no chunk on the host is among what it shows
            return
        decode = step.count <= self.s.decode_rows
        yield from self._streamed_blocks(self.s.stream_chunks * (DECODE_RUN_MULTIPLE if decode else 1))

    def static_block(self) -> KVBlock:
        """The one block of a graphed decode/verify step: the whole pool."""
        return self._block(self.planes.planes, self.residency.row_positions, *self.policy.mask())

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
