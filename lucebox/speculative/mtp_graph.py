"""The MTP head's pass as one CUDA graph (`graph_capture.Graphed`), replayed once per draft.

A draft reads the token the draft before it chose (a device value, copied into the graph's static
input: the host never reads it), its position and the head's output before it, and writes one row
into the head's ring at slot position % capacity, attending over the whole ring (empty and later
slots are masked by their positions): the same device work at every position, so one graph serves
every draft of every round. The head's cache lives as long as the proposer (a request empties it;
only a step cut short replaces it, and the graph with it), so the graph reads it by address.
Writing committed rows (`MTPProposer._write`) stays eager: its row count varies.
"""

from __future__ import annotations

import torch

from lucebox.caches import SequenceCache, Step
from lucebox.graph_capture import Graphed
from lucebox.models.cache_contexts import StaticCacheContext
from lucebox.models.mtp import MTPHead


class MTPGraph(Graphed[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, head: MTPHead, cache: SequenceCache, capture: bool, pool=None):
        target = head.target
        super().__init__(target.device, capture, pool)
        self.head, self.cache = head, cache
        self.inputs = torch.zeros(2, dtype=torch.long, device=self.device)  # token id, position
        self.hidden = torch.zeros((1, head.cfg.hidden_size), dtype=target.dtype, device=self.device)

    def body(self) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.head.layer
        context = StaticCacheContext(self.inputs[1:], self.cache, layer.kernels, layer.scale)
        hidden = self.head.run(self.inputs[:1], self.hidden, context)
        return hidden, self.head.logits(hidden)[0]

    def pass_at(self, token: torch.Tensor, hidden: torch.Tensor, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's output (1, H) and logits (V,) at row `position`, from `token` (a () device
        tensor: the token at position + 1) and `hidden` (1, H: the state at `position`): the
        graph's outputs, overwritten by the next pass. The row stays in the cache until a rollback."""
        step = Step.span(position, 1, self.device)
        for layer in self.cache.layers:
            layer.reserve(step)
        self.inputs[0].copy_(token)  # device to device: no wait
        self.inputs[1].fill_(position)
        self.hidden.copy_(hidden)
        return self.run()
