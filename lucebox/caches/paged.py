"""Full-attention K/V in 64-token chunks: a bounded device pool plus KVFlash host offload.

Layout: the device pool has `pool_chunks` slots of one chunk each; chunk j holds positions
[64 j, 64 j + 64), and the device `page_table` says which slot holds it. When the context can
outgrow the pool, a chunk leaving the pool is copied to host memory (`HostChunks`) and comes back
by a copy. The first chunk (the attention sink) and the recent tail always stay resident.

A write is split in two (`LayerCache.reserve` / `store`): the host makes the chunks a step
touches resident and keeps its bookkeeping in host integers; the device stores the rows at slots
it computes from the positions and the page table. So a decode step's device work is the same
at every position, and a CUDA graph of it reads the pool's tables as they are at each replay.

Policies (what a decode/verify step attends to; a prompt prefill is always exact):
- "exact": every chunk. Resident chunks in one block, the rest streamed from the host in blocks
  of `stream_chunks` and merged by log-sum-exp. Equal to full attention up to rounding.
- "select": the sink, the last `tail_tokens` positions before each query, and the `select_k`
  chunks whose key summaries score highest against the query of the last committed token,
  chosen again every `reselect_every` committed tokens. Chosen from committed tokens only, so a
  step sees the same keys whether drafts were verified in it or not, provided a step never spans
  a reselect boundary (`rows_before_reselect`). Bounded work and bytes per token at any context.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from lucebox.caches.base import KVBlock, LayerCache, Step
from lucebox.caches.chunk_selection import ChunkSelection
from lucebox.caches.host_chunks import HostChunks
from lucebox.engine.config import DECODE_ROWS, KV_CHUNK
from lucebox.errors import InvalidArgumentError
from lucebox.kernels.kv_int8 import dequantize_rows, quantize_rows

KV_POLICIES = ("exact", "select")


@dataclass(frozen=True)
class KVFlashSettings:
    policy: str
    pool_tokens: int
    max_context: int
    max_step: int  # most rows one forward writes (prefill chunk or verify width)
    decode_rows: int = DECODE_ROWS
    chunk: int = KV_CHUNK
    tail_tokens: int = 256
    reselect_every: int = 64
    stream_chunks: int = 64

    @property
    def pool_chunks(self) -> int:
        return self.pool_tokens // self.chunk

    @property
    def offload(self) -> bool:
        return self.max_context > self.pool_chunks * self.chunk

    @property
    def tail_span(self) -> int:
        """Most chunks the tail of one decode/verify step can touch."""
        return -(-(self.tail_tokens + self.decode_rows) // self.chunk) + 1

    @property
    def select_k(self) -> int:
        """Chunks chosen by score: what the pool holds beyond sink, tail and one spare slot."""
        return self.pool_chunks - 1 - self.tail_span - 1

    @property
    def min_pool_chunks(self) -> int:
        """The smallest pool this policy and step size can run with: the sink, the chunks one step
        writes and a spare (and for `select`, the tail)."""
        return max(-(-self.max_step // self.chunk) + 2, self.tail_span + 2 if self.policy == "select" else 0)

    def validate(self) -> None:
        if self.policy not in KV_POLICIES:
            raise InvalidArgumentError(f"kv_policy '{self.policy}' is not one of {', '.join(KV_POLICIES)}")
        need = self.min_pool_chunks
        if self.pool_chunks < need:
            raise InvalidArgumentError(
                f"kv_pool_tokens={self.pool_tokens} is too small: this configuration needs at least "
                f"{need * self.chunk} tokens (sink + the rows one step writes, prefill_chunk={self.max_step}"
                f"{', + the select tail' if self.policy == 'select' else ''}); "
                "raise kv_pool_tokens or lower prefill_chunk"
            )
        if self.tail_tokens < 2 * self.reselect_every:
            raise InvalidArgumentError("tail_tokens must be at least twice kv_reselect_every")


class PagedKV(LayerCache):
    """With `int8`, K and V rows are stored as int8 codes with a float32 scale per (token, head)
    (`kernels.kv_int8`), in the pool and on the host alike."""

    def __init__(self, settings: KVFlashSettings, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, int8: bool = False):
        settings.validate()
        self.s = settings
        C = settings.chunk
        self.device, self.dtype, self.int8 = device, dtype, int8
        # (KV, pool_chunks * C, D): slot s holds rows [s*C, (s+1)*C) of every head.
        self.pk = torch.zeros((kv_heads, settings.pool_chunks * C, head_dim), dtype=torch.int8 if int8 else dtype,
                              device=device)
        self.pv = torch.zeros_like(self.pk)
        # (KV, pool_chunks * C): each row's scale, int8 only. `planes` is what a chunk's rows are
        # made of: what moves to and from the host, and what attention reads.
        self.scales = tuple(torch.zeros(self.pk.shape[:2], dtype=torch.float32, device=device)
                            for _ in range(2)) if int8 else ()
        self.planes = (self.pk, self.pv, *self.scales)
        # The position of the row each pool row holds, -1 for none: kept up to date by stores, loads
        # and rollbacks, so a step hands it to attention as it is. It is derived from residency
        # (below); a residency update cut short leaves `_moving` above 0, and the next step
        # rebuilds it from residency. Like every tensor a step reads, it is updated in place: a
        # CUDA graph holds its address.
        self.row_positions = torch.full((settings.pool_chunks * C,), -1, dtype=torch.int64, device=device)
        self._moving = 0  # residency updates begun and not finished
        # `select`'s pinned rows (sink and chosen chunks), rebuilt in place when stale.
        self.pinned = torch.zeros(settings.pool_chunks * C, dtype=torch.bool, device=device)
        self._pinned_stale = True
        # Residency has one source of truth, changed one dict operation at a time, so an interrupt
        # can never leave two views of it that disagree. `page_table` is its device copy for the
        # rows a step stores (chunk -> slot), written when a chunk is installed; a store only
        # addresses chunks its `reserve` made resident, so stale entries are never read.
        self.chunk_slot: dict[int, int] = {}  # resident chunk -> the slot holding its rows
        self._pool_view: int | None = None  # `_used_slots()`, rebuilt on change
        max_chunks = -(-settings.max_context // C)
        self.page_table = torch.zeros(max_chunks, dtype=torch.int64, device=device)
        self.host = HostChunks(C, kv_heads, head_dim, max_chunks, dtype, device, int8) if settings.offload else None
        # Chunks whose host copy holds every row written to them: a chunk is copied to the host
        # when it leaves the pool (not row by row as it is written, which a graphed step could not
        # do at a position-dependent offset), and is current until a step writes to it again.
        self._on_host: set[int] = set()
        self.length = 0  # rows written (drafts included)
        self.committed = 0
        self.select = settings.policy == "select"
        self.selection = ChunkSelection(settings, kv_heads, head_dim, dtype, device) if self.select else None
        self._loads_done: torch.cuda.Event | None = None
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    # -- residency ------------------------------------------------------------------------------

    def _tail_start(self, position: int) -> int:
        return max(0, (position - self.s.tail_tokens) // self.s.chunk)

    @property
    def slot_chunk(self) -> list[int]:
        """Which chunk each slot holds (-1: free)."""
        slots = [-1] * self.s.pool_chunks
        for chunk, slot in self.chunk_slot.items():
            slots[slot] = chunk
        return slots

    def _victim(self, slot_chunk: list[int], keep: set[int]) -> int:
        """A slot to reuse: free, else the oldest chunk that is neither sink, kept, tail nor selected."""
        for slot, chunk in enumerate(slot_chunk):
            if chunk < 0:
                return slot
        tail = self._tail_start(self.committed)
        selected = set(self.selected)

        def rank(slot: int) -> tuple:
            c = slot_chunk[slot]
            return (c in selected, c >= tail, c)

        options = [s for s, c in enumerate(slot_chunk) if c != 0 and c not in keep]
        if not options:
            raise RuntimeError("KV pool has no slot to give; kv_pool_tokens was validated too small")
        return min(options, key=rank)

    def _make_resident(self, chunk: int, keep: set[int], stream: torch.cuda.Stream | None = None) -> int:
        """The slot holding `chunk`'s rows, loading them first if needed. The residency update runs
        evict, load, install: an interrupt between two of them leaves a free slot (the evicted chunk
        lives on the host), never a slot claimed by a chunk whose rows are not in it."""
        slot = self.chunk_slot.get(chunk)
        if slot is not None:
            return slot
        slot_chunk = self.slot_chunk
        slot = self._victim(slot_chunk, keep)
        self._moving += 1
        self._pool_view = None  # dropped before residency changes: no stale copy outlives an interrupt
        self._pinned_stale = True
        rows = self._rows(slot)
        first, C = chunk * self.s.chunk, self.s.chunk
        # The copies on the copy stream when given (the evicted rows must reach the host before
        # the load overwrites their slot, so both go in one stream's order); `row_positions` on
        # the current stream, with every other write to it (a rollback's rewrites it whole).
        if slot_chunk[slot] >= 0:
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                self._copy_to_host(slot_chunk[slot], rows)  # before it leaves: the host copy is its only one then
            del self.chunk_slot[slot_chunk[slot]]
        self.row_positions[rows] = -1  # the evicted chunk's rows are gone; the new chunk's are not there yet
        if self.host is not None and first < self.length:
            with torch.cuda.stream(stream) if stream is not None else nullcontext():
                for plane, part in zip(self.planes, self.host.fetch(chunk, chunk + 1), strict=True):
                    plane[:, rows].copy_(part, non_blocking=True)
            held = min(self.length - first, C)  # the rows of the chunk written so far
            self.row_positions[rows.start : rows.start + held] = torch.arange(first, first + held, device=self.device)
        if stream is not None:
            self._loads_done = stream.record_event()  # what attention waits for (`_wait_for_loads`)
        self.page_table[chunk] = slot
        self.chunk_slot[chunk] = slot
        self._moving -= 1
        return slot

    def _copy_to_host(self, chunk: int, rows: slice) -> None:
        """The rows written to `chunk` (resident in pool `rows`) onto the host, unless already there."""
        if self.host is None or chunk in self._on_host or chunk * self.s.chunk >= self.length:
            return
        self.host.store(chunk, *(plane[:, rows] for plane in self.planes))
        self._on_host.add(chunk)

    # -- LayerCache -----------------------------------------------------------------------------

    def reserve(self, step: Step) -> None:
        start, end, C = step.start, step.end, self.s.chunk
        if start > self.length:
            raise ValueError(f"cache write at position {start} leaves a gap after {self.length} rows")
        if end > self.s.max_context:
            raise ValueError(f"cache write up to position {end} passes max_context {self.s.max_context}")
        self.dirty = True
        self._wait_for_loads()
        touched = set(range(start // C, (end - 1) // C + 1))
        for chunk in sorted(touched):
            self._make_resident(chunk, keep=touched | {0})
        self._on_host -= touched  # their host copies are about to be out of date
        if self._moving:
            self._rebuild_row_positions()
        if self.select:
            if self._pinned_stale:
                self._rebuild_pinned()
            self.selection.note_step(start, end)
        self.length = end

    def store(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        C = self.s.chunk
        rows = self.page_table[positions // C] * C + positions % C
        parts = (k, v)  # (T, KV, D) each
        if self.int8:
            (k_codes, k_scales), (v_codes, v_scales) = quantize_rows(k), quantize_rows(v)
            parts = (k_codes, v_codes, k_scales, v_scales)
        for plane, part in zip(self.planes, parts, strict=True):
            plane.index_copy_(1, rows, part.transpose(0, 1))
        self.row_positions.index_copy_(0, rows, positions)  # last: a row is visible once it holds its keys

    def blocks(self, q: torch.Tensor, step: Step) -> Iterator[KVBlock]:
        self._wait_for_loads()
        if self.select:
            self.selection.keep_queries(q)  # now, not when the blocks are consumed
        return self._blocks(step)

    def _blocks(self, step: Step) -> Iterator[KVBlock]:
        # Free slots are handed out lowest first, so the slots past the highest one in use hold
        # nothing: attention reads the pool up to there (a short context reads a short pool).
        rows = self._used_slots() * self.s.chunk
        pool = [plane[:, :rows] for plane in self.planes]
        if self.select and not step.prefill:
            yield self._block(pool, self.row_positions[:rows], self.pinned[:rows], self.s.tail_tokens)
            return
        yield self._block(pool, self.row_positions[:rows])
        # A decode step's scores are one row per head, so it can take much longer runs than a prefill.
        run = self.s.stream_chunks * (16 if step.count <= self.s.decode_rows else 1)
        yield from self._streamed_blocks(run)

    def graphable(self, step: Step) -> bool:
        """`select` always (its block is the pool); `exact` when no chunk can be on the host."""
        return not step.prefill and (self.select or self.host is None)

    def static_block(self, q: torch.Tensor) -> KVBlock:
        if self.select:
            self.selection.keep_queries(q)
            return self._block(self.planes, self.row_positions, self.pinned, self.s.tail_tokens)
        return self._block(self.planes, self.row_positions)

    @staticmethod
    def _block(planes, positions: torch.Tensor, *mask, all_visible: bool = False) -> KVBlock:
        """A block of the pool's planes (k, v[, k scales, v scales])."""
        k, v, *scales = planes
        return KVBlock(k, v, positions, *mask, all_visible=all_visible,
                       k_scale=scales[0] if scales else None, v_scale=scales[1] if scales else None)

    def _streamed_blocks(self, max_run: int) -> Iterator[KVBlock]:
        """Chunks that are not resident, fetched from the host in runs of at most `max_run` chunks."""
        if self.host is None:
            return
        n = -(-self.length // self.s.chunk)
        missing = [c for c in range(n) if c not in self.chunk_slot]
        runs: list[list[int]] = []
        for c in missing:
            if runs and c == runs[-1][-1] + 1 and len(runs[-1]) < max_run:
                runs[-1].append(c)
            else:
                runs.append([c])
        for run in runs:
            planes = self.host.fetch(run[0], run[-1] + 1)
            positions = torch.arange(run[0] * self.s.chunk, (run[-1] + 1) * self.s.chunk, device=self.device)
            # Streamed chunks are complete and older than the step (the chunks it writes are resident).
            yield self._block(planes, positions, all_visible=True)

    @property
    def selected(self) -> list[int]:
        return self.selection.selected if self.select else []

    def begin_commit(self, length: int) -> None:
        # `committed` moves after the selection's part: a crossed boundary is marked due first, so
        # the next commit finishes whatever an interrupted one left (summaries resume from their count).
        if self.select:
            self.selection.begin_commit(length, self.committed, self._chunk_keys)
        self.committed = length

    def ranking(self, length: int) -> torch.Tensor | None:
        return self.selection.ranking(length, self.length) if self.select else None

    def finish_commit(self, length: int, ranking: list[int] | None) -> None:
        if not self.select:
            return
        if ranking is not None:
            self._reselect(length, self.selection.choose(ranking))
        self._ensure_tail_resident(length)

    def _chunk_keys(self, chunk: int) -> torch.Tensor:
        """Chunk `chunk`'s keys (KV, C, D) in the model dtype."""
        if chunk in self.chunk_slot:
            rows = self._rows(self.chunk_slot[chunk])
            keys, scales = self.pk[:, rows], self.scales[0][:, rows] if self.int8 else None
        else:
            planes = self.host.fetch(chunk, chunk + 1)
            keys, scales = planes[0], planes[2] if self.int8 else None
        return keys if scales is None else dequantize_rows(keys, scales, self.dtype)

    def _reselect(self, length: int, selected: list[int]) -> None:
        C = self.s.chunk
        keep = set(selected) | {0} | set(range(self._tail_start(length), -(-length // C)))
        stream = self._copy_stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))  # loads overwrite slots queued work may read
        self._pinned_stale = True
        self.selection.selected = selected
        for chunk in selected:
            self._make_resident(chunk, keep, stream)
        self.selection.due = False  # last: an interrupt above leaves the choice due again

    def _ensure_tail_resident(self, length: int) -> None:
        """Tail and chosen chunks back on the device (a prefill may have evicted them)."""
        C = self.s.chunk
        tail = set(range(self._tail_start(length), -(-length // C)))
        keep = tail | set(self.selected) | {0}
        for chunk in sorted(keep - self.chunk_slot.keys()):
            self._make_resident(chunk, keep)

    def _wait_for_loads(self) -> None:
        if self._loads_done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._loads_done)
            self._loads_done = None

    def _rows(self, slot: int) -> slice:
        return slice(slot * self.s.chunk, (slot + 1) * self.s.chunk)

    def _rebuild_row_positions(self) -> None:
        """`row_positions` from residency and length alone, after a residency update was cut short."""
        slots = torch.tensor(self.slot_chunk, dtype=torch.int64, device=self.device)
        positions = slots[:, None] * self.s.chunk + torch.arange(self.s.chunk, device=self.device)[None, :]
        valid = (slots[:, None] >= 0) & (positions < self.length)
        self.row_positions.copy_(torch.where(valid, positions, -1).flatten())
        self._moving = 0

    def _used_slots(self) -> int:
        """1 + the highest slot holding a chunk, kept until residency changes."""
        if self._pool_view is None:
            self._pool_view = 1 + max(self.chunk_slot.values(), default=-1)
        return self._pool_view

    def _rebuild_pinned(self) -> None:
        """`pinned`: the rows of the sink and the selected chunks, after residency or the selection changed."""
        pinned = torch.zeros(self.s.pool_chunks, dtype=torch.bool, device=self.device)
        chosen = [self.chunk_slot[c] for c in [0, *self.selected] if c in self.chunk_slot]
        pinned[chosen] = True
        self.pinned.copy_(pinned.repeat_interleave(self.s.chunk))
        self._pinned_stale = False

    def rollback(self, to_position: int) -> None:
        # Every time, not only below `length`: a write cut short may have placed rows past it.
        self.row_positions.masked_fill_(self.row_positions >= to_position, -1)
        self.length = min(self.length, to_position)
        # Chunks left with no row free their slots (emptied, the cache is reused by a new request).
        for chunk in [c for c in self.chunk_slot if c * self.s.chunk >= to_position]:
            self._pool_view = None
            self._pinned_stale = True
            del self.chunk_slot[chunk]
        if to_position < self.committed:  # a rewind of committed tokens (prefix reuse): choose again later
            # `committed` moves last, so an interrupted rewind is done again by the next rollback.
            self._pinned_stale = True
            if self.select:
                self.selection.rewind(to_position)
            self.committed = to_position

    def rows_before_reselect(self, position: int) -> int | None:
        return self.selection.rows_before_reselect(position) if self.select else None

    def device_bytes(self) -> int:
        return self.pool_bytes() + self.summary_bytes()

    def pool_bytes(self) -> int:
        return sum(plane.numel() * plane.element_size() for plane in self.planes)

    def summary_bytes(self) -> int:
        return self.selection.summaries.nbytes() if self.select else 0

    def host_bytes(self) -> int:
        return 0 if self.host is None else self.host.nbytes()

    def memory(self) -> dict[str, int]:
        return {"kv_pool_device": self.pool_bytes(), "kv_chunk_summaries": self.summary_bytes(),
                "kv_host": self.host_bytes()}


