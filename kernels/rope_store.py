"""A decode step's q/k RMSNorm, RoPE and K/V cache store as one operator, torch reference.

The graphed step stores each layer's new rows where a cache says a position's row lives
(`lucebox.caches.base.RowTable`: slot = table[(position // chunk) % len(table)] * chunk +
position % chunk), so the Triton version does all of it in one launch; this reference is the same
ops the unfused path runs (`rms_norm`, `rotate`, index copies), so both backends run one decoder.
"""

from __future__ import annotations

import torch
from lucebox.kernels.norm import rms_norm
from lucebox.kernels.rope import rotate


def row_slots(rows, positions: torch.Tensor) -> torch.Tensor:
    """The slots (T,) of `positions` (T,) in the planes of `rows` (a `RowTable`)."""
    return rows.table[(positions // rows.chunk) % rows.table.shape[0]] * rows.chunk + positions % rows.chunk


def norm_rope_store(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor,
                    inv_freq: torch.Tensor, scaling: float, norms: tuple[torch.Tensor, torch.Tensor] | None,
                    eps: float, rows, row_positions: torch.Tensor) -> torch.Tensor:
    """q (T, Hq, D) RMS-normed by norms[0] (when given) and rotated at `positions`, returned; key
    (T, KV, D) normed by norms[1] and rotated, and value, stored with `row_positions` in the
    planes of `rows` (`RowTable`), each at the slot of its row position, the position last."""
    if norms is not None:
        q, key = rms_norm(q, norms[0], eps), rms_norm(key, norms[1], eps)
    q, key = rotate((q, key), positions, inv_freq, scaling)
    slots = row_slots(rows, row_positions)
    rows.k.index_copy_(1, slots, key.transpose(0, 1))
    rows.v.index_copy_(1, slots, value.transpose(0, 1))
    rows.positions.index_copy_(0, slots, row_positions)  # last: a slot never names a row it lacks
    return q
