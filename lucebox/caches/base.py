"""The contract every per-layer cache keeps (`LayerCache`), its two kinds (`KVCache`, `StateCache`),
and the step object a forward carries.

Vocabulary: a row is the K and V of one token in one layer, RoPE already applied, so where a row
sits never matters. `written` rows may include drafts; `commit(n)` says positions < n are final;
`rollback(n)` forgets positions >= n. A tree-verify step writes its rows at scratch positions
start + i and `accept_path` moves the accepted path's rows into place before the commit.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the one state cache's step view; its module builds on this one
    from lucebox.caches.recurrent import StateSlots, StepState


class Step:
    """What one forward is: its rows' absolute positions and whether it is a prompt prefill
    (always exact attention) or a decode/verify step (attention follows the cache's policy).

    `start` and `count` are host integers, so the caches' bookkeeping never reads a device value
    (on a GPU each read waits for the queued work). The engine builds steps with `Step.span`,
    whose device `positions` are made only if something asks for them (a graphed step uploads
    its own); a step built from positions alone reads its start once."""

    __slots__ = ("_device", "_positions", "count", "prefill", "start")

    def __init__(self, positions: torch.Tensor | None = None, prefill: bool = False, start: int | None = None,
                 count: int | None = None, device: torch.device | None = None):
        """From `positions` (T,) int64, consecutive (their start read from them unless given), or,
        with `positions` None, from `start`, `count` and `device` (what `span` passes)."""
        self._positions = positions
        self._device = positions.device if positions is not None else device
        self.prefill = prefill
        self.start = int(positions[0]) if start is None else start
        self.count = len(positions) if positions is not None else count

    @classmethod
    def span(cls, start: int, count: int, device: torch.device, prefill: bool = False) -> Step:
        """The step of `count` rows at positions start, start + 1, ..."""
        return cls(None, prefill, start, count, device)

    @property
    def positions(self) -> torch.Tensor:
        if self._positions is None:
            self._positions = torch.arange(self.start, self.end, device=self._device)
        return self._positions

    @property
    def end(self) -> int:
        return self.start + self.count


def path_moves(start: int, rows: list[int]) -> tuple[list[int], list[int]]:
    """(from, to) positions of the rows `accept_path` must move: a row already in place stays."""
    moves = [(start + a, start + 1 + j) for j, a in enumerate(rows) if a != j + 1]
    return [s for s, _ in moves], [d for _, d in moves]


def move_slots(*planes_and_slots) -> None:
    """planes (X, slots, ...) then src and dst slot indices: every plane's src slots copied onto its
    dst slots, all gathered before any is written."""
    *planes, src, dst = planes_and_slots
    for plane in planes:
        plane.index_copy_(1, dst, plane.index_select(1, src))


@dataclass
class KVBlock:
    """Keys and values attention must see for one step, in one piece.

    A key is visible to a query at position p when 0 <= position <= p (and within the layer's
    window); with `pinned` set, additionally only if it is pinned or among the last `recent`
    positions before p (how KVFlash `select` limits a step to sink + tail + chosen chunks)."""

    k: torch.Tensor  # (KV, S, D): head-major, so each head's keys are one strided matrix
    v: torch.Tensor  # (KV, S, D)
    positions: torch.Tensor  # (S,), -1 for empty slots
    pinned: torch.Tensor | None = None  # (S,) bool
    recent: int = 0
    all_visible: bool = False  # every key is older than every query and none is empty: no mask needed
    k_scale: torch.Tensor | None = None  # (KV, S) float32: k and v hold int8 rows (`kernels.kv_int8`)
    v_scale: torch.Tensor | None = None
    ring: bool = False  # a ring's whole buffer: each position's slot is position % S


@dataclass(frozen=True)
class RowTable:
    """Where a position's row lives in a cache's planes, in a form one kernel reads and writes
    (`kernels.rope_store`): slot = table[(position // chunk) % len(table)] * chunk + position % chunk.
    A ring is a one-entry table of 0 with chunk = capacity; a paged pool is its page table with its
    chunk size. The same tensors for the cache's life (a CUDA graph holds their addresses)."""

    k: torch.Tensor  # (KV, S, D)
    v: torch.Tensor  # (KV, S, D)
    positions: torch.Tensor  # (S,): each slot's position, -1 for none
    table: torch.Tensor  # int64
    chunk: int


class LayerCache(ABC):
    """What every cache of one decoder layer for one sequence keeps, whatever its kind: the
    host's bookkeeping of a step (`reserve`), commits and rollbacks, what it allows (rewinds,
    step lengths, graphs) and its memory. Two kinds keep it: `KVCache` (rows of keys and values
    an attention layer reads) and `StateCache` (a recurrent layer's state); `SequenceCache` holds
    each layer's by its kind, so nothing asks which kind a cache is.

    Interrupt safety: a step's `reserve` sets `dirty` before it changes anything, and the
    `SequenceCache` clears it once the step's commit completes, so a step cut short by an exception
    (Ctrl-C included) marks the cache as not to be reused. Each bookkeeping update is also ordered
    compute-then-assign, so an interrupt between two lines leaves the old state, the new one, or
    a safe one in between (a choice marked due again, a slot left free), never fields that
    disagree."""

    dirty = False

    @abstractmethod
    def reserve(self, step: Step) -> None:
        """The host's half of a step, run before its device work: bookkeeping in host integers, and
        any irregular device work the step needs first (a chunk brought back from the host). Reads
        no device value."""

    def graphable(self, step: Step) -> bool:
        """Whether this decode/verify step's device work is the same at every position, so a CUDA
        graph captured once can run it (a `KVCache` attends over its `static_block`)."""
        return False

    @abstractmethod
    def rollback(self, to_position: int) -> None:
        """Forget positions >= to_position."""

    def commit(self, length: int) -> None:
        """Positions < length are final: no rollback will go below it. In three parts, so that
        `SequenceCache` reads back what all its layers need in one transfer."""
        self.begin_commit(length)
        ranking = self.ranking(length)
        self.finish_commit(length, None if ranking is None else ranking.flatten().tolist())

    def begin_commit(self, length: int) -> None:  # noqa: B027 - most caches need no notice of commits
        """The commit's first half: bookkeeping that reads nothing back."""

    def ranking(self, length: int) -> torch.Tensor | None:
        """After `commit(length)`: device values the commit must read back to finish (KVFlash
        `select`'s ranked chunks when a re-selection is due), or None."""
        return None

    def finish_commit(self, length: int, ranking: list | None) -> None:  # noqa: B027 - optional
        """The commit's second half, given `ranking` read back as a flat list (None if there was none)."""

    def can_rewind_to(self, position: int) -> bool:
        """Whether every row a query at `position` or later needs is still held (caches that never
        overwrite rows always can)."""
        return True

    def rows_before_reselect(self, position: int) -> int | None:
        """How many rows a step starting at `position` may hold (None: no limit of this cache's)."""
        return None

    @abstractmethod
    def device_bytes(self) -> int: ...

    def host_bytes(self) -> int:
        return 0

    def memory(self) -> dict[str, int]:
        """Bytes by kind (the keys of `SequenceCache.memory`), summed over the layers there."""
        return {"kv_pool_device": self.device_bytes(), "kv_host": self.host_bytes()}


class KVCache(LayerCache):
    """An attention layer's K/V rows: a step writes its rows (`reserve` + `store`) and attends over
    the key blocks the cache hands back (`blocks`, or `static_block` inside a graph)."""

    def write(self, step: Step, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store rows (T, KV, D) at `step.positions`; may overwrite rolled-back positions."""
        self.reserve(step)
        self.store(step.positions, k, v)

    @abstractmethod
    def store(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """The device's half of a write, after `reserve`: rows (T, KV, D) go to slots computed on
        the device from `positions`, by the same launches at every position (a CUDA graph
        captures it once and replays it at any position)."""

    def row_table(self) -> RowTable | None:
        """After `reserve`: where `store` would put the step's rows, for a kernel that stores them
        itself (same slots, the position written last), or None when only `store` can (int8 rows)."""
        return None

    @abstractmethod
    def blocks(self, q: torch.Tensor, step: Step) -> Iterator[KVBlock]:
        """The key blocks queries q (T, Hq, D) of this step attend over (after `write`)."""

    def static_block(self, q: torch.Tensor) -> KVBlock:
        """The one block a graphed decode/verify step attends over, after `reserve` and `store`:
        whole buffers with their device positions and masks, the same tensors at every step, so
        a graph captured once reads what the host's bookkeeping (in `reserve`, `commit`) wrote."""
        raise NotImplementedError(f"{type(self).__name__} has no static block")

    @abstractmethod
    def accept_path(self, start: int, rows: list[int]) -> None:
        """After a tree-verify step wrote its rows at positions start, start + 1, ...: the rows at
        start + rows[j] move to start + 1 + j (rows increasing, rows[j] >= j + 1, so the moves
        done in order never overwrite a row still to move). Then commit and rollback as after a
        chain step; the rows left past the path are rolled back. Runs no host read."""


class StateCache(LayerCache):
    """A recurrent layer's state: it keeps no rows, only the state after each position it holds,
    so it returns exactly only to the positions whose states it kept (`returnable`). A step reads
    and writes it through `step_state`; `pin` keeps a state past later steps (prefix reuse)."""

    def memory(self) -> dict[str, int]:
        return {"recurrent_states": self.device_bytes()}

    @abstractmethod
    def step_state(self, positions: torch.Tensor, prefill: bool, slots: StateSlots | None = None) -> StepState:
        """The state a step at `positions` reads and writes, after `reserve` (`slots`: those another
        state cache of the same step computed)."""

    @abstractmethod
    def pin(self, position: int) -> None:
        """Keep the state at `position` (one held now) across later steps, commits and rollbacks
        above it."""

    @abstractmethod
    def returnable(self) -> set[int]:
        """The positions a rollback returns to exactly."""

    def can_rewind_to(self, position: int) -> bool:
        return position in self.returnable()

    @abstractmethod
    def check_rollback(self, to_position: int) -> None:
        """`CacheRewindError` unless `rollback(to_position)` is exact; changes nothing (so
        `SequenceCache` refuses a rollback before any layer moves)."""
