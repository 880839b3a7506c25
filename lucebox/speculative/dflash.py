"""The DFlash proposer: one drafter pass proposes a whole block, read off the target's own
hidden states, with the drafter's context K/V in a ring of `draft_ctx` slots (appended only
with committed tokens), so a draft costs the same at 1K and 256K of context.

Context rows are written lazily: a commit only keeps the committed tokens' target features, and
the next draft (or a resume, or a full ring step's worth of waiting features) projects them into
the rings in one batch. So rounds the width policy decodes plainly cost the drafter nothing but
the features kept, and drafting after them pays one batched write instead of one per round.

Prompt lookup comes first (`copies_first`): when the context's tail occurred before, what followed
it is the draft (up to `DRAFT_WIDTH`), and the drafter does not run."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from lucebox.caches import SlidingRing, Step
from lucebox.limits import DRAFT_CTX, DRAFT_WIDTH
from lucebox.models.decoder import Decoder
from lucebox.models.dflash import DFlashConfig, DFlashDrafter
from lucebox.sampling import RaceNoise, SamplingParams, add_bias, draw
from lucebox.speculative.copies_first import CopiesFirst, new_lookup
from lucebox.speculative.dspark import markov_draft, markov_tree
from lucebox.speculative.ngram import NgramProposer
from lucebox.speculative.proposer import (
    Draft,
    Noise,
    TreeProposer,
    confidence,
    draft_distribution,
    greedy_draft,
    raced_scores,
    tensor_bytes,
)
from lucebox.speculative.tree import DraftTree, chain
from lucebox.speculative.tree_draft import draft_tree


def ring_step(cfg: DFlashConfig, prefill_chunk: int) -> int:
    """The most rows one commit writes to a context ring: a prefill chunk, or a verified block."""
    return max(prefill_chunk, cfg.block_size)


class DFlashProposer(CopiesFirst, TreeProposer):
    def __init__(self, drafter: DFlashDrafter, target: Decoder, prefill_chunk: int, draft_ctx: int = DRAFT_CTX):
        self.drafter, self.target = drafter, target
        self.name = "dflash" if drafter.heads is None else "dspark"
        self.feature_layers = drafter.cfg.target_layer_ids
        self.block_width = drafter.cfg.block_size - 1  # drafts one pass makes
        self.max_width = DRAFT_WIDTH  # a lookup draft may be longer
        self.lookup: NgramProposer | None = new_lookup()  # None: the drafter alone
        self.draft_ctx, self.max_step = draft_ctx, ring_step(drafter.cfg, prefill_chunk)
        self.prefill_chunk = prefill_chunk
        cfg = drafter.cfg
        # Made once, emptied by each request: a graphed block pass reads them by address.
        self.rings = [SlidingRing(draft_ctx, self.max_step, cfg.num_kv_heads, cfg.head_dim, drafter.dtype,
                                  drafter.device, reads_ahead=True) for _ in range(cfg.num_layers)]
        self.started = False
        self.length = 0  # committed tokens: their context rows are in the rings, or waiting
        self.waiting: list[torch.Tensor] = []  # features (T, n*H) of the last committed tokens, oldest first
        self.waiting_rows = 0
        self.tree_children = None  # `tree_draft.ChildrenHook`: how a node's children are chosen (None: by position)

    def device_bytes(self) -> int:
        return self.weight_bytes() + sum(ring.device_bytes() for ring in self.rings)

    def weight_bytes(self) -> int:
        return tensor_bytes(self.drafter.w.values())

    def fork(self) -> DFlashProposer:
        """Its own rings, lookup and waiting features; the same drafter weights, width and tree hook
        (no graph: the graph reads this one's rings by address)."""
        twin = DFlashProposer(self.drafter, self.target, self.prefill_chunk, self.draft_ctx)
        twin.max_width, twin.tree_children = self.max_width, self.tree_children
        if self.lookup is None:
            twin.lookup = None
        return twin

    def start(self, prompt: list[int], features: torch.Tensor | None) -> None:
        for ring in self.rings:
            ring.rollback(0)
        self.started = True
        self.length = 0
        self.waiting, self.waiting_rows = [], 0
        if self.lookup is not None:
            self.lookup.start(prompt, None)

    def resume(self, position: int) -> bool:
        # The rings hold context rows of the committed tokens; a chat's next turn keeps them all.
        self.catch_up()
        if not self.started or not 0 < position <= self.length:
            return False
        if self.lookup is not None and not self.lookup.resume(position):
            return False
        if not all(ring.can_rewind_to(position) for ring in self.rings):
            return False
        for ring in self.rings:
            ring.rollback(position)
        self.length = position
        return True

    def commit(self, committed: list[int], new: int, features: torch.Tensor | None) -> None:
        if self.lookup is not None:
            self.lookup.commit(committed, new, None)
        self.waiting.append(features[:new])
        self.waiting_rows += new
        self.length = len(committed)
        if self.waiting_rows >= self.max_step:  # a ring step's worth: write it now (bounded memory)
            self.catch_up()

    def catch_up(self) -> None:
        """Project the waiting features into the rings, at most one ring step per write."""
        if not self.waiting_rows:
            return
        features = self.waiting[0] if len(self.waiting) == 1 else torch.cat(self.waiting)
        start = self.length - self.waiting_rows
        for begin in range(0, self.waiting_rows, self.max_step):
            rows = features[begin : begin + self.max_step]
            self.drafter.context_rows(rows, Step.span(start + begin, len(rows), self.drafter.device), self.rings)
        self.waiting, self.waiting_rows = [], 0

    def own_draft(self, context: list[int], k: int, params: SamplingParams, generator: Noise) -> Draft:
        k = min(k, self.block_width)
        if k <= 0:
            return Draft([])
        device = self.drafter.device
        logits, hidden = self.block_pass(context, k)
        logits = add_bias(logits, params)  # the target's bias, so that the drafts follow it (kept more often)
        if self.drafter.heads is not None:  # DSpark: each position after the draft before it
            last = torch.tensor(context[-1], device=device)
            return markov_draft(self.drafter.heads, logits, hidden, last, params, generator, len(context))
        if params.greedy:
            return greedy_draft(logits)
        if isinstance(generator, RaceNoise):  # block position j drafts the token at len(context) - 1 + j
            return greedy_draft(raced_scores(logits, params, generator, len(context)))
        q = draft_distribution(logits, params)
        tokens = [int(draw(row, generator)) for row in q]
        return Draft(tokens, q, confidence(logits, q))

    def block_pass(self, context: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The drafter's logits (k, V) and final hidden states (k, H) for the k positions after
        `last` (context[-1]), in one pass (the graph's, when `graph_with` gave one)."""
        self.catch_up()
        start = len(context) - 1  # position of `last`
        if self.graph is not None:
            logits, hidden = self.graph.pass_at(context[-1], start)
            return logits[:k], hidden[:k]
        cfg, device = self.drafter.cfg, self.drafter.device
        block = torch.full((cfg.block_size,), cfg.mask_token_id, device=device)
        block[0] = context[-1]
        step = Step.span(start, cfg.block_size, device)
        return self.block_forward(block, step.positions, k, step)

    def block_forward(self, block: torch.Tensor, positions: torch.Tensor, k: int,
                      step: Step | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits and hidden states of the block's k rows after its first, from its token ids and
        positions (`DFlashDrafter.draft`; `step` None: a graph's body)."""
        embeddings = F.embedding(block, self.target.w["embed"]) * self.drafter.cfg.embedding_scale
        hidden = self.drafter.draft(embeddings, positions, self.rings, step)[1 : k + 1]
        return self.drafter.logits(self.target, hidden), hidden

    def graph_with(self, capture: bool, pool=None) -> None:
        """Run block passes as one graph from now on (captured on its first pass when `capture`)."""
        from lucebox.speculative.draft_graph import DraftGraph

        self.graph = DraftGraph(self, capture, pool)

    def capture_graph(self, token: int) -> None:
        """One block pass over the empty rings (every slot masked, nothing kept) captures the graph."""
        self.graph.pass_at(token, 0)

    def propose_tree(self, context: list[int], budget: int, params: SamplingParams | None = None,
                     noise: RaceNoise | None = None) -> DraftTree:
        """A draft tree of up to `budget` rows after `last` (`speculative.tree_draft`). The context
        rings only ever receive committed rows: the round gathers the target features of the
        accepted path's rows before `commit`, so a tree's other rows never reach them."""
        copied = self.copied(context, budget)
        if copied:
            return dataclasses.replace(chain(context[-1], copied), copied=True)
        return self.own_tree(context, budget, params, noise)

    def own_tree(self, context: list[int], budget: int, params: SamplingParams | None = None,
                 noise: RaceNoise | None = None) -> DraftTree:
        """`propose_tree` never copying (`Proposer.own_draft`)."""
        logits = self.block_pass(context, min(budget, self.block_width))[0]
        if params is not None:
            logits = add_bias(logits, params)  # as `own_draft`
        # Sampled coupled trees (`noise` given) rank each position's tokens by their race scores.
        coupled = None if noise is None or params.greedy else (params, noise, len(context))
        if self.tree_children is None and self.drafter.heads is not None:  # DSpark: children follow their parent
            return markov_tree(self.drafter.heads, logits, context[-1], budget, coupled)
        if coupled is not None:
            logits = raced_scores(logits, *coupled)
        return draft_tree(logits, context[-1], budget, self.tree_children)
