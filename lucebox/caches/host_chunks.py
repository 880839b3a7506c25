"""Host memory for full-attention K/V in 64-token chunks (pinned on CUDA, so copies are async).

A complete chunk is copied here once its rows are committed (`ChunkResidency.copy_completed`), or
when it leaves the device pool if its host copy is not current, so evicting it is bookkeeping and a
rollback is only a change of length.
"""

from __future__ import annotations

import torch

from lucebox.caches.host_arena import HostArena, aligned


class HostChunks:
    """The pool's planes, chunk by chunk, in a region of a `HostArena` (a whole arena of its own
    when none is given): one row of `chunk_bytes` per chunk holding every plane of it side by side
    (K and V (KV, chunk, D), with int8 K/V their scales (KV, chunk)), in the pool's plane order.
    So a run of chunks is one contiguous block (one copy to the device), and any set of chunks is
    one gather into `staging` (`staging_chunks` rows) and one copy.

    The region is allocated at its planned size (`max_chunks`, from max_context): growing it would
    allocate new pinned memory and wait for the whole device in the middle of a request. The memory
    plan counts these bytes (`kv_host`, `region_bytes`)."""

    def __init__(self, chunk: int, kv_heads: int, head_dim: int, max_chunks: int,
                 dtype: torch.dtype, device: torch.device, int8: bool = False,
                 arena: HostArena | None = None, staging_chunks: int = 0):
        self.chunk, self.max_chunks = chunk, max_chunks
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.device = device
        self.planes = chunk_planes(chunk, kv_heads, head_dim, dtype, int8)
        self.chunk_bytes = sum(_numel(shape) * dtype.itemsize for shape, dtype in self.planes)
        size = self.region_bytes(self.chunk_bytes, max_chunks, staging_chunks)
        self.arena = arena or HostArena(size, pin=device.type == "cuda")
        self.pin = self.arena.pinned
        region = self.arena.take(size)
        self.rows = region[: max_chunks * self.chunk_bytes].view(max_chunks, self.chunk_bytes)
        staging_start = aligned(max_chunks * self.chunk_bytes)
        self.staging = region[staging_start : staging_start + staging_chunks * self.chunk_bytes].view(
            staging_chunks, self.chunk_bytes)
        self._staged: torch.cuda.Event | None = None  # when the last copy out of `staging` is done
        self._stored: torch.cuda.Event | None = None  # when the last copy into `rows` is done
        self.parts = self.unpack(self.rows)  # (max_chunks, *shape) views, one per plane

    @staticmethod
    def region_bytes(chunk_bytes: int, max_chunks: int, staging_chunks: int) -> int:
        """Bytes of one layer's region: its chunks, then (aligned) its staging rows."""
        return aligned(max_chunks * chunk_bytes) + staging_chunks * chunk_bytes

    def unpack(self, packed: torch.Tensor) -> list[torch.Tensor]:
        """The planes (n, *shape) of packed chunk rows (n, chunk_bytes), as views."""
        parts, start = [], 0
        for shape, dtype in self.planes:
            size = _numel(shape) * dtype.itemsize
            parts.append(packed[:, start : start + size].view(dtype).view(packed.shape[0], *shape))
            start += size
        return parts

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
        self._note_stored()

    def store_run(self, first: int, packed: torch.Tensor) -> None:
        """Chunks [first, first + n) from packed rows (n, chunk_bytes) on the device: one copy."""
        self.reserve(first + packed.shape[0])
        self.rows[first : first + packed.shape[0]].copy_(packed, non_blocking=self.pin)
        self._note_stored()

    def _note_stored(self) -> None:
        if self.pin:
            self._stored = torch.cuda.current_stream(self.device).record_event()

    def fetch(self, first: int, last: int) -> list[torch.Tensor]:
        """Chunks [first, last) of every plane on the device, (KV, n*chunk[, D]) each, in one copy;
        stream-ordered after the stores."""
        n = last - first
        packed = self.rows[first:last].to(self.device, non_blocking=self.pin)
        return [t.transpose(0, 1).reshape(self.kv_heads, n * self.chunk, *t.shape[3:]) for t in self.unpack(packed)]

    def gather(self, chunks: list[int]) -> torch.Tensor:
        """Packed rows (n, chunk_bytes) of `chunks` on the device: one gather into `staging` on the
        host, one copy, on the current stream (at most `staging` rows at a time)."""
        if len(chunks) > self.staging.shape[0]:
            raise ValueError(f"{len(chunks)} chunks to gather, staging holds {self.staging.shape[0]}")
        # The host reads `rows` and writes `staging` itself: the copies into the one and out of the
        # other must be done (a commit's read-back ago, a re-selection ago: no wait in practice).
        for done in (self._stored, self._staged):
            if done is not None:
                done.synchronize()
        staged = self.staging[: len(chunks)]
        torch.index_select(self.rows, 0, torch.tensor(chunks), out=staged)
        packed = staged.to(self.device, non_blocking=self.pin)
        if self.pin:
            self._staged = torch.cuda.current_stream(self.device).record_event()
        return packed

    def nbytes(self) -> int:
        return self.rows.numel() + self.staging.numel()


def chunk_planes(chunk: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 int8: bool) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape of one chunk, dtype) of each plane, in the pool's order: k, v[, k scales, v scales]."""
    rows = (kv_heads, chunk, head_dim)
    if int8:
        return [(rows, torch.int8), (rows, torch.int8), (rows[:2], torch.float32), (rows[:2], torch.float32)]
    return [(rows, dtype), (rows, dtype)]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for size in shape:
        n *= size
    return n


def staging_chunks(settings) -> int:
    """Rows of a layer's staging: what one `select` re-selection may load (`KVFlashSettings.select_k`)."""
    return settings.select_k if settings.policy == "select" else 0


def host_region_bytes(settings, kv_heads: int, head_dim: int, dtype: torch.dtype, int8: bool) -> int:
    """Host bytes one full-attention layer's `HostChunks` takes with these `KVFlashSettings` (0
    when its pool holds the whole context): what the arena and the memory plan count."""
    if not settings.offload:
        return 0
    return HostChunks.region_bytes(host_chunk_bytes(settings, kv_heads, head_dim, dtype, int8),
                                   -(-settings.max_context // settings.chunk), staging_chunks(settings))


def host_chunk_bytes(settings, kv_heads: int, head_dim: int, dtype: torch.dtype, int8: bool) -> int:
    """Bytes of one chunk of every plane."""
    return sum(_numel(shape) * dtype.itemsize for shape, dtype in chunk_planes(settings.chunk, kv_heads, head_dim,
                                                                                 dtype, int8))
