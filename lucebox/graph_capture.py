"""Device work run as one CUDA graph: the target's decode/verify steps (`engine.runner.StepGraph`) and the
drafter's pass (a DFlash block, `speculative.draft_graph`; an MTP head's row, `speculative.mtp_graph`).
`Graphed.body` reads only static inputs and buffers with fixed addresses; `run` captures it on its
first call (on CUDA) and replays it after, or runs it eagerly without CUDA (`capture=False`), which
is how the CPU tests check the same body. The body's outputs are the graph's static tensors: each
replay overwrites them."""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Generic, TypeVar

import torch

Out = TypeVar("Out")

# One side stream per device for every capture: a graph's private allocations are tagged with the
# stream it was captured on, and the shared pool hands a block freed by one graph to another only
# on the same stream, so graphs captured on streams of their own would barely share the pool.
_capture_streams: dict[torch.device, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream every graph on `device` is captured on (made on first use)."""
    if device not in _capture_streams:
        _capture_streams[device] = torch.cuda.Stream(device)
    return _capture_streams[device]


def capture(body: Callable[[], Out], device: torch.device, pool) -> tuple[torch.cuda.CUDAGraph, Out]:
    """Capture `body` into a graph and replay it once (the capture itself runs nothing).

    Capture cannot run on the default stream: a side stream runs one eager warm-up (Triton
    compiles, cuBLAS sets up its workspace for that stream, both outside the capture), then the
    capture, then the replay that does this call's work. Running the body twice must be harmless
    (a store rewrites the same rows at the same slots). Every graph allocates from one memory pool
    (`pool`): they replay one at a time on one stream, so one set of intermediates serves them
    all, and each graph's outputs stay allocated. The capture watches only this thread for
    forbidden calls ("thread_local"), so the server's worker thread capturing does not fail on
    what another thread does meanwhile. Every capture runs on one side stream (`capture_stream`),
    after a garbage collection: a tensor collected during the capture would free its block into
    the graph's pool mid-capture, and unreachable tensors still holding memory would only crowd it."""
    side = capture_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        body()
        side.synchronize()
        gc.collect()
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            out = body()
        finally:
            graph.capture_end()
    torch.cuda.current_stream(device).wait_stream(side)
    graph.replay()
    return graph, out


class Graphed(Generic[Out]):
    def __init__(self, device: torch.device, capture: bool, pool=None):
        """`pool`: the memory pool to capture into, or a callable giving it at capture time (a
        drafter's graph follows the steps' pool, which the runner replaces when it releases them)."""
        self.device, self.capture, self.pool = device, capture, pool
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: Out | None = None

    def body(self) -> Out:
        raise NotImplementedError

    def run(self) -> Out:
        if self.graph is not None:
            self.graph.replay()
        elif self.capture:
            self.graph, self.out = capture(self.body, self.device, self.pool() if callable(self.pool) else self.pool)
        else:
            self.out = self.body()
        return self.out
