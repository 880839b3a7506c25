"""The state cache of one recurrent layer (Gated DeltaNet): a conv state and a recurrent state,
allocated once at fixed addresses and updated in place.

Unlike a K/V cache it keeps no rows: after a step its state already folds in every row the step
wrote, so it can only be "rolled back" to where it is, or to 0 (emptied). `rows` counts the rows
folded in. Speculative decoding on it needs one state per verify row (issue 24); until then a
rollback below `rows` is refused, and the engine refuses drafters on hybrid models.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from lucebox.caches.base import KVBlock, LayerCache, Step
from lucebox.config import LinearAttentionSpec
from lucebox.errors import CacheRewindError


class RecurrentState(LayerCache):
    def __init__(self, spec: LinearAttentionSpec, dtype: torch.dtype, device: torch.device):
        channels = spec.conv_channels
        # The last conv_kernel - 1 conv inputs (q, k, v channels), in the activations' dtype.
        self.conv = torch.zeros(spec.conv_kernel - 1, channels, dtype=dtype, device=device)
        # The delta rule's state, one (key_dim, value_dim) matrix per value head, in float32 at least:
        # it accumulates over the whole context.
        state_dtype = torch.promote_types(dtype, torch.float32)
        self.recurrent = torch.zeros(spec.value_heads, spec.key_dim, spec.value_dim, dtype=state_dtype, device=device)
        self.rows = 0  # positions folded into the state

    def reserve(self, step: Step) -> None:
        """A step must continue exactly where the state is: its rows follow `rows`."""
        if step.start != self.rows:
            raise CacheRewindError(f"a recurrent layer's state holds {self.rows} positions; a step starting at "
                                   f"{step.start} cannot continue it (recurrent states cannot skip or rewrite rows)")
        self.dirty = True

    def update(self, conv: torch.Tensor, recurrent: torch.Tensor, count: int) -> None:
        """The state after this step's `count` rows, copied into the fixed buffers."""
        self.conv.copy_(conv)
        self.recurrent.copy_(recurrent)
        self.rows += count

    def store(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        raise TypeError("a recurrent layer keeps no K/V rows: its mixer updates its state (`update`)")

    def blocks(self, q: torch.Tensor, step: Step) -> Iterator[KVBlock]:
        raise TypeError("a recurrent layer has no key blocks to attend over")

    def rollback(self, to_position: int) -> None:
        self.check_rollback(to_position)
        if to_position >= self.rows:
            return
        self.conv.zero_()
        self.recurrent.zero_()
        self.rows = 0

    def check_rollback(self, to_position: int) -> None:
        """CacheRewindError unless `rollback(to_position)` is exact: at or past `rows`, or 0."""
        if 0 < to_position < self.rows:
            raise CacheRewindError(
                f"cannot roll a recurrent layer's state back from {self.rows} to {to_position} positions: the state "
                "folds in every row it saw (only its own length or 0 can be returned to); speculative decoding on "
                "recurrent layers is not supported yet"
            )

    def can_rewind_to(self, position: int) -> bool:
        return position == 0 or position == self.rows

    def device_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.conv, self.recurrent))

    def memory(self) -> dict[str, int]:
        return {"recurrent_states": self.device_bytes()}
