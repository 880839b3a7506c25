"""The DFlash proposer: one drafter pass proposes a whole block, read off the target's own
hidden states, with the drafter's context K/V in a ring of `draft_ctx` slots (appended only
with committed tokens), so a draft costs the same at 1K and 256K of context."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lucebox.caches import SlidingRing, Step
from lucebox.engine.config import DRAFT_CTX
from lucebox.models.decoder import Decoder
from lucebox.models.dflash import DFlashConfig, DFlashDrafter
from lucebox.sampling import SamplingParams, draw
from lucebox.speculative.dspark import markov_draft
from lucebox.speculative.proposer import Draft, Proposer, confidence, draft_distribution, greedy_draft, tensor_bytes


def ring_step(cfg: DFlashConfig, prefill_chunk: int) -> int:
    """The most rows one commit writes to a context ring: a prefill chunk, or a verified block."""
    return max(prefill_chunk, cfg.block_size)


class DFlashProposer(Proposer):
    def __init__(self, drafter: DFlashDrafter, target: Decoder, prefill_chunk: int, draft_ctx: int = DRAFT_CTX):
        self.drafter, self.target = drafter, target
        self.feature_layers = drafter.cfg.target_layer_ids
        self.max_width = drafter.cfg.block_size - 1
        self.draft_ctx, self.max_step = draft_ctx, ring_step(drafter.cfg, prefill_chunk)
        self.rings: list[SlidingRing] = []
        self.length = 0  # committed tokens whose context rows the rings hold

    def device_bytes(self) -> int:
        return tensor_bytes(self.drafter.w.values()) + sum(ring.device_bytes() for ring in self.rings)

    def start(self, prompt: list[int], features: torch.Tensor | None) -> None:
        cfg = self.drafter.cfg
        self.rings = [SlidingRing(self.draft_ctx, self.max_step, cfg.num_kv_heads, cfg.head_dim,
                                  self.drafter.dtype, self.drafter.device) for _ in range(cfg.num_layers)]
        self.length = 0

    def resume(self, position: int) -> bool:
        # The rings hold context rows of the committed tokens; a chat's next turn keeps them all.
        if not self.rings or not 0 < position <= self.length:
            return False
        if not all(ring.can_rewind_to(position) for ring in self.rings):
            return False
        for ring in self.rings:
            ring.rollback(position)
        self.length = position
        return True

    def commit(self, committed: list[int], new: int, features: torch.Tensor | None) -> None:
        start = len(committed) - new
        self.drafter.context_rows(features, Step.span(start, new, self.drafter.device), self.rings)
        self.length = len(committed)

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None) -> Draft:
        cfg = self.drafter.cfg
        k = min(k, self.max_width)
        if k <= 0:
            return Draft([])
        start = len(context) - 1  # position of `last`
        device = self.drafter.device
        block = torch.full((cfg.block_size,), cfg.mask_token_id, device=device)
        block[0] = context[-1]
        embeddings = F.embedding(block, self.target.w["embed"]) * cfg.embedding_scale
        hidden = self.drafter.draft(embeddings, Step.span(start, cfg.block_size, device), self.rings)[1 : k + 1]
        logits = self.drafter.logits(self.target, hidden)
        if self.drafter.heads is not None:  # DSpark: each position after the draft before it
            return markov_draft(self.drafter.heads, logits, hidden, block[0], params, generator)
        if params.greedy:
            return greedy_draft(logits)
        q = draft_distribution(logits, params)
        tokens = [int(draw(row, generator)) for row in q]
        return Draft(tokens, q, confidence(logits, q))
