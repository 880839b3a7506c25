"""The state cache of one recurrent layer (Gated DeltaNet): conv and recurrent states in slots
allocated once at fixed addresses.

Unlike a K/V cache it keeps no rows: a state already folds in every row before its position, so
a state can only be returned to if it was kept. The state after position p lives in ring slot
p % ring (ring = decode_rows + 1): a decode/verify step of T <= decode_rows rows reads the slot of
its start and writes the state after each of its rows to the next T slots (as vLLM keeps one
state per speculative token), so the state it started from and every row's survive it. A commit
keeps the accepted row's state by leaving it where it is; a rollback to any position whose slot
was not overwritten since is exact, with no recomputation. A prefill keeps only its final state.
Slots follow from positions alone, so the device computes them from the step's positions, by the
same launches at every position: a graphed step captures them once (`StepState`).

Pinned states (`pin`) outlive the ring: copies in `SNAPSHOTS` slots of their own. The engine pins
a prompt's turn boundary and its second-to-last position, so a later prompt that shares only that
prefix (a chat template that rewrites the last answer, a retried turn) starts from there instead
of from 0. The newest `SNAPSHOTS` pins are kept; a rollback forgets those past its position.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lucebox.caches.base import StateCache, Step
from lucebox.config import LinearAttentionSpec
from lucebox.errors import CacheRewindError

SNAPSHOTS = 2  # pinned states per layer: a prompt's turn boundary and its second-to-last position


def recurrent_slots(decode_rows: int) -> int:
    """State slots per recurrent layer: the ring (a verify step's rows and the state it started
    from) and the pinned snapshots."""
    return decode_rows + 1 + SNAPSHOTS


@dataclass(frozen=True)
class StateSlots:
    """The ring slots one step reads (the state its first row continues, (1,)) and writes (the
    states after its rows: each row's with `every_row`, else the last's), computed on the device
    from the rows' positions; the same for every recurrent layer, so a step computes them once."""

    read: torch.Tensor
    write: torch.Tensor
    every_row: bool

    @classmethod
    def of(cls, positions: torch.Tensor, ring: int, every_row: bool) -> StateSlots:
        after = positions if every_row else positions[-1:]
        return cls(positions[:1] % ring, (after + 1) % ring, every_row)


class StepState:
    """A recurrent layer's state as one step's token mixer sees it: `current()` is the state its
    first row continues, `update` writes the states after its rows (`StateSlots`)."""

    def __init__(self, state: RecurrentState, slots: StateSlots):
        self.state, self.slots, self.every_row = state, slots, slots.every_row

    def current(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv (K - 1, C), recurrent (Hv, Dk, Dv))."""
        read = self.slots.read
        return self.state.conv.index_select(0, read)[0], self.state.recurrent.index_select(0, read)[0]

    def update(self, conv: torch.Tensor, recurrent: torch.Tensor) -> None:
        s, write = self.state, self.slots.write
        s.conv.index_copy_(0, write, conv.reshape(len(write), *s.conv.shape[1:]).to(s.conv.dtype))
        s.recurrent.index_copy_(0, write, recurrent.reshape(len(write), *s.recurrent.shape[1:]))


class RecurrentState(StateCache):
    """A Gated DeltaNet (or KDA) layer's conv and recurrent states, in a ring of `decode_rows + 1`
    slots and `SNAPSHOTS` pinned ones (the module docstring)."""

    def __init__(self, spec: LinearAttentionSpec, decode_rows: int, dtype: torch.dtype, device: torch.device):
        self.ring = decode_rows + 1
        slots = recurrent_slots(decode_rows)
        # The last conv_kernel - 1 conv inputs (q, k, v channels), in the activations' dtype.
        self.conv = torch.zeros(slots, spec.conv_kernel - 1, spec.conv_channels, dtype=dtype, device=device)
        # The delta rule's state, one (key_dim, value_dim) matrix per value head, in float32 at least:
        # it accumulates over the whole context.
        state_dtype = torch.promote_types(dtype, torch.float32)
        self.recurrent = torch.zeros(slots, spec.value_heads, spec.key_dim, spec.value_dim, dtype=state_dtype,
                                     device=device)
        self.rows = 0  # positions folded into the newest state
        self.held = {0}  # positions whose states the ring holds, each at position % ring (slot 0 starts zeroed)
        self.pinned: dict[int, int] = {}  # position -> snapshot slot (ring, ring + 1, ...)

    def reserve(self, step: Step) -> None:
        """A step must continue exactly where the state is: its rows follow `rows`. The host's
        bookkeeping of the slots the step's device work overwrites."""
        if step.start != self.rows:
            raise CacheRewindError(f"a recurrent layer's state holds {self.rows} positions; a step starting at "
                                   f"{step.start} cannot continue it (recurrent states cannot skip or rewrite rows)")
        if not step.prefill and step.count >= self.ring:
            raise CacheRewindError(f"a decode step of {step.count} rows needs {step.count + 1} state slots; a "
                                   f"recurrent layer's ring has {self.ring} (decode_rows + 1)")
        self.dirty = True
        written = range(step.start + 1, step.end + 1) if not step.prefill else [step.end]
        overwritten = {position % self.ring for position in written}
        kept = {position for position in self.held if position % self.ring not in overwritten}
        self.held, self.rows = kept | set(written), step.end

    def step_state(self, positions: torch.Tensor, prefill: bool, slots: StateSlots | None = None) -> StepState:
        return StepState(self, slots or StateSlots.of(positions, self.ring, every_row=not prefill))

    def graphable(self, step: Step) -> bool:
        return not step.prefill and step.count < self.ring

    def pin(self, position: int) -> None:
        """Copy the state at `position` (one the ring holds) to a snapshot slot that later steps
        never write; the oldest pin beyond `SNAPSHOTS` gives its slot up."""
        if position not in self.held:
            raise CacheRewindError(f"a recurrent layer cannot pin position {position}: its ring holds the states of "
                                   f"positions {sorted(self.held)} only")
        if position in self.pinned:
            return
        free = set(range(self.ring, self.ring + SNAPSHOTS)) - set(self.pinned.values())
        if not free:  # the oldest pin goes before its slot is written, so no pin ever names another's state
            oldest = min(self.pinned)
            free = {self.pinned[oldest]}
            self.pinned = {p: slot for p, slot in self.pinned.items() if p != oldest}
        slot = min(free)
        self._copy(position % self.ring, slot)
        self.pinned = {**self.pinned, position: slot}

    def rollback(self, to_position: int) -> None:
        self.check_rollback(to_position)
        if to_position >= self.rows:
            return
        if to_position in self.held:  # a state the ring still holds: exact, nothing recomputed
            self.held = {position for position in self.held if position <= to_position}
        elif to_position in self.pinned:  # back from its snapshot
            self.held = set()
            self._copy(self.pinned[to_position], to_position % self.ring)
            self.held = {to_position}
        else:  # back to the start
            self.held = set()
            self.conv[0].zero_()
            self.recurrent[0].zero_()
            self.held = {0}
        self.pinned = {p: slot for p, slot in self.pinned.items() if p <= to_position}
        self.rows = to_position

    def _copy(self, source: int, target: int) -> None:
        self.conv[target].copy_(self.conv[source])
        self.recurrent[target].copy_(self.recurrent[source])

    def check_rollback(self, to_position: int) -> None:
        """Exact rollbacks: to `rows`, a held or pinned state, or 0."""
        if to_position < self.rows and not self.can_rewind_to(to_position):
            raise CacheRewindError(
                f"cannot roll a recurrent layer's state back from {self.rows} to {to_position} positions: it keeps "
                f"the states of positions {sorted(self.returnable())} only (the last steps' rows while their ring "
                "slots are not overwritten, and the pinned ones); only those or 0 can be returned to"
            )

    def returnable(self) -> set[int]:
        return self.held | set(self.pinned) | {0}

    def device_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.recurrent))
