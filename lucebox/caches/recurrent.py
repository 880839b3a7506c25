"""The state cache of one recurrent layer (Gated DeltaNet): conv and recurrent states in slots
allocated once at fixed addresses.

Unlike a K/V cache it keeps no rows: a state already folds in every row before its position, so
a state can only be returned to if it was kept. A decode/verify step of T rows keeps the state
after each of its rows, each in its own slot (as vLLM keeps one state per speculative token), so
a commit keeps the accepted row's state and a rollback to any position inside the step is exact,
with no recomputation. A prefill keeps only its final state. `held` maps each position whose
state is kept to its slot; a commit forgets those below it, since nothing rolls back past a
commit. Slots: the verify rows a step may hold (`CacheSettings.decode_rows`), the state the
step started from, and `SNAPSHOTS` pinned states (`recurrent_slots`).

Pinned states (`pin`) outlive commits: the engine pins a prompt's turn boundary and its
second-to-last position, so a later prompt that shares only that prefix (a chat template that
rewrites the last answer, a retried turn) starts from there instead of from 0. The newest
`SNAPSHOTS` pins are kept; a rollback forgets those past its position.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from lucebox.caches.base import KVBlock, LayerCache, Step
from lucebox.config import LinearAttentionSpec
from lucebox.errors import CacheRewindError

SNAPSHOTS = 2  # pinned states per layer: a prompt's turn boundary and its second-to-last position


def recurrent_slots(decode_rows: int) -> int:
    """State slots per recurrent layer: one per verify row, the state the step started from, and
    the pinned snapshots."""
    return decode_rows + 1 + SNAPSHOTS


class RecurrentState(LayerCache):
    def __init__(self, spec: LinearAttentionSpec, decode_rows: int, dtype: torch.dtype, device: torch.device):
        slots = recurrent_slots(decode_rows)
        # The last conv_kernel - 1 conv inputs (q, k, v channels), in the activations' dtype.
        self.conv = torch.zeros(slots, spec.conv_kernel - 1, spec.conv_channels, dtype=dtype, device=device)
        # The delta rule's state, one (key_dim, value_dim) matrix per value head, in float32 at least:
        # it accumulates over the whole context.
        state_dtype = torch.promote_types(dtype, torch.float32)
        self.recurrent = torch.zeros(slots, spec.value_heads, spec.key_dim, spec.value_dim, dtype=state_dtype,
                                     device=device)
        self.rows = 0  # positions folded into the current state
        self.held = {0: 0}  # position -> slot holding the state before that position (slot 0 starts zeroed)
        self.pinned: tuple[int, ...] = ()  # positions whose states commits keep (ascending)
        self.every_row = False  # whether the step in progress keeps the state after each of its rows
        self._targets: list[tuple[int, int]] = []  # (position, slot) the step in progress writes

    def reserve(self, step: Step) -> None:
        """A step must continue exactly where the state is: its rows follow `rows`. Chooses the
        slots its states go to: free ones first, then those of the oldest kept positions."""
        if step.start != self.rows:
            raise CacheRewindError(f"a recurrent layer's state holds {self.rows} positions; a step starting at "
                                   f"{step.start} cannot continue it (recurrent states cannot skip or rewrite rows)")
        every_row = not step.prefill
        positions = list(range(step.start + 1, step.end + 1)) if every_row else [step.end]
        kept = {self.rows, *self.pinned}  # the state this step reads, and the pinned ones
        used = [slot for position, slot in sorted(self.held.items()) if position not in kept]
        free = [slot for slot in range(len(self.conv)) if slot not in self.held.values()] + used  # oldest used first
        if len(positions) > len(free):
            raise CacheRewindError(f"a decode step of {step.count} rows needs {step.count} free state slots; a "
                                   f"recurrent layer has {len(free)} beside the current and {len(self.pinned)} "
                                   f"pinned states (decode_rows + 1 + {SNAPSHOTS} in all)")
        self.dirty = True
        self.every_row, self._targets = every_row, list(zip(positions, free, strict=False))

    def current(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv (K - 1, C), recurrent (Hv, Dk, Dv)): the state a step starting at `rows` reads."""
        slot = self.held[self.rows]
        return self.conv[slot], self.recurrent[slot]

    def update(self, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        """The states after the step's rows (each row's with `every_row`, else the last's), copied
        into the slots `reserve` chose."""
        slots = [slot for _, slot in self._targets]
        index = torch.tensor(slots, device=self.conv.device)
        self.conv.index_copy_(0, index, conv.reshape(len(slots), *self.conv.shape[1:]).to(self.conv.dtype))
        self.recurrent.index_copy_(0, index, recurrent.reshape(len(slots), *self.recurrent.shape[1:]))
        kept = {position: slot for position, slot in self.held.items() if slot not in slots}
        self.held = kept | dict(self._targets)
        self.rows = self._targets[-1][0]

    def store(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        raise TypeError("a recurrent layer keeps no K/V rows: its mixer updates its state (`update`)")

    def blocks(self, q: torch.Tensor, step: Step) -> Iterator[KVBlock]:
        raise TypeError("a recurrent layer has no key blocks to attend over")

    def begin_commit(self, length: int) -> None:
        """Positions below `length` are final: their states are never returned to, so their slots free up."""
        self.held = {position: slot for position, slot in self.held.items()
                     if position >= length or position in self.pinned}

    def pin(self, position: int) -> None:
        """Keep the state at `position` (one the last step kept) across later commits; the oldest
        pin beyond `SNAPSHOTS` is let go (its slot frees at the next commit)."""
        if position not in self.held:
            raise CacheRewindError(f"a recurrent layer cannot pin position {position}: it holds the states of "
                                   f"positions {sorted(self.held)} only")
        self.pinned = tuple(sorted({*self.pinned, position}))[-SNAPSHOTS:]

    def rollback(self, to_position: int) -> None:
        self.check_rollback(to_position)
        if to_position >= self.rows:
            return
        if to_position in self.held:  # a state the last step kept, or a pinned one: exact, nothing recomputed
            self.held = {position: slot for position, slot in self.held.items() if position <= to_position}
            self.pinned = tuple(position for position in self.pinned if position <= to_position)
        else:  # back to the start
            self.conv[0].zero_()
            self.recurrent[0].zero_()
            self.held, self.pinned = {0: 0}, ()
        self.rows = to_position

    def check_rollback(self, to_position: int) -> None:
        """CacheRewindError unless `rollback(to_position)` is exact: at or past `rows`, a kept state, or 0."""
        if to_position < self.rows and not self.can_rewind_to(to_position):
            raise CacheRewindError(
                f"cannot roll a recurrent layer's state back from {self.rows} to {to_position} positions: it keeps "
                f"the states of positions {sorted(self.held)} only (each row of the last decode step's, the one "
                "before it and the pinned ones); only those or 0 can be returned to"
            )

    def can_rewind_to(self, position: int) -> bool:
        return position == 0 or position in self.held

    def device_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.recurrent))

    def memory(self) -> dict[str, int]:
        return {"recurrent_states": self.device_bytes()}
