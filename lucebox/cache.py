"""KV caches: one `LayerCache` per decoder layer, grouped in a `SequenceCache` per sequence.

Rows are written at absolute positions with RoPE already applied, so where a row sits never
matters to attention: `view` hands over keys, values and the position of every slot.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from lucebox.config import ModelConfig


class LayerCache(ABC):
    """Contract: `write` stores rows at absolute positions; `view` returns every stored row (and
    may return empty slots, marked with position -1); `rollback(n)` forgets positions >= n."""

    @abstractmethod
    def write(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...

    @abstractmethod
    def view(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(keys (S, KV, D), values (S, KV, D), positions (S,))."""

    @abstractmethod
    def rollback(self, to_position: int) -> None: ...

    @abstractmethod
    def device_bytes(self) -> int: ...

    def host_bytes(self) -> int:
        return 0


class ContiguousCache(LayerCache):
    """Slot = position. Grows by doubling up to `max_tokens`; rollback only moves the length."""

    def __init__(self, kv_heads: int, head_dim: int, max_tokens: int, dtype: torch.dtype, device: torch.device):
        self.shape = (kv_heads, head_dim)
        self.max_tokens = max_tokens
        self.dtype, self.device = dtype, device
        self.length = 0
        self.k = torch.empty((0, *self.shape), dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)

    def _reserve(self, needed: int) -> None:
        if needed <= self.k.shape[0]:
            return
        capacity = min(self.max_tokens, max(needed, 2 * self.k.shape[0], 256))
        for name in ("k", "v"):
            old = getattr(self, name)
            grown = torch.empty((capacity, *self.shape), dtype=self.dtype, device=self.device)
            grown[: self.length] = old[: self.length]
            setattr(self, name, grown)

    def write(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # Rows of one forward are consecutive positions continuing the sequence.
        start, end = int(positions[0]), int(positions[-1]) + 1
        if start > self.length or end - start != len(positions):
            raise ValueError(f"cache write of positions [{start}, {end}) after {self.length} cached rows")
        self._reserve(end)
        self.k[start:end] = k
        self.v[start:end] = v
        self.length = end

    def view(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        positions = torch.arange(self.length, device=self.device)
        return self.k[: self.length], self.v[: self.length], positions

    def rollback(self, to_position: int) -> None:
        self.length = min(self.length, to_position)

    def device_bytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


class SequenceCache:
    """The caches of every layer of one sequence, and how many positions they hold."""

    def __init__(self, cfg: ModelConfig, max_tokens: int, dtype: torch.dtype, device: torch.device):
        self.layers: list[LayerCache] = [
            ContiguousCache(cfg.num_kv_heads, cfg.head_dim, max_tokens, dtype, device) for _ in cfg.layers
        ]
        self.length = 0

    def rollback(self, to_position: int) -> None:
        for layer in self.layers:
            layer.rollback(to_position)
        self.length = min(self.length, to_position)

    def device_bytes(self) -> int:
        return sum(layer.device_bytes() for layer in self.layers)

    def host_bytes(self) -> int:
        return sum(layer.host_bytes() for layer in self.layers)
