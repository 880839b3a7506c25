"""How a forward of the engine reaches its keys: the per-layer caches of one `SequenceCache`,
eagerly or inside a CUDA graph, or of several sequences' caches in one eager forward
(`ForwardContext`, `models/token_mixers.py`)."""

from __future__ import annotations

import itertools

import torch
from lucebox.kernels.attention import attention_over_blocks
from lucebox.kernels.backend import Kernels
from lucebox.models.tree_mask import TreeMask

from lucebox.caches import SequenceCache, Step
from lucebox.caches.base import RowTable
from lucebox.caches.recurrent import StateSlots, StepState
from lucebox.errors import InvalidArgumentError


def _tree_args(tree: TreeMask | None, window: int | None) -> dict:
    return {} if tree is None else {"tree_bits": tree.bits_for(window)}


class CacheContext:
    """An eager forward over a sequence cache: each layer writes its rows into its cache and
    attends over the key blocks the cache hands out (which may stream chunks from the host).

    With `tree`, the step verifies a draft tree: rows are written at `step`'s (scratch) positions,
    while RoPE and attention use their true positions, step.start + depth."""

    def __init__(self, step: Step, cache: SequenceCache, kernels: Kernels, scale: float,
                 tree: TreeMask | None = None):
        self.step, self.cache, self.kernels, self.scale, self.tree = step, cache, kernels, scale, tree
        self.positions = step.positions if tree is None else step.start + tree.depths
        self.state_slots: StateSlots | None = None  # computed by the first recurrent layer, shared by the others

    def row_table(self, layer: int) -> None:
        return None  # `write` reserves and stores: the host's bookkeeping comes first

    def attend(self, layer: int, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               window: int | None) -> torch.Tensor:
        layer_cache = self.cache.kv[layer]
        layer_cache.write(self.step, key, value)
        return attention_over_blocks(q, self.positions, layer_cache.blocks(q, self.step), self.scale, window,
                                     self.kernels.attention_partial, **_tree_args(self.tree, window))

    def recurrent_state(self, layer: int) -> StepState:
        if self.tree is not None:
            raise InvalidArgumentError("tree verification is not supported on recurrent (Gated DeltaNet) layers: each "
                                       "node would need its state built from its parent's; verify chains instead")
        state = self.cache.states[layer]
        state.reserve(self.step)  # refuses a step that does not continue the state
        stepped = state.step_state(self.step.positions, self.step.prefill, self.state_slots)
        self.state_slots = stepped.slots
        return stepped


class StaticCacheContext:
    """A graphed decode/verify step, after every layer cache's `reserve`: each layer stores its
    rows at slots the device computes from `positions` and attends over its cache's
    `static_block`, by device work that is the same at every position (`lucebox.engine.runner`).
    With `tree`, `positions` are the scratch positions rows are stored at, as in `CacheContext`."""

    def __init__(self, positions: torch.Tensor, cache: SequenceCache, kernels: Kernels, scale: float,
                 tree: TreeMask | None = None):
        self.slots, self.cache, self.kernels, self.scale, self.tree = positions, cache, kernels, scale, tree
        self.positions = positions if tree is None else positions[0] + tree.depths
        self.state_slots: StateSlots | None = None  # computed by the first recurrent layer, shared by the others

    def row_table(self, layer: int) -> RowTable | None:
        return self.cache.kv[layer].row_table()

    def attend(self, layer: int, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               window: int | None) -> torch.Tensor:
        self.cache.kv[layer].store(self.slots, key, value)
        return self.attend_stored(layer, q, window)

    def attend_stored(self, layer: int, q: torch.Tensor, window: int | None,
                      gate: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of q over layer `layer`'s static block, its rows already stored; with `gate`
        (softplus gate logits), gated inside attention's merge step rather than by a launch of its own."""
        block = self.cache.kv[layer].static_block(q)
        # Kernels without a gate or ring hint keep their signature.
        hints = ({} if gate is None else {"gate": gate}) | ({"ring": True} if block.ring else {})
        return self.kernels.attention_partial(q, block.k, block.v, self.positions, block.positions, self.scale,
                                              window, block.pinned, block.recent,
                                              k_scale=block.k_scale, v_scale=block.v_scale,
                                              **_tree_args(self.tree, window), **hints)[0]

    def recurrent_state(self, layer: int) -> StepState:
        """After the runner's `reserve`: ring slots computed on the device from the static positions."""
        if self.tree is not None:  # the engine never graphs one (trees are refused on hybrids)
            raise InvalidArgumentError("tree verification is not supported on recurrent (Gated DeltaNet) layers")
        stepped = self.cache.states[layer].step_state(self.slots, prefill=False, slots=self.state_slots)
        self.state_slots = stepped.slots
        return stepped


class SequencesContext:
    """One eager forward over the steps of several sequences, each with its own cache: the rows
    are the sequences' steps one after another, each `CacheContext` in `parts` holding its own.
    Everything that reads a row alone (projections, norms, routed experts, the head) runs once
    over all the rows, which reads each weight once for every sequence; what lets a row see other
    rows runs per sequence, on that sequence's rows only, exactly as its step alone: attention
    (`attend`, the projections around it batched) and a recurrent mixer's whole pass (`mix`)."""

    def __init__(self, parts: list[CacheContext | StaticCacheContext], counts: list[int]):
        """`parts[i]` reaches the cache of the i-th sequence, whose `counts[i]` rows come i-th."""
        self.parts = parts
        self.positions = torch.cat([part.positions for part in parts])
        ends = list(itertools.accumulate(counts))
        self.spans = [slice(end - count, end) for count, end in zip(counts, ends, strict=True)]

    def row_table(self, layer: int) -> None:
        return None

    def attend(self, layer: int, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               window: int | None) -> torch.Tensor:
        return torch.cat([part.attend(layer, q[rows], key[rows], value[rows], window)
                          for part, rows in zip(self.parts, self.spans, strict=True)])

    def mix(self, mixer, h: torch.Tensor) -> torch.Tensor:
        """`mixer.mix` over these rows: a mixer keeping a recurrent state runs per sequence (its
        state is the sequence's), attention once (`attend` splits it)."""
        if not getattr(mixer, "keeps_state", False):
            return mixer.mix(h, self)
        return torch.cat([mixer.mix(h[rows], part) for part, rows in zip(self.parts, self.spans, strict=True)])

    def recurrent_state(self, layer: int) -> StepState:
        raise AssertionError("a recurrent mixer runs per sequence (`mix`), never over several sequences' rows")
