"""The device side of a tree-verify step: which of the step's own rows each row may see.

A tree step writes row i at scratch position c + i (slots never collide) while RoPE and attention
use its true position c + depth_i (`kernels.attention`, `tree_bits`). Row i sees its ancestors and
itself; on a sliding layer only those whose depth is within the window of its own, exactly as the
rows of one path would see each other in a chain step.
"""

from __future__ import annotations

import torch

from lucebox.limits import DECODE_ROWS


class TreeMask:
    """bits (T,) int64: row i's ancestor-or-self rows as bits; depths (T,) int64 (row 0, the
    root, at depth 0). Device tensors: a graphed step holds them as static inputs."""

    def __init__(self, bits: torch.Tensor, depths: torch.Tensor):
        self.bits, self.depths = bits, depths
        self._by_window: dict[int | None, torch.Tensor] = {}

    def bits_for(self, window: int | None) -> torch.Tensor:
        """The bits of the ancestors within `window` of each row (by depth), made once per forward."""
        if window is None or window >= DECODE_ROWS:  # ancestors are fewer than DECODE_ROWS deep
            return self.bits
        if window not in self._by_window:
            rows = torch.arange(self.bits.shape[0], device=self.bits.device)
            ancestor = (self.bits[:, None] >> rows[None, :]) & 1  # (T, T)
            near = (self.depths[:, None] - self.depths[None, :]) < window
            self._by_window[window] = ((ancestor * near) << rows[None, :]).sum(dim=1)
        return self._by_window[window]
