"""One block of host memory for every full-attention layer's offloaded K/V, allocated once at its
planned size and carved into per-layer regions.

On CUDA it is page-locked by registering ordinary memory with the driver (`cudaHostRegister`), not
through PyTorch's pinned allocator: that allocator rounds every request up to the next power of
two, so per-layer pinned blocks of 0.5 GiB each took twice the host memory the planner counted.
Registered memory is pinned byte for byte, so copies from it are asynchronous and the pinned
bytes are what `lucebox.memory.plan` counts (`kv_host_max`). Off CUDA it is ordinary memory, its
pages taken as they are touched.
"""

from __future__ import annotations

import weakref

import torch

ALIGN = 256  # bytes: every region starts aligned for any dtype and for fast DMA

# Page-locked memory of arenas that went, by size. Locking gigabytes touches every page (seconds),
# and a cache is made per request: the next arena of the same size takes it back, as PyTorch's
# pinned allocator keeps its blocks. It stays locked for the process's life.
_RELEASED: dict[int, list[torch.Tensor]] = {}


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class HostArena:
    """`capacity` bytes of host memory (pinned when `pin`), handed out by `take` in order.

    Contract: one allocation for the arena's life; `take` never allocates and refuses to hand out
    more than the capacity (the plan sized it); `taken` counts the bytes handed out, so
    `capacity` and `taken` are what the host holds for K/V and what its layers use of it."""

    def __init__(self, capacity: int, pin: bool = False):
        self.capacity, self.pinned = capacity, pin
        self.taken = 0
        if pin and capacity and _RELEASED.get(capacity):
            self.memory = _RELEASED[capacity].pop()
        else:
            self.memory = torch.empty(capacity, dtype=torch.uint8)
            if pin and capacity:
                _register(self.memory)
        if pin and capacity:
            # Kept locked for the next arena of its size when this one goes (its regions' holders
            # keep it alive until then): the finalizer holds the memory.
            weakref.finalize(self, _release, self.memory)

    def take(self, nbytes: int) -> torch.Tensor:
        """The next `nbytes` of the arena (uint8, 1-D), starting aligned."""
        start = aligned(self.taken)
        if start + nbytes > self.capacity:
            raise ValueError(f"host KV arena of {self.capacity} bytes cannot give {nbytes} more "
                             f"({start} already handed out): the plan sized it smaller")
        self.taken = start + nbytes
        return self.memory[start : start + nbytes]


def _register(memory: torch.Tensor) -> None:
    """Page-lock `memory` in place for the device's copies."""
    error = torch.cuda.cudart().cudaHostRegister(memory.data_ptr(), memory.numel(), 0)
    if int(error) != 0:
        raise RuntimeError(f"cudaHostRegister of {memory.numel()} bytes of host KV failed (CUDA error {int(error)})")


def _release(memory: torch.Tensor) -> None:
    # Copies queued into or out of the arena (a completed chunk's store, a load's staging) may still
    # run when its cache goes: the memory is handed on only after they are done.
    torch.cuda.synchronize()
    _RELEASED.setdefault(memory.numel(), []).append(memory)
