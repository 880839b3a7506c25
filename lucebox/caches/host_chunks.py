"""Host memory for full-attention K/V in 64-token chunks (pinned on CUDA, so copies are async).

A chunk is copied here when it leaves the device pool (and only if a step wrote to it since its
last copy), so a rollback is only a change of length.
"""

from __future__ import annotations

import torch


class HostChunks:
    """The pool's planes, chunk by chunk: K and V as (chunks, KV, chunk, D), and with int8 K/V
    their scales as (chunks, KV, chunk). Each chunk of a plane is one contiguous block, so a
    chunk's copy to or from the device is one asynchronous transfer from pinned memory.

    Every plane is allocated once, at its planned size (`max_chunks`, from max_context), in one
    pinned arena: growing it would allocate new pinned memory and wait for the whole device
    (pending copies into the old blocks) in the middle of a request. The memory plan already
    counts these bytes (`kv_host`); off CUDA the arena is ordinary memory, taken as it is touched."""

    def __init__(self, chunk: int, kv_heads: int, head_dim: int, max_chunks: int,
                 dtype: torch.dtype, device: torch.device, int8: bool = False):
        self.chunk, self.max_chunks = chunk, max_chunks
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.device = device
        self.pin = device.type == "cuda"
        rows = (kv_heads, chunk, head_dim)
        # (shape of one chunk, dtype) of each plane, in the pool's order: k, v[, k scales, v scales]
        self.planes = [(rows, torch.int8), (rows, torch.int8), (rows[:2], torch.float32), (rows[:2], torch.float32)] \
            if int8 else [(rows, dtype), (rows, dtype)]
        sizes = [max_chunks * _numel(shape) * dtype.itemsize for shape, dtype in self.planes]
        arena = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=self.pin)
        self.parts, start = [], 0
        for size, (shape, dtype) in zip(sizes, self.planes, strict=True):
            self.parts.append(arena[start : start + size].view(dtype).view(max_chunks, *shape))
            start += size

    def reserve(self, chunks: int) -> None:
        if chunks > self.max_chunks:
            raise ValueError(f"host KV asked for {chunks} chunks, planned for {self.max_chunks}")

    def store(self, chunk: int, *parts: torch.Tensor) -> None:
        """One chunk of every plane ((KV, chunk, D) rows, (KV, chunk) scales), from its slot in the
        device pool (async on CUDA, in the current stream's order). Rows past what was written come
        along and are never read."""
        self.reserve(chunk + 1)
        for host, part in zip(self.parts, parts, strict=True):
            host[chunk].copy_(part, non_blocking=self.pin)

    def fetch(self, first: int, last: int) -> list[torch.Tensor]:
        """Chunks [first, last) of every plane on the device, (KV, n*chunk[, D]) each;
        stream-ordered after the stores."""
        n = last - first

        def rows(t: torch.Tensor) -> torch.Tensor:
            t = t[first:last].to(self.device, non_blocking=self.pin)
            return t.transpose(0, 1).reshape(self.kv_heads, n * self.chunk, *t.shape[3:])

        return [rows(t) for t in self.parts]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n
