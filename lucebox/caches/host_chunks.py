"""Host memory for full-attention K/V in 64-token chunks (pinned on CUDA, so copies are async).

A chunk is copied here when it leaves the device pool (and only if a step wrote to it since its
last copy), so a rollback is only a change of length.
"""

from __future__ import annotations

import torch


class HostChunks:
    """K and V as (KV, tokens, D), head-major like every cache, grown a chunk-multiple at a time."""

    def __init__(self, chunk: int, kv_heads: int, head_dim: int, max_chunks: int,
                 dtype: torch.dtype, device: torch.device):
        self.chunk, self.max_chunks = chunk, max_chunks
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.pin = device.type == "cuda"
        self.k = self._empty(0)
        self.v = self._empty(0)

    def _empty(self, chunks: int) -> torch.Tensor:
        shape = (self.kv_heads, chunks * self.chunk, self.head_dim)
        return torch.empty(shape, dtype=self.dtype, pin_memory=self.pin)

    def reserve(self, chunks: int) -> None:
        held = self.k.shape[1] // self.chunk
        if chunks <= held:
            return
        if chunks > self.max_chunks:
            raise ValueError(f"host KV asked for {chunks} chunks, planned for {self.max_chunks}")
        capacity = min(self.max_chunks, max(chunks, 2 * held, 16))
        if self.pin:
            torch.cuda.synchronize(self.device)  # pending device-to-host copies (any stream) land first
        grown = []
        for old in (self.k, self.v):
            grown.append(self._empty(capacity))
            grown[-1][:, : old.shape[1]] = old
        self.k, self.v = grown  # both at once: a half-grown pair would pass the size check above

    def store(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Rows (KV, n, D) at positions start.. (async device-to-host copies on CUDA, in the current
        stream's order)."""
        end = start + k.shape[1]
        self.reserve(-(-end // self.chunk))
        self.k[:, start:end].copy_(k, non_blocking=self.pin)
        self.v[:, start:end].copy_(v, non_blocking=self.pin)

    def fetch(self, first: int, last: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Chunks [first, last) on the device, (KV, n*chunk, D) each; stream-ordered after the writes
        (on the CPU a view, no copy)."""
        rows = slice(first * self.chunk, last * self.chunk)
        return (self.k[:, rows].to(self.device, non_blocking=self.pin),
                self.v[:, rows].to(self.device, non_blocking=self.pin))

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()
