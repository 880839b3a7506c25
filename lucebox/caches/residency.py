"""Which chunk of a full-attention layer's K/V is in which slot of its device pool, and the copies
that move chunks between the pool and host memory.

Layout: the pool has `pool_chunks` slots of one chunk each; chunk j holds positions
[chunk j, chunk (j + 1)). When the context can outgrow the pool, a chunk is copied to host memory
(`HostChunks`) at the commit that completes it (or, if its host copy is not current then, when it
leaves the pool), and comes back by a copy. A chunk is copied whole, not row by row as it is
written, which a graphed step could not do at a position-dependent offset; copied at its commit,
leaving the pool later is bookkeeping alone, so a re-selection only loads.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from lucebox.caches.host_arena import HostArena
from lucebox.caches.host_chunks import HostChunks, staging_chunks
from lucebox.caches.planes import KVPlanes
from lucebox.caches.settings import KVFlashSettings


class ChunkResidency:
    """The residency of one paged pool of `planes`, and the rows written to it.

    Contract:
    - `chunk_slot` (resident chunk -> slot) is the one source of truth, changed one dict operation
      at a time, so an interrupt never leaves two views of it that disagree. `page_table` is its
      device copy (chunk -> slot), written when a chunk is installed, for the rows a step stores;
      a store only addresses chunks its write made resident, so stale entries are never read.
    - `row_positions` is the position of the row each pool row holds, -1 for none, kept up to date
      by stores, loads and rollbacks, so a step hands it to attention as it is. `page_table` and
      `row_positions` are updated in place: a CUDA graph holds their addresses.
    - `make_resident` runs evict, load, install: an interrupt between two of them leaves a free
      slot (the evicted chunk lives on the host), never a slot claimed by a chunk whose rows are
      not in it. One cut short leaves `_moving` above 0, and the next `prepare_write` rebuilds
      `row_positions` from residency and `length`.
    - `changes` counts residency updates begun (counted before anything changes), so whatever is
      derived from residency (the used part of the pool here, `select`'s pinned rows) rebuilds
      when it moved.
    - On CUDA, loads may run on `copy_stream`; `wait_for_loads` orders the current stream after
      them, and must run before anything reads the pool.
    - `length` counts rows written (drafts included); `wrote_until` and `forget_from` move it.
    - A chunk whose rows are all committed is copied to the host at that commit
      (`copy_completed`), so leaving the pool later costs no copy; `load_chunks` brings any number
      of chunks back in a fixed number of operations.
    """

    def __init__(self, settings: KVFlashSettings, planes: KVPlanes, device: torch.device,
                 arena: HostArena | None = None):
        self.s, self.planes, self.device = settings, planes, device
        C = settings.chunk
        self.row_positions = torch.full((settings.pool_chunks * C,), -1, dtype=torch.int64, device=device)
        self._moving = 0  # residency updates begun and not finished
        self.chunk_slot: dict[int, int] = {}  # resident chunk -> the slot holding its rows
        self.changes = 0
        self._used_slots, self._used_slots_at = 0, None  # `used_slots()`, and the `changes` it was counted at
        max_chunks = -(-settings.max_context // C)
        self.page_table = torch.zeros(max_chunks, dtype=torch.int64, device=device)
        self.host = HostChunks(C, planes.kv_heads, planes.head_dim, max_chunks, planes.dtype, device,
                               planes.int8, arena, staging_chunks(settings)) if settings.offload else None
        # Chunks whose host copy holds every row written to them: current until a step writes to them again.
        self._on_host: set[int] = set()
        self.length = 0
        self._loads_done: torch.cuda.Event | None = None
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @property
    def slot_chunk(self) -> list[int]:
        """Which chunk each slot holds (-1: free)."""
        slots = [-1] * self.s.pool_chunks
        for chunk, slot in self.chunk_slot.items():
            slots[slot] = chunk
        return slots

    def rows(self, slot: int) -> slice:
        """The pool rows of `slot`."""
        return slice(slot * self.s.chunk, (slot + 1) * self.s.chunk)

    def used_slots(self) -> int:
        """1 + the highest slot holding a chunk, counted again only when residency changed."""
        if self._used_slots_at != self.changes:
            self._used_slots = 1 + max(self.chunk_slot.values(), default=-1)
            self._used_slots_at = self.changes
        return self._used_slots

    def non_resident(self) -> list[int]:
        """The chunks holding written rows that are not in the pool (their rows are on the host)."""
        return [c for c in range(-(-self.length // self.s.chunk)) if c not in self.chunk_slot]

    def _victim(self, slot_chunk: list[int], keep: set[int], committed: int, selected: list[int]) -> int:
        """A slot to reuse: free, else the oldest chunk that is neither sink, kept, tail nor selected."""
        for slot, chunk in enumerate(slot_chunk):
            if chunk < 0:
                return slot
        tail = self.s.tail_start(committed)
        chosen = set(selected)

        def rank(slot: int) -> tuple:
            c = slot_chunk[slot]
            return (c in chosen, c >= tail, c)

        options = [s for s, c in enumerate(slot_chunk) if c != 0 and c not in keep]
        if not options:
            raise RuntimeError("KV pool has no slot to give; kv_pool_tokens was validated too small")
        return min(options, key=rank)

    def make_resident(self, chunk: int, keep: set[int], committed: int, selected: list[int],
                      stream: torch.cuda.Stream | None = None) -> int:
        """The slot holding `chunk`'s rows, loading them first if needed, never evicting a chunk of
        `keep` and evicting `select`'s chunks (those chosen, and the tail of `committed` tokens)
        last. The copies go on `stream` when given. The residency update runs evict, load, install."""
        slot = self.chunk_slot.get(chunk)
        if slot is not None:
            return slot
        slot_chunk = self.slot_chunk
        slot = self._victim(slot_chunk, keep, committed, selected)
        self._moving += 1
        self.changes += 1  # before residency changes: nothing derived from it outlives an interrupt
        rows = self.rows(slot)
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
                for plane, part in zip(self.planes.planes, self.host.fetch(chunk, chunk + 1), strict=True):
                    plane[:, rows].copy_(part, non_blocking=True)
            held = min(self.length - first, C)  # the rows of the chunk written so far
            self.row_positions[rows.start : rows.start + held] = torch.arange(first, first + held, device=self.device)
        if stream is not None:
            self._loads_done = stream.record_event()  # what attention waits for (`wait_for_loads`)
        self.page_table[chunk] = slot
        self.chunk_slot[chunk] = slot
        self._moving -= 1
        return slot

    def load_chunks(self, chunks: list[int], keep: set[int], committed: int, selected: list[int],
                    stream: torch.cuda.Stream | None = None) -> None:
        """`make_resident` for every chunk of `chunks` (on the host) at once: victims chosen on the
        host, then one gather of the chunks from host memory, one copy to the device (on `stream`
        when given), one scatter per plane, and one update each of `row_positions` and
        `page_table`, however many chunks move. Evicted chunks need no copy when their host copy
        is current (`copy_completed` made it so); any that is not is copied first, one by one."""
        chunks = [c for c in chunks if c not in self.chunk_slot]
        if not chunks:
            return
        slot_chunk, slots = self.slot_chunk, []
        self._moving += 1
        self.changes += 1  # before residency changes: nothing derived from it outlives an interrupt
        for chunk in chunks:
            slot = self._victim(slot_chunk, keep | set(chunks), committed, selected)
            if slot_chunk[slot] >= 0:
                with torch.cuda.stream(stream) if stream is not None else nullcontext():
                    self._copy_to_host(slot_chunk[slot], self.rows(slot))
                del self.chunk_slot[slot_chunk[slot]]
            slot_chunk[slot] = chunk
            slots.append(slot)
        C, P = self.s.chunk, self.s.pool_chunks
        index = _on_device([chunks, slots], self.device)  # (2, n): chunk, slot
        if stream is not None:
            index.record_stream(stream)  # read on `stream` too: not reused before it is done there
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            for plane, part in zip(self.planes.planes, self.host.unpack(self.host.gather(chunks)), strict=True):
                plane.view(plane.shape[0], P, C, *plane.shape[2:]).index_copy_(1, index[1], part.transpose(0, 1))
        if stream is not None:
            self._loads_done = stream.record_event()  # what attention waits for (`wait_for_loads`)
        positions = index[0, :, None] * C + torch.arange(C, device=self.device)  # (n, C)
        self.row_positions.view(P, C).index_copy_(0, index[1], positions.masked_fill_(positions >= self.length, -1))
        self.page_table.index_copy_(0, index[0], index[1])
        self.chunk_slot.update(zip(chunks, slots, strict=True))
        self._moving -= 1

    def copy_completed(self, before: int, length: int) -> None:
        """Chunks that committing positions [before, length) completed, copied to the host if
        resident and not there already: each run of them one gather and one copy."""
        if self.host is None:
            return
        done = [c for c in range(before // self.s.chunk, length // self.s.chunk)
                if c in self.chunk_slot and c not in self._on_host]
        runs: list[list[int]] = []
        for c in done:
            if runs and c == runs[-1][-1] + 1:
                runs[-1].append(c)
            else:
                runs.append([c])
        C, P = self.s.chunk, self.s.pool_chunks
        for run in runs:
            slots = self.page_table[run[0] : run[-1] + 1]  # resident: their slots, already on the device
            packed = torch.empty((len(run), self.host.chunk_bytes), dtype=torch.uint8, device=self.device)
            for plane, part in zip(self.planes.planes, self.host.unpack(packed), strict=True):
                part.copy_(plane.view(plane.shape[0], P, C, *plane.shape[2:]).index_select(1, slots).transpose(0, 1))
            self.host.store_run(run[0], packed)
            self._on_host.update(run)

    def _copy_to_host(self, chunk: int, rows: slice) -> None:
        """The rows written to `chunk` (resident in pool `rows`) onto the host, unless already there."""
        if self.host is None or chunk in self._on_host or chunk * self.s.chunk >= self.length:
            return
        self.host.store(chunk, *(plane[:, rows] for plane in self.planes.planes))
        self._on_host.add(chunk)

    def prepare_write(self, start: int, end: int, committed: int, selected: list[int]) -> None:
        """The host's half of a write of positions [start, end): the chunks it touches resident
        (with the sink), their host copies marked out of date, `row_positions` whole again."""
        C = self.s.chunk
        self.wait_for_loads()
        touched = set(range(start // C, (end - 1) // C + 1))
        for chunk in sorted(touched):
            self.make_resident(chunk, touched | {0}, committed, selected)
        self._on_host -= touched  # their host copies are about to be out of date
        if self._moving:
            self._rebuild_row_positions()

    def wrote_until(self, end: int) -> None:
        """Rows up to `end` are written (or being written: the write's last host step)."""
        self.length = end

    def pool_rows(self, positions: torch.Tensor) -> torch.Tensor:
        """The pool rows (T,) of `positions` (T,), on the device, from `page_table`."""
        C = self.s.chunk
        return self.page_table[positions // C] * C + positions % C

    def stored(self, rows: torch.Tensor, positions: torch.Tensor) -> None:
        """Pool `rows` now hold the rows of `positions`: attention sees them from here on (so this
        comes after the planes' store)."""
        self.row_positions.index_copy_(0, rows, positions)

    def forget_from(self, to_position: int, drafts_only: bool = False) -> None:
        """Rows at positions >= to_position are gone; chunks left with none free their slots.

        `drafts_only` (no committed row is forgotten: a speculation round's rejected rows) is host
        bookkeeping alone, no launch: the forgotten rows keep their pool rows and positions, every
        chunk keeps its slot, so the next write of each forgotten position lands on the very row
        that holds it, and attention (causal on `row_positions`) shows no query a row past its own
        position before that write. A slot changing hands clears its rows (`make_resident`)."""
        if drafts_only:
            self.length = min(self.length, to_position)
            return
        # Every time, not only below `length`: a write cut short may have placed rows past it.
        self.row_positions.masked_fill_(self.row_positions >= to_position, -1)
        self.length = min(self.length, to_position)
        # Emptied, the cache is reused by a new request.
        for chunk in [c for c in self.chunk_slot if c * self.s.chunk >= to_position]:
            self.changes += 1
            del self.chunk_slot[chunk]

    def chunk_keys(self, chunk: int) -> torch.Tensor:
        """Chunk `chunk`'s keys (KV, C, D) in the model dtype, from its slot or from the host."""
        if chunk in self.chunk_slot:
            return self.planes.keys(self.rows(self.chunk_slot[chunk]))
        return self.planes.fetched_keys(self.host.fetch(chunk, chunk + 1))

    def copy_stream_after_queued_work(self) -> torch.cuda.Stream | None:
        """`copy_stream`, ordered after the work queued so far on the current stream (loads
        overwrite slots it may read); None off CUDA."""
        if self.copy_stream is not None:
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        return self.copy_stream

    def wait_for_loads(self) -> None:
        if self._loads_done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._loads_done)
            self._loads_done = None

    def _rebuild_row_positions(self) -> None:
        """`row_positions` from residency and length alone, after a residency update was cut short."""
        slots = torch.tensor(self.slot_chunk, dtype=torch.int64, device=self.device)
        positions = slots[:, None] * self.s.chunk + torch.arange(self.s.chunk, device=self.device)[None, :]
        valid = (slots[:, None] >= 0) & (positions < self.length)
        self.row_positions.copy_(torch.where(valid, positions, -1).flatten())
        self._moving = 0

    def host_bytes(self) -> int:
        return 0 if self.host is None else self.host.nbytes()


def _on_device(values: list, device: torch.device) -> torch.Tensor:
    """`values` as int64 on `device`; to a GPU from page-locked memory without waiting (a copy from
    ordinary host memory holds the host until the device's queue drains)."""
    host = torch.tensor(values, dtype=torch.int64)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
