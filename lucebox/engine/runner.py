"""The runner: a decode or verify step of the target model, as one CUDA graph per width.

Contract: `StepRunner.step(rows, step, cache, layers)` forwards the token ids `rows` at the
positions of `step` through the target, writing their K/V into `cache`, and returns (logits
(T, vocab), the outputs of decoder `layers` side by side or None). What runs where:

- on the host, before the step: every layer cache's `reserve` (host integers; a chunk brought
  back from the host when a step enters it; the `select` pinned mask after a reselect), and one
  copy of the step's token ids and positions into the graph's static input;
- on the device, in one graph captured per width (1..DECODE_ROWS) and replayed: embed, every
  layer (projections, RoPE, cache stores at slots computed from the positions, attention over
  each cache's `static_block`, MoE), the final norm and the LM head. Its launches and their
  arguments are the same at every position, which `tests/test_step_graph.py` checks;
- on the host, after: nothing until the caller reads the verdict (the speculation stage's one
  read per round). KVFlash re-selection runs in `commit`, between graphs, and writes the tables
  (pool rows, pinned mask, page table) a graph reads in place.

Steps a graph cannot serve run the same model eagerly: prefill chunks, steps wider than
DECODE_ROWS, and caches whose step needs irregular work (KVFlash `exact` with chunks on the
host streams them; the contiguous reference cache grows). A graph reads its cache's buffers by
address, so the graphs belong to one `SequenceCache` (the session's) until `release`.

Without CUDA (`capture=False`) the graphed path runs its step body eagerly, which is how the
CPU tests check it: same body, same static inputs, same cache tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lucebox.caches import SequenceCache, Step
from lucebox.engine.config import DECODE_ROWS
from lucebox.models.cache_contexts import StaticCacheContext
from lucebox.sampling import greedy_choices


@dataclass
class StepOutput:
    logits: torch.Tensor  # (T, vocab)
    choices: torch.Tensor  # (T,) each row's argmax, or -1 everywhere if a logit is not finite
    features: torch.Tensor | None  # (T, len(layers) * H): the outputs of the layers asked for


class StepGraph:
    """A decode/verify step of exactly `width` rows over one cache, capturing decoder `layers`."""

    def __init__(self, decoder, cache: SequenceCache, width: int, layers: tuple[int, ...], capture: bool):
        self.decoder, self.cache, self.layers = decoder, cache, layers
        self.inputs = torch.zeros((2, width), dtype=torch.long, device=decoder.device)  # token ids, positions
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: StepOutput | None = None
        self.capture = capture

    def body(self) -> StepOutput:
        """The step's device work, reading only `inputs` and the cache's tables."""
        d, ids, positions = self.decoder, self.inputs[0], self.inputs[1]
        context = StaticCacheContext(positions, self.cache, d.kernels, d.scale)
        hidden, features = d.run(ids, context, self.layers)
        logits = d.logits(hidden)
        return StepOutput(logits, greedy_choices(logits), features)

    def run(self) -> StepOutput:
        if self.graph is not None:
            self.graph.replay()
        elif self.capture:
            self._capture()
        else:
            self.out = self.body()
        return self.out

    def _capture(self) -> None:
        # Capture cannot run on the default stream: a side stream runs one eager warm-up (Triton
        # compiles, cuBLAS sets up its workspace for that stream, both outside the capture), then
        # the capture, then the replay that does this step's work (a capture runs nothing; its
        # outputs are the graph's static tensors). Running the step twice is harmless: a store
        # rewrites the same rows at the same slots.
        device = self.decoder.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            self.body()
            side.synchronize()
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin()
            try:
                self.out = self.body()
            finally:
                graph.capture_end()
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = graph
        graph.replay()


class StepRunner:
    """Owns the per-step device state: the static inputs and graphs of each width, bound to the
    cache they were captured over."""

    def __init__(self, decoder, graphs: bool, capture: bool | None = None):
        self.decoder = decoder
        self.graphs = graphs  # whether decode/verify steps take the graphed path at all
        self.capture = decoder.device.type == "cuda" if capture is None else capture
        self.widths: dict[tuple[int, tuple[int, ...]], StepGraph] = {}
        self._bound: SequenceCache | None = None
        self._staging = torch.zeros(2 * DECODE_ROWS, dtype=torch.long, pin_memory=self.capture)
        self._uploaded: torch.cuda.Event | None = None  # when the last upload from `_staging` was done

    def graphed(self, width: int, step: Step, cache: SequenceCache) -> bool:
        """Whether this step runs as a graph (else eagerly): graphs serve the bound cache (the
        session's; else the first one used) until `release`; a second, private cache runs
        eagerly rather than recapturing at every switch."""
        return (self.graphs and not step.prefill and 1 <= width <= DECODE_ROWS
                and (self._bound is None or cache is self._bound)
                and all(layer.graphable(step) for layer in cache.layers))

    def bind(self, cache: SequenceCache) -> None:
        """The cache graphs serve from now on (the engine's session cache)."""
        if cache is not self._bound:
            self.release()
            self._bound = cache

    def release(self) -> None:
        """Let the graphs and the cache they read go (the engine drops that cache)."""
        self.widths.clear()
        self._bound = None

    def step(self, rows: list[int], step: Step, cache: SequenceCache,
             layers: tuple[int, ...] = ()) -> StepOutput:
        width = len(rows)
        if not self.graphed(width, step, cache):
            ids = torch.tensor(rows, dtype=torch.long, device=self.decoder.device)
            hidden, features = self.decoder.forward_capturing(ids, step, cache, layers)
            logits = self.decoder.logits(hidden)
            return StepOutput(logits, greedy_choices(logits), features)
        for layer in cache.layers:
            layer.reserve(step)
        graph = self._graph(width, layers, cache)
        if self._uploaded is not None:
            self._uploaded.synchronize()  # long done (the last verdict was read since): no wait in practice
        staged = self._staging[: 2 * width].view(2, width)  # contiguous: pinned all the way
        staged.numpy()[0] = rows  # host memory written as numpy: no device op, no dispatch
        staged.numpy()[1] = range(step.start, step.end)
        graph.inputs.copy_(staged, non_blocking=self.capture)  # the one upload of the step
        if self.capture:
            self._uploaded = torch.cuda.current_stream(self.decoder.device).record_event()
        out = graph.run()
        # The graph's outputs are overwritten by its next replay: features outlive this round in
        # the drafter (logits and choices are read before the next step).
        return StepOutput(out.logits, out.choices, None if out.features is None else out.features.clone())

    def _graph(self, width: int, layers: tuple[int, ...], cache: SequenceCache) -> StepGraph:
        self._bound = cache
        key = (width, layers)
        if key not in self.widths:
            self.widths[key] = StepGraph(self.decoder, cache, width, layers, self.capture)
        return self.widths[key]
