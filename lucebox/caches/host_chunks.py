"""Host memory for full-attention K/V in 64-token chunks (pinned on CUDA, so copies are async).

A chunk is copied here when it leaves the device pool (and only if a step wrote to it since its
last copy), so a rollback is only a change of length.
"""

from __future__ import annotations

import torch


class HostChunks:
    """K and V as (chunks, KV, chunk, D): each chunk one contiguous block, so a chunk's copy to or
    from the device is one asynchronous transfer from pinned memory; grown a few chunks at a time."""

    def __init__(self, chunk: int, kv_heads: int, head_dim: int, max_chunks: int,
                 dtype: torch.dtype, device: torch.device):
        self.chunk, self.max_chunks = chunk, max_chunks
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.pin = device.type == "cuda"
        self.k = self._empty(0)
        self.v = self._empty(0)

    def _empty(self, chunks: int) -> torch.Tensor:
        shape = (chunks, self.kv_heads, self.chunk, self.head_dim)
        return torch.empty(shape, dtype=self.dtype, pin_memory=self.pin)

    def reserve(self, chunks: int) -> None:
        held = self.k.shape[0]
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
            grown[-1][:held] = old
        self.k, self.v = grown  # both at once: a half-grown pair would pass the size check above

    def store(self, chunk: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """One chunk's rows (KV, chunk, D), from its slot in the device pool (async on CUDA, in the
        current stream's order). Rows past what was written come along and are never read."""
        self.reserve(chunk + 1)
        self.k[chunk].copy_(k, non_blocking=self.pin)
        self.v[chunk].copy_(v, non_blocking=self.pin)

    def fetch(self, first: int, last: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Chunks [first, last) on the device, (KV, n*chunk, D) each; stream-ordered after the stores."""
        n = last - first

        def rows(t: torch.Tensor) -> torch.Tensor:
            t = t[first:last].to(self.device, non_blocking=self.pin)
            return t.permute(1, 0, 2, 3).reshape(self.kv_heads, n * self.chunk, self.head_dim)

        return rows(self.k), rows(self.v)

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()
