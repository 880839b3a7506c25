"""Full-attention K/V in 64-token chunks: a bounded device pool plus KVFlash host offload.

Layout: the device pool has `pool_chunks` slots of one chunk each; chunk j holds positions
[64 j, 64 j + 64), and the device `page_table` says which slot holds it. When the context can
outgrow the pool, a chunk is copied to host memory (`HostChunks`, in the sequence's one
`HostArena`) once its rows are committed, leaves the pool without a copy, and comes back by one.
The first chunk (the attention sink) and the recent tail always stay resident.

A write is split in two (`KVCache.reserve` / `store`): the host makes the chunks a step
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

The parts: `KVPlanes` (storage), `ChunkResidency` (which chunk is in which slot, host copies),
`PagedBlocks` (what attention reads), the policy (`ExactPolicy` or `SelectPolicy`, which keeps
`select`'s `ChunkSelection`). `PagedKV` composes them and orders their updates.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from lucebox.caches.base import KVBlock, KVCache, RowTable, Step, move_slots, path_moves
from lucebox.caches.chunk_selection import ChunkSelection
from lucebox.caches.host_arena import HostArena
from lucebox.caches.kvflash_policy import kvflash_policy
from lucebox.caches.paged_blocks import PagedBlocks
from lucebox.caches.planes import KVPlanes
from lucebox.caches.residency import ChunkResidency
from lucebox.caches.settings import KVFlashSettings


class PagedKV(KVCache):
    """One full-attention layer's K/V in a paged pool, with `settings.policy` deciding what a
    decode/verify step attends to. With `int8`, K and V rows are stored as int8 codes with a
    float32 scale per (token, head) (`kernels.kv_int8`), in the pool and on the host alike. Host
    chunks take their region of `arena` (the sequence's one block of host memory), or an arena of
    their own."""

    def __init__(self, settings: KVFlashSettings, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, int8: bool = False, arena: HostArena | None = None):
        settings.validate()
        self.s = settings
        self.storage = KVPlanes(kv_heads, settings.pool_chunks * settings.chunk, head_dim, dtype, device, int8)
        self.residency = ChunkResidency(settings, self.storage, device, arena)
        self.policy = kvflash_policy(settings, self.residency, kv_heads, head_dim, dtype)
        self.select = settings.policy == "select"  # for whoever inspects the pool: nothing here branches on it
        self.attention = PagedBlocks(settings, self.storage, self.residency, self.policy)
        self.committed = 0

    @property
    def length(self) -> int:
        """Rows written (drafts included)."""
        return self.residency.length

    @property
    def selection(self) -> ChunkSelection | None:
        """`select`'s choice (summaries, chosen chunks, kept queries); None with `exact`."""
        return self.policy.selection

    @property
    def selected(self) -> list[int]:
        return self.policy.selected

    # -- KVCache -----------------------------------------------------------------------------

    def reserve(self, step: Step) -> None:
        start, end = step.start, step.end
        if start > self.length:
            raise ValueError(f"cache write at position {start} leaves a gap after {self.length} rows")
        if end > self.s.max_context:
            raise ValueError(f"cache write up to position {end} passes max_context {self.s.max_context}")
        self.dirty = True
        self.residency.prepare_write(start, end, self.committed, self.selected)
        self.policy.prepare_step(start, end)
        self.residency.wrote_until(end)

    def store(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        rows = self.residency.pool_rows(positions)
        self.storage.store(rows, k, v)  # (T, KV, D) each
        self.residency.stored(rows, positions)  # last: a row is visible once it holds its keys

    def row_table(self) -> RowTable | None:
        """The pool's rows through `page_table` (`residency.pool_rows`); int8 rows only by `store`."""
        if self.storage.int8:
            return None
        return RowTable(self.storage.k, self.storage.v, self.residency.row_positions, self.residency.page_table,
                        self.s.chunk)

    def blocks(self, q: torch.Tensor, step: Step) -> Iterator[KVBlock]:
        self.residency.wait_for_loads()
        self.policy.keep_queries(q)
        return self.attention.blocks(step)

    def graphable(self, step: Step) -> bool:
        return not step.prefill and self.policy.graphable()

    def static_block(self, q: torch.Tensor) -> KVBlock:
        self.policy.keep_queries(q)
        return self.attention.static_block()

    def begin_commit(self, length: int) -> None:
        # `committed` moves after the selection's part: a crossed boundary is marked due first, so
        # the next commit finishes whatever an interrupted one left (summaries resume from their count).
        self.residency.copy_completed(self.committed, length)
        self.policy.begin_commit(length, self.committed)
        self.committed = length

    def ranking(self, length: int) -> torch.Tensor | None:
        return self.policy.ranking(length)

    def finish_commit(self, length: int, ranking: list[int] | None) -> None:
        self.policy.finish_commit(length, ranking)

    def rollback(self, to_position: int) -> None:
        self.residency.forget_from(to_position, drafts_only=to_position >= self.committed)
        if to_position < self.committed:  # a rewind of committed tokens (prefix reuse): choose again later
            # `committed` moves last, so an interrupted rewind is done again by the next rollback.
            self.policy.rewind(to_position)
            self.committed = to_position

    def accept_path(self, start: int, rows: list[int]) -> None:
        """Every plane moves (int8 scales with their codes). The step's chunks are resident (its
        `reserve` made them so, and nothing evicts before the commit) and their host copies are
        already marked stale, so the moves touch the pool alone; `select`'s kept queries follow
        their rows, so a re-selection uses the last committed token's query."""
        src, dst = path_moves(start, rows)
        if not src:
            return
        self.residency.wait_for_loads()
        device = self.residency.device
        # Only K/V move: every destination position was written by the step itself, so the pool
        # row holding it already carries that position (`row_positions`).
        src_rows, dst_rows = (self.residency.pool_rows(torch.tensor(p, device=device)) for p in (src, dst))
        move_slots(*self.storage.planes, src_rows, dst_rows)
        self.policy.accept_path(src, dst)

    def rows_before_reselect(self, position: int) -> int | None:
        return self.policy.rows_before_reselect(position)

    def device_bytes(self) -> int:
        return self.pool_bytes() + self.summary_bytes()

    def pool_bytes(self) -> int:
        return self.storage.nbytes()

    def summary_bytes(self) -> int:
        return self.policy.summary_bytes()

    def host_bytes(self) -> int:
        return self.residency.host_bytes()

    def memory(self) -> dict[str, int]:
        return {"kv_pool_device": self.pool_bytes(), "kv_chunk_summaries": self.summary_bytes(),
                "kv_host": self.host_bytes()}
