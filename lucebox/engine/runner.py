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

A tree-verify step (`tree`: each row's depth and ancestor bits, `speculative.tree`) is the same
step with two more static input rows, depths and bits, and a graph of its own per width: rows are
stored at scratch positions start + i, attend at their true positions start + depth
(`models.tree_mask`).

Without CUDA (`capture=False`) the graphed path runs its step body eagerly, which is how the
CPU tests check it: same body, same static inputs, same cache tables.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lucebox.caches import SequenceCache, Step
from lucebox.graph_capture import Graphed
from lucebox.limits import DECODE_ROWS
from lucebox.models.cache_contexts import CacheContext, StaticCacheContext
from lucebox.models.tree_mask import TreeMask


@dataclass
class StepOutput:
    logits: torch.Tensor  # (T, vocab)
    choices: torch.Tensor  # (T,) each row's argmax, or -1 everywhere if a logit is not finite
    features: torch.Tensor | None  # (T, len(layers) * H): the outputs of the layers asked for
    forward_rows: int | None = None  # rows of the forward it ran in, when other requests' rows shared it
    waited_s: float = 0.0  # seconds it waited for its forward to start (other requests drafting, their forwards)


def eager_context(decoder, step: Step, cache: SequenceCache, tree=None) -> CacheContext:
    """How an eager step's rows reach `cache` (with `tree`: a draft tree's mask)."""
    return CacheContext(step, cache, decoder.kernels, decoder.scale, _tree_mask(decoder, tree))


def step_context(decoder, step: Step, cache: SequenceCache, tree=None) -> CacheContext | StaticCacheContext:
    """How a decode/verify step's rows reach `cache` outside a graph: as the graph's body does it
    (every layer cache reserved first, then attention over static blocks) wherever a graph could
    serve the step; else `eager_context`. Within a forward of several sequences the store and the
    attention gate run as ops of their own (`SequencesContext` has no row table), not fused as in
    the graph: the same attention, not always the same bits."""
    if step.prefill or not all(layer.graphable(step) for layer in cache.layers):
        return eager_context(decoder, step, cache, tree)
    for layer in cache.layers:
        layer.reserve(step)
    return StaticCacheContext(step.positions, cache, decoder.kernels, decoder.scale, _tree_mask(decoder, tree))


def _tree_mask(decoder, tree) -> TreeMask | None:
    if tree is None:
        return None
    bits, depths = torch.tensor([tree.ancestor_bits, tree.depths], dtype=torch.long, device=decoder.device)
    return TreeMask(bits, depths)


class StepGraph(Graphed[StepOutput]):
    """A decode/verify step of exactly `width` rows over one cache, capturing decoder `layers`."""

    def __init__(self, decoder, cache: SequenceCache, width: int, layers: tuple[int, ...], capture: bool,
                 tree: bool = False, pool=None):
        super().__init__(decoder.device, capture, pool)
        self.decoder, self.cache, self.layers = decoder, cache, layers
        # token ids, positions (+ a tree's depths and ancestor bits)
        self.inputs = torch.zeros((4 if tree else 2, width), dtype=torch.long, device=decoder.device)
        self.tree = tree

    def body(self) -> StepOutput:
        """The step's device work, reading only `inputs` and the cache's tables."""
        d, ids, positions = self.decoder, self.inputs[0], self.inputs[1]
        tree = TreeMask(self.inputs[3], self.inputs[2]) if self.tree else None
        context = StaticCacheContext(positions, self.cache, d.kernels, d.scale, tree)
        hidden, features = d.run(ids, context, self.layers)
        logits = d.logits(hidden)
        return StepOutput(logits, d.kernels.greedy_choices(logits), features)


class StepRunner:
    """Owns the per-step device state: the static inputs and graphs of each width, bound to the
    cache they were captured over."""

    def __init__(self, decoder, graphs: bool, capture: bool | None = None):
        self.decoder = decoder
        self.graphs = graphs  # whether decode/verify steps take the graphed path at all
        self.capture = decoder.device.type == "cuda" if capture is None else capture
        self.widths: dict[tuple[int, tuple[int, ...]], StepGraph] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None  # shared by every graph
        self._bound: SequenceCache | None = None
        self._staging = torch.zeros(4 * DECODE_ROWS, dtype=torch.long, pin_memory=self.capture)
        self._uploaded: torch.cuda.Event | None = None  # when the last upload from `_staging` was done

    def graphed(self, width: int, step: Step, cache: SequenceCache) -> bool:
        """Whether this step runs as a graph (else eagerly): graphs serve the bound cache (the
        session's; else the first one used) until `release`; a second, private cache runs
        eagerly rather than recapturing at every switch."""
        return (self.graphs and not step.prefill and 1 <= width <= DECODE_ROWS
                and (self._bound is None or cache is self._bound)
                and all(layer.graphable(step) for layer in cache.layers))

    @property
    def bound(self) -> SequenceCache | None:
        """The cache the graphs read (None: none yet; the first one stepped binds them)."""
        return self._bound

    def bind(self, cache: SequenceCache) -> None:
        """The cache graphs serve from now on (the engine's session cache)."""
        if cache is not self._bound:
            self.release()
            self._bound = cache

    def release(self) -> None:
        """Let the graphs and the cache they read go (the engine drops that cache)."""
        self.widths.clear()
        self._bound = None
        if self.capture:  # the dropped graphs' pool goes with them; later ones share a new one
            self.pool = torch.cuda.graph_pool_handle()

    def step(self, rows: list[int], step: Step, cache: SequenceCache,
             layers: tuple[int, ...] = (), tree=None) -> StepOutput:
        """`tree`: the rows are a draft tree (`speculative.tree.DraftTree`: `depths`, `ancestor_bits`)."""
        width = len(rows)
        if not self.graphed(width, step, cache):
            return self._eager(rows, step, cache, layers, tree)
        for layer in cache.layers:
            layer.reserve(step)
        graph = self._graph(width, layers, cache, tree is not None)
        if self._uploaded is not None:
            self._uploaded.synchronize()  # long done (the last verdict was read since): no wait in practice
        inputs = graph.inputs.shape[0]
        staged = self._staging[: inputs * width].view(inputs, width)  # contiguous: pinned all the way
        staged.numpy()[0] = rows  # host memory written as numpy: no device op, no dispatch
        staged.numpy()[1] = range(step.start, step.end)
        if tree is not None:
            staged.numpy()[2] = tree.depths
            staged.numpy()[3] = tree.ancestor_bits
        graph.inputs.copy_(staged, non_blocking=self.capture)  # the one upload of the step
        if self.capture:
            self._uploaded = torch.cuda.current_stream(self.decoder.device).record_event()
        out = graph.run()
        # The graph's outputs are overwritten by its next replay: features outlive this round in
        # the drafter (logits and choices are read before the next step).
        return StepOutput(out.logits, out.choices, None if out.features is None else out.features.clone())

    def _eager(self, rows: list[int], step: Step, cache: SequenceCache, layers: tuple[int, ...],
               tree) -> StepOutput:
        d = self.decoder
        ids = torch.tensor(rows, dtype=torch.long, device=d.device)
        hidden, features = d.run(ids, eager_context(d, step, cache, tree), layers)
        logits = d.logits(hidden)
        return StepOutput(logits, d.kernels.greedy_choices(logits), features)

    def _graph(self, width: int, layers: tuple[int, ...], cache: SequenceCache, tree: bool) -> StepGraph:
        self._bound = cache
        key = (width, layers, tree)
        if key not in self.widths:
            self.widths[key] = StepGraph(self.decoder, cache, width, layers, self.capture, tree, self.pool)
        return self.widths[key]
