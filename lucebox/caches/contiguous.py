"""The plain cache: slot = position, grown on demand. The reference the others are tested against."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from lucebox.caches.base import KVBlock, KVCache, Step, move_slots, path_moves


class ContiguousCache(KVCache):
    def __init__(self, kv_heads: int, head_dim: int, max_tokens: int, dtype: torch.dtype, device: torch.device):
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.max_tokens = max_tokens
        self.dtype, self.device = dtype, device
        self.length = 0
        self.k = torch.empty((kv_heads, 0, head_dim), dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)

    def _grow(self, needed: int) -> None:
        if needed <= self.k.shape[1]:
            return
        capacity = min(self.max_tokens, max(needed, 2 * self.k.shape[1], 256))
        grown = []
        for old in (self.k, self.v):
            grown.append(torch.empty((self.kv_heads, capacity, self.head_dim), dtype=self.dtype, device=self.device))
            grown[-1][:, : self.length] = old[:, : self.length]
        self.k, self.v = grown  # both at once: a half-grown pair would pass the size check above

    def reserve(self, step: Step) -> None:
        if step.start > self.length:
            raise ValueError(f"cache write at position {step.start} leaves a gap after {self.length} rows")
        self.dirty = True
        self._grow(step.end)
        self.length = step.end

    def store(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k.index_copy_(1, positions, k.transpose(0, 1))
        self.v.index_copy_(1, positions, v.transpose(0, 1))

    def blocks(self, q: torch.Tensor, step: Step) -> Iterator[KVBlock]:
        positions = torch.arange(self.length, device=self.device)
        yield KVBlock(self.k[:, : self.length], self.v[:, : self.length], positions)

    def rollback(self, to_position: int) -> None:
        self.length = min(self.length, to_position)

    def accept_path(self, start: int, rows: list[int]) -> None:
        src, dst = path_moves(start, rows)
        if src:
            move_slots(self.k, self.v, torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device))

    def device_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()
