"""The contract every per-layer KV cache keeps, and the step object a forward carries.

Vocabulary: a row is the K and V of one token in one layer, RoPE already applied, so where a row
sits never matters. `written` rows may include drafts; `commit(n)` says positions < n are final;
`rollback(n)` forgets positions >= n.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Step:
    """What one forward is: its rows' absolute positions and whether it is a prompt prefill
    (always exact attention) or a decode/verify step (attention follows the cache's policy)."""

    positions: torch.Tensor  # (T,) int64, consecutive
    prefill: bool = False

    @property
    def start(self) -> int:
        return int(self.positions[0])

    @property
    def end(self) -> int:
        return self.start + len(self.positions)


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


class LayerCache(ABC):
    """One decoder layer's K/V for one sequence.

    Interrupt safety: a `write` sets `dirty` before it changes anything, and the `SequenceCache`
    clears it once the step's commit completes, so a step cut short by an exception (Ctrl-C
    included) marks the cache as not to be reused. Each bookkeeping update is also ordered
    compute-then-assign, so an interrupt between two lines leaves the old state, the new one, or
    a safe one in between (a choice marked due again, a slot left free), never fields that
    disagree."""

    dirty = False

    @abstractmethod
    def write(self, step: Step, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store rows (T, KV, D) at `step.positions`; may overwrite rolled-back positions."""

    @abstractmethod
    def blocks(self, q: torch.Tensor, step: Step) -> Iterator[KVBlock]:
        """The key blocks queries q (T, Hq, D) of this step attend over (after `write`)."""

    @abstractmethod
    def rollback(self, to_position: int) -> None:
        """Forget positions >= to_position."""

    def commit(self, length: int) -> None:  # noqa: B027 - most caches need no notice of commits
        """Positions < length are final: no rollback will go below it."""

    @abstractmethod
    def device_bytes(self) -> int: ...

    def host_bytes(self) -> int:
        return 0
