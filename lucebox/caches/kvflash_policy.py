"""What a decode/verify step of a paged pool attends to: one object per KVFlash policy
(`KVFlashSettings.policy`), which `PagedKV` and `PagedBlocks` call wherever the policies differ.

- `ExactPolicy` ("exact"): every chunk; those only on the host are streamed to attention, so a
  step can be graphed only when no chunk can be on the host. It chooses nothing.
- `SelectPolicy` ("select"): the sink, the last `tail_tokens` positions before each query, and
  the chunks `ChunkSelection` chose from committed tokens: the pool alone, masked by `pinned`, so
  every decode/verify step can be graphed. It keeps those chunks resident.

A prompt prefill is always exact, whatever the policy (`PagedBlocks.blocks`).
"""

from __future__ import annotations

from typing import Protocol

import torch

from lucebox.caches.chunk_selection import ChunkSelection
from lucebox.caches.residency import ChunkResidency
from lucebox.caches.settings import KVFlashSettings


class KVFlashPolicy(Protocol):
    """The calls `PagedKV` makes at each point of a step and a commit, and `PagedBlocks` at a
    decode/verify step's block, in the order the pool makes them."""

    selection: ChunkSelection | None  # `select`'s choice (summaries, chosen chunks, kept queries)

    @property
    def selected(self) -> list[int]:
        """The chunks chosen by score, which the pool evicts last."""

    def graphable(self) -> bool:
        """Whether a decode/verify step attends over the pool alone (`PagedBlocks.static_block`)."""

    def prepare_step(self, start: int, end: int) -> None:
        """After the pool made the chunks of a write of positions [start, end) resident."""

    def keep_queries(self, q: torch.Tensor) -> None:
        """The step's queries (T, Hq, D), before attention over its blocks."""

    def mask(self, rows: int | None = None) -> tuple:
        """What limits a decode/verify step's view of the pool's first `rows` rows (all with None):
        `KVBlock`'s `pinned` and `recent`, or () for every row (then chunks on the host are streamed)."""

    def begin_commit(self, length: int, committed: int) -> None:
        """Positions < length become final (were < committed); reads nothing back."""

    def ranking(self, length: int) -> torch.Tensor | None:
        """Device values the commit must read back (`LayerCache.ranking`), or None."""

    def finish_commit(self, length: int, ranking: list[int] | None) -> None:
        """The commit's end, given `ranking` read back as a flat list."""

    def rewind(self, to_position: int) -> None:
        """Committed positions >= to_position are gone (prefix reuse)."""

    def accept_path(self, src: list[int], dst: list[int]) -> None:
        """A tree step's rows at positions `src` moved to `dst`."""

    def rows_before_reselect(self, position: int) -> int | None:
        """How many rows a step starting at `position` may hold (None: no limit)."""

    def summary_bytes(self) -> int:
        """Device bytes the policy keeps beside the pool."""


def kvflash_policy(settings: KVFlashSettings, residency: ChunkResidency, kv_heads: int, head_dim: int,
                   dtype: torch.dtype) -> KVFlashPolicy:
    """The policy `settings.policy` names, for the pool whose chunks `residency` places."""
    if settings.policy == "select":
        return SelectPolicy(settings, residency, ChunkSelection(settings, kv_heads, head_dim, dtype, residency.device))
    return ExactPolicy(residency)


class ExactPolicy:
    """Every chunk, resident or streamed from the host: it chooses nothing, so commits, rewinds
    and tree moves leave it nothing to do, and a step may hold any number of rows."""

    selection = None

    def __init__(self, residency: ChunkResidency):
        self.residency = residency

    @property
    def selected(self) -> list[int]:
        return []

    def graphable(self) -> bool:
        return self.residency.host is None  # no chunk can be on the host, to be streamed

    def prepare_step(self, start: int, end: int) -> None:
        pass

    def keep_queries(self, q: torch.Tensor) -> None:
        pass

    def mask(self, rows: int | None = None) -> tuple:
        return ()

    def begin_commit(self, length: int, committed: int) -> None:
        pass

    def ranking(self, length: int) -> torch.Tensor | None:
        return None

    def finish_commit(self, length: int, ranking: list[int] | None) -> None:
        pass

    def rewind(self, to_position: int) -> None:
        pass

    def accept_path(self, src: list[int], dst: list[int]) -> None:
        pass

    def rows_before_reselect(self, position: int) -> int | None:
        return None

    def summary_bytes(self) -> int:
        return 0


class SelectPolicy:
    """Sink, tail and the chunks `selection` chose. Owns `pinned` (one flag per pool row: sink
    and chosen chunks), updated in place (a graph holds its address) by `prepare_step`, which
    rebuilds it only when residency changed (`residency.changes`) or the choice did since it was
    last built. A commit that crosses a reselect boundary chooses again (`selection`) and makes
    the chosen chunks resident; every commit brings the tail back (a prefill may have evicted it)."""

    def __init__(self, settings: KVFlashSettings, residency: ChunkResidency, selection: ChunkSelection):
        self.s, self.residency, self.selection = settings, residency, selection
        self.pinned = torch.zeros(settings.pool_chunks * settings.chunk, dtype=torch.bool, device=residency.device)
        self._pinned_stale = True
        self._pinned_at = residency.changes  # the residency the pinned rows were built from

    @property
    def selected(self) -> list[int]:
        return self.selection.selected

    def graphable(self) -> bool:
        return True  # its block is the pool

    def prepare_step(self, start: int, end: int) -> None:
        self._refresh_pinned()
        self.selection.note_step(start, end)

    def keep_queries(self, q: torch.Tensor) -> None:
        self.selection.keep_queries(q)  # now, not when the blocks are consumed

    def mask(self, rows: int | None = None) -> tuple:
        return (self.pinned if rows is None else self.pinned[:rows]), self.s.tail_tokens

    def begin_commit(self, length: int, committed: int) -> None:
        self.selection.begin_commit(length, committed, self.residency.chunk_keys)

    def ranking(self, length: int) -> torch.Tensor | None:
        return self.selection.ranking(length, self.residency.length)

    def finish_commit(self, length: int, ranking: list[int] | None) -> None:
        if ranking is not None:
            self._reselect(length, self.selection.choose(ranking))
        self._ensure_tail_resident(length)

    def _reselect(self, length: int, selected: list[int]) -> None:
        keep = set(selected) | {0} | self._tail(length)
        stream = self.residency.copy_stream_after_queued_work()
        self._pinned_stale = True
        self.selection.selected = selected
        self.residency.load_chunks(selected, keep, length, selected, stream)  # one batch, whatever their number
        self.selection.due = False  # last: an interrupt above leaves the choice due again

    def _ensure_tail_resident(self, length: int) -> None:
        """Tail and chosen chunks back on the device."""
        keep = self._tail(length) | set(self.selected) | {0}
        for chunk in sorted(keep - self.residency.chunk_slot.keys()):
            self.residency.make_resident(chunk, keep, length, self.selected)

    def _tail(self, length: int) -> set[int]:
        """The chunks of the tail of a query at `length`, up to the last one written."""
        return set(range(self.s.tail_start(length), -(-length // self.s.chunk)))

    def rewind(self, to_position: int) -> None:
        self._pinned_stale = True
        self.selection.rewind(to_position)

    def accept_path(self, src: list[int], dst: list[int]) -> None:
        self.selection.accept_path(src, dst)  # the kept queries follow their rows

    def rows_before_reselect(self, position: int) -> int | None:
        return self.selection.rows_before_reselect(position)

    def summary_bytes(self) -> int:
        return self.selection.summaries.nbytes()

    def _refresh_pinned(self) -> None:
        """`pinned`: the rows of the sink and the selected chunks, rebuilt if stale."""
        if not self._pinned_stale and self._pinned_at == self.residency.changes:
            return
        changes = self.residency.changes
        pinned = torch.zeros(self.s.pool_chunks, dtype=torch.bool, device=self.residency.device)
        chosen = [self.residency.chunk_slot[c] for c in [0, *self.selected] if c in self.residency.chunk_slot]
        pinned[chosen] = True
        self.pinned.copy_(pinned.repeat_interleave(self.s.chunk))
        self._pinned_at, self._pinned_stale = changes, False  # last: an interrupt above leaves it stale
