"""Sliding-window ring: a fixed `window + max_step` slots, slot = position % capacity.

Why that capacity: one forward writes at most `max_step` rows, overwriting the slots of positions
at least `window + max_step` older. After a rollback of up to `max_step` rows to position r, a
later query at q >= r needs keys > q - window >= r - window, and every overwritten position is
<= r - window - 1. So no row a later query needs is ever lost, and memory never grows.

A rollback is safe when measured from the highest position ever written, not from the committed
length: rejected drafts wrote past it. `can_rewind_to` checks exactly that (the rows still intact
start at `highest - capacity`), which is what reusing a cache for a new prompt must ask.

What `rollback(r)` does, and why each part is needed:
- A ring read only by forwards that write before they attend (the target model's: `reads_ahead`
  False) launches nothing: a query at q sees keys at positions <= q only, and every such position
  from r on is rewritten, into the same slot, before q attends, while rows at positions > q are
  masked. So rejecting a verify step's drafts costs no device work (30 launches per round at
  Laguna XS.2's 30 sliding layers). A DFlash drafter reads its context ring with draft queries at
  positions the ring holds no rows for yet (`DFlashDrafter.draft`), after rewinding the ring to a
  shorter prompt (`resume`): its rings (`reads_ahead` True) mark the slots of positions >= r
  empty at once, or those queries would see the forgotten rows.
- `rollback(0)` also forgets `highest`: with no row left there is none to lose, and an emptied
  ring refilled by a new request must allow the rewinds a fresh ring allows (`can_rewind_to`),
  or prefix reuse would refuse it. A partial rollback keeps `highest`: the rows its drafts
  overwrote are lost.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from lucebox.caches.base import KVBlock, KVCache, RowTable, Step, move_slots, path_moves


class SlidingRing(KVCache):
    def __init__(self, window: int, max_step: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, reads_ahead: bool = False, windowed: bool = False):
        """`windowed`: every query that reads the ring attends with the ring's own window (a sliding
        layer's ring), so a step may be handed its window's rows alone (`blocks`). Rings that only
        bound what is kept (a draft model's full layers, a DFlash drafter's context) are read whole."""
        self.window, self.max_step, self.reads_ahead, self.windowed = window, max_step, reads_ahead, windowed
        self.capacity = window + max_step
        self.k = torch.zeros((kv_heads, self.capacity, head_dim), dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.positions = torch.full((self.capacity,), -1, dtype=torch.int64, device=device)
        self.highest = 0  # one past the highest position ever written (rolled back or not)
        # slot = position % capacity, as a one-chunk table
        self.rows = RowTable(self.k, self.v, self.positions, torch.zeros(1, dtype=torch.int64, device=device),
                             self.capacity)

    def reserve(self, step: Step) -> None:
        if step.count > self.max_step:
            raise ValueError(f"a ring sized for {self.max_step} rows per step was given {step.count}")
        self.dirty = True
        # `highest` moves before any slot is overwritten, so a write cut short midway is already
        # judged by `can_rewind_to`.
        self.highest = max(self.highest, step.end)

    def store(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        slots = positions % self.capacity
        self.k.index_copy_(1, slots, k.transpose(0, 1))
        self.v.index_copy_(1, slots, v.transpose(0, 1))
        self.positions.index_copy_(0, slots, positions)  # last, so a slot never names a row it lacks

    def row_table(self) -> RowTable:
        return self.rows

    def blocks(self, q: torch.Tensor, step: Step) -> Iterator[KVBlock]:
        # In a `windowed` ring a query at p sees positions p - window + 1 .. p, so a step sees only
        # the slots of positions start - window + 1 .. end - 1 (tree rows sit at true positions
        # below end). Where those do not wrap round the ring's end, attend over them alone: a decode
        # step reads a window of keys, not the whole capacity (a fifth of it with a 512-row prefill
        # chunk). Where they wrap and are at most half the ring, its two ends are joined in a copy
        # (three small copies cost less than attending twice the keys).
        first, last = max(0, step.start - self.window + 1), step.end - 1
        lo, hi = first % self.capacity, last % self.capacity
        if self.windowed and last - first < self.capacity and lo <= hi:
            yield KVBlock(self.k[:, lo : hi + 1], self.v[:, lo : hi + 1], self.positions[lo : hi + 1])
            return
        if self.windowed and last - first < self.capacity // 2:
            yield KVBlock(*(torch.cat((t[..., lo:, :], t[..., : hi + 1, :]), -2) for t in (self.k, self.v)),
                          torch.cat((self.positions[lo:], self.positions[: hi + 1])))
            return
        # Until the ring wraps, slots past the highest position written hold nothing: leave them out
        # (a drafter ring of 4096 slots at a 200-token context would otherwise attend 20x the keys).
        used = min(self.highest, self.capacity)
        yield KVBlock(self.k[:, :used], self.v[:, :used], self.positions[:used])

    def graphable(self, step: Step) -> bool:
        return True

    def static_block(self, q: torch.Tensor) -> KVBlock:
        return KVBlock(self.k, self.v, self.positions, ring=True)  # empty slots hold position -1: masked

    def can_rewind_to(self, position: int) -> bool:
        """Whether every row a query at `position` or later needs is still intact."""
        return max(0, position - self.window + 1) >= max(0, self.highest - self.capacity)

    def rollback(self, to_position: int) -> None:
        if self.reads_ahead:
            self.positions.masked_fill_(self.positions >= to_position, -1)
        if to_position == 0:  # emptied: no row is left to lose, whatever was written before
            self.highest = 0

    def empty(self) -> None:
        """Forget every row, in place (a graph reads the ring by address): for a sequence that
        starts past position 0, whose queries would otherwise see the rows before it."""
        self.positions.fill_(-1)
        self.highest = 0

    def accept_path(self, start: int, rows: list[int]) -> None:
        # A tree step spans at most `max_step` rows, like a chain step: its scratch slots overwrite
        # only rows the capacity invariant already allows it to.
        # The destination slots already name their positions: the step itself wrote them.
        src, dst = path_moves(start, rows)
        if src:
            device = self.k.device
            move_slots(self.k, self.v, torch.tensor(src, device=device) % self.capacity,
                       torch.tensor(dst, device=device) % self.capacity)

    def device_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size() + self.positions.numel() * 8

    def memory(self) -> dict[str, int]:
        return {"ring_caches": self.device_bytes()}

