"""CUDA graphs for decode and verify forwards (fixed widths 1..16), captured piecewise.

A forward is a chain of stretches of pure device work (norms, projections, RoPE, the attention
gate, MLP/MoE with routing) cut by each layer's attention, whose caches decide on the host where
rows go and which blocks are visible (rings, the paged pool, host chunks). Each stretch between
two attentions is one captured graph:

    segment 0:      embed, first norm, layer 0 up to its q/k/v
    segment i + 1:  layer i after attention (gate, output projection, MLP), layer i + 1 up to q/k/v
    last segment:   the last layer after attention, the final norm

and a replay runs: copy ids and positions into static buffers, replay segment 0, then for each
layer attend eagerly (writing into the caches), copy the output into the next segment's static
input, replay that segment. So a decode step costs one graph launch per layer plus the attention
launches instead of the ~25 kernel launches per layer of the eager path, and every cache keeps
its own (eager, tested) logic. Graphs replay in the order they were captured, which is what lets
them share one memory pool.

Every segment is a function of tensors captured once; on the CPU (`capture=False`) the same
segments simply run eagerly, which is how the tests check the chaining without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lucebox.caches import SequenceCache, Step
from lucebox.config import DECODE_ROWS


class _Segment:
    """One stretch of device work: run eagerly, or captured once and replayed; `out` holds its
    outputs (static tensors once captured), which the next segment reads."""

    def __init__(self, fn: Callable[[], tuple]):
        self.fn = fn
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: tuple = ()

    def capture(self, pool) -> None:
        """Capture on the current (side) stream. `torch.cuda.graph` would do the same but also
        synchronize and empty the allocator's cache for each of the ~41 segments of a width."""
        self.graph = torch.cuda.CUDAGraph()
        self.graph.capture_begin(pool=pool)
        try:
            self.out = self.fn()
        finally:
            self.graph.capture_end()

    def run(self) -> tuple:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.out = self.fn()
        return self.out


class WidthGraphs:
    """The segments of a forward of exactly `width` rows, with their static inputs."""

    def __init__(self, decoder, width: int, capture: bool):
        self.decoder, self.width = decoder, width
        cfg, device = decoder.cfg, decoder.device
        self.ids = torch.zeros(width, dtype=torch.long, device=device)
        self.positions = torch.arange(width, dtype=torch.long, device=device)
        self.attn_out = [torch.zeros((width, layer.num_heads, cfg.head_dim), dtype=decoder.dtype, device=device)
                         for layer in cfg.layers]
        n = len(cfg.layers)
        self.segments = [_Segment(self._first)] + [_Segment(self._between(i)) for i in range(n)]
        if capture:
            self._capture()

    def _first(self) -> tuple:
        x, h = self.decoder.embed(self.ids)
        return (x, h, *self.decoder.pre_attention(0, h, self.positions))

    def _between(self, i: int) -> Callable[[], tuple]:
        def segment() -> tuple:
            x, h = self.segments[i].out[:2]
            x, h = self.decoder.post_attention(i, x, h, self.attn_out[i])
            if i + 1 == len(self.decoder.cfg.layers):
                return x, h
            return (x, h, *self.decoder.pre_attention(i + 1, h, self.positions))
        return segment

    def _capture(self) -> None:
        # One eager pass first, so Triton compiles and cuBLAS picks its kernels outside the
        # capture; then every segment is captured on the same side stream (capture cannot run on
        # the default stream) into one shared memory pool.
        device = self.decoder.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for segment in self.segments:
                segment.run()
            side.synchronize()
            pool = torch.cuda.graph_pool_handle()
            for segment in self.segments:
                segment.capture(pool)
        torch.cuda.current_stream(device).wait_stream(side)

    def forward(self, token_ids: torch.Tensor, step: Step, cache: SequenceCache, layers: tuple[int, ...]):
        self.ids.copy_(token_ids)
        self.positions.copy_(step.positions)
        captured: dict[int, torch.Tensor] = {}
        out = self.segments[0].run()
        for i in range(len(self.decoder.cfg.layers)):
            q, key, value = out[2:]
            self.attn_out[i].copy_(self.decoder.attend(i, q, key, value, step, cache))
            out = self.segments[i + 1].run()
            if i in layers:
                captured[i] = out[0]
        # Static outputs are overwritten by the next replay: hand out copies.
        features = torch.cat([captured[i] for i in layers], dim=-1) if layers else None
        return out[1].clone(), features


class DecodeGraphs:
    """Per-width `WidthGraphs` of one decoder, captured the first time a width is used."""

    def __init__(self, decoder, capture: bool = True):
        self.decoder, self.capture = decoder, capture
        self.widths: dict[int, WidthGraphs] = {}

    def serves(self, token_ids: torch.Tensor, step: Step) -> bool:
        return not step.prefill and 1 <= token_ids.shape[0] <= DECODE_ROWS

    def forward(self, token_ids: torch.Tensor, step: Step, cache: SequenceCache, layers: tuple[int, ...]):
        width = token_ids.shape[0]
        if width not in self.widths:
            self.widths[width] = WidthGraphs(self.decoder, width, self.capture)
        return self.widths[width].forward(token_ids, step, cache, layers)
