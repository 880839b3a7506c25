"""The model's own MTP head drafts (`models/mtp.py`): k drafts by applying the head k times, each
time on the token it just chose and the hidden state it just made.

The head's row t reads the token at t + 1 and the target's final hidden state at t. A commit hands
over the target's hidden states of the committed rows (the verify step's own, `feature_layers`:
the last layer's output, normed here by the target's final norm), so the head's committed rows
are made from the target's states, never its own: row t can be written once the token at t + 1
is known, which for the newest committed row is the next round's `last`. Rows wait until then
(or until a ring step's worth waits), and a round writes them in one forward before drafting.
Draft rows are rolled back as soon as the drafts are read: the next round remakes those
positions from the target's states. The head keeps a ring of `draft_ctx` slots (a draft model's
caches, `draft_model.draft_cache_settings`), so a draft costs the same at 1K and 256K of context.
Prompt lookup comes first, as for DFlash (`copies_first`): text that repeats is copied, not drafted."""

from __future__ import annotations

import dataclasses

import torch

from lucebox.caches import SequenceCache, Step
from lucebox.limits import DRAFT_CTX, DRAFT_WIDTH
from lucebox.models.decoder import Decoder
from lucebox.models.mtp import MTPHead
from lucebox.sampling import RaceNoise, SamplingParams, add_bias
from lucebox.speculative.copies_first import CopiesFirst, new_lookup
from lucebox.speculative.draft_model import draft_cache_settings
from lucebox.speculative.mtp_graph import MTPGraph
from lucebox.speculative.ngram import NgramProposer
from lucebox.speculative.proposer import (
    Draft,
    Noise,
    TreeProposer,
    chosen_draft,
    draft_distribution,
    raced_scores,
    read_drafts,
    tensor_bytes,
)
from lucebox.speculative.tree import DraftTree, chain
from lucebox.speculative.tree_draft import draft_tree


class MTPProposer(CopiesFirst, TreeProposer):
    name = "mtp"
    sequential = True  # one head pass per draft

    def __init__(self, head: MTPHead, target: Decoder, max_context: int, prefill_chunk: int,
                 draft_ctx: int = DRAFT_CTX, max_width: int = DRAFT_WIDTH):
        self.head, self.target = head, target
        self.feature_layers = (len(target.cfg.layers) - 1,)
        self.max_width, self.prefill_chunk = max_width, prefill_chunk
        self.settings = draft_cache_settings(max_context, prefill_chunk, draft_ctx, max_width)
        self.max_step = self.settings.max_step
        self._made_with = (head, target, max_context, prefill_chunk, draft_ctx)
        self.cache: SequenceCache | None = None
        self.rows = 0  # head rows written: positions 0 .. rows - 1
        self.waiting: list[torch.Tensor] = []  # the target's normed states at rows .. rows + waiting_rows - 1
        self.waiting_rows = 0
        self.newest: torch.Tensor | None = None  # the head's output at row rows - 1 (1, H)
        self.lookup: NgramProposer | None = new_lookup()  # None: the head alone
        self.graphing: tuple[bool, object] | None = None  # (capture, pool) once `graph_with` asked for a graph

    def fork(self) -> MTPProposer:
        twin = MTPProposer(*self._made_with, max_width=self.max_width)
        if self.lookup is None:
            twin.lookup = None
        return twin

    def device_bytes(self) -> int:
        caches = 0 if self.cache is None else self.cache.memory()["ring_caches"]
        return self.weight_bytes() + caches

    def weight_bytes(self) -> int:
        return tensor_bytes(self.head.weights)

    def start(self, prompt: list[int], features: torch.Tensor | None) -> None:
        self._empty_cache()
        self.rows, self.waiting, self.waiting_rows, self.newest = 0, [], 0, None
        if self.lookup is not None:
            self.lookup.start(prompt, None)

    def resume(self, position: int) -> bool:
        """Kept when the target's state at position - 1 still waits (its row needs the token after
        it, which the new request may change) and the rows before it are written. A request that goes
        back into rows already written (a chat template that drops the last thought, a regenerated
        answer) finds their states gone: the head starts over at `position` with an empty cache, so
        it forgets the context before (costing acceptance, never exactness) rather than have the
        target prefill the whole prompt again for it."""
        if self.cache is None or not 0 < position <= self.rows + self.waiting_rows:
            return False
        if self.lookup is not None and not self.lookup.resume(position):
            return False
        if position > self.rows and self.cache.can_rewind_to(self.rows):
            states = torch.cat(self.waiting) if len(self.waiting) > 1 else self.waiting[0]
            self.waiting, self.waiting_rows = [states[: position - self.rows]], position - self.rows
            self.cache.rollback(self.rows)
            return True
        self._empty_cache()
        self.rows, self.waiting, self.waiting_rows, self.newest = position, [], 0, None
        return True

    def _empty_cache(self) -> None:
        """The head's cache with no row in it: the same one, emptied in place (a graph reads it by
        address), unless a step cut short left it dirty (then a fresh one, and a graph over it)."""
        if self.cache is not None and not self.cache.dirty:
            self.cache.rollback(0)
            for ring in self.cache.kv.values():
                ring.empty()  # rows at positions before a later start would be read: the ring forgets them all
            return
        self.cache = self.graph = None  # (the old rings go before the new ones come)
        self.cache = SequenceCache(self.head.cfg, self.settings, self.target.dtype, self.target.device)
        if self.graphing is not None:
            self.graph = MTPGraph(self.head, self.cache, *self.graphing)

    def graph_with(self, capture: bool, pool=None) -> None:
        """Run the head's draft passes as one graph from now on (captured on the first when `capture`)."""
        self.graphing = (capture, pool)
        if self.cache is None:
            self._empty_cache()  # made with its graph
        else:
            self.graph = MTPGraph(self.head, self.cache, capture, pool)

    def capture_graph(self, token: int) -> None:
        """One pass at position 0 over the empty cache, which captures the graph; emptied again after."""
        device = self.target.device
        self.graph.pass_at(torch.tensor(token, device=device), torch.zeros_like(self.graph.hidden), 0)
        self.cache.commit(1)  # the step completed: clean, so the emptying keeps this cache
        self._empty_cache()

    def commit(self, committed: list[int], new: int, features: torch.Tensor | None) -> None:
        if self.lookup is not None:
            self.lookup.commit(committed, new, None)
        target = self.target
        states = target.kernels.rms_norm(features[:new], target.w["norm"], target.cfg.rms_norm_eps)
        self.waiting.append(states)
        self.waiting_rows += new
        if self.waiting_rows > self.max_step:  # bounded memory: write all but the newest (its next token is unknown)
            self._write(committed, len(committed) - 1)

    def _write(self, tokens: list[int], end: int) -> torch.Tensor | None:
        """Write the waiting rows before position `end` (tokens: at least end + 1 of them); the
        head's output at row end - 1, which drafts the token at end + 1."""
        if end <= self.rows:  # written already: a round asking twice (a copy declined, then the drafter's own)
            return self.newest
        states = torch.cat(self.waiting) if len(self.waiting) > 1 else self.waiting[0]
        ids = torch.tensor(tokens[self.rows + 1 : end + 1], device=self.target.device)
        out = None
        for begin in range(0, end - self.rows, self.max_step):
            n = min(self.max_step, end - self.rows - begin)
            step = Step.span(self.rows + begin, n, ids.device, prefill=n > 1)
            out = self.head.forward(ids[begin : begin + n], states[begin : begin + n], step, self.cache)
            self.cache.commit(self.rows + begin + n)
        rest = states[end - self.rows :]
        self.waiting, self.waiting_rows = ([rest] if len(rest) else []), len(rest)
        self.rows, self.newest = end, out[-1:]
        return self.newest

    def own_draft(self, context: list[int], k: int, params: SamplingParams, generator: Noise) -> Draft:
        """Drafts for the positions after `last` (context[-1]): the first from the head's row at
        last's position - 1 (the target's state there, and `last`), each next one from the row
        after it (the draft before and the head's own state), read from the device once at the end."""
        drafted = self._chain(context, k, params, generator)
        return Draft([]) if drafted is None else read_drafts(*drafted, params, generator)

    def propose_tree(self, context: list[int], budget: int, params: SamplingParams | None = None,
                     noise: RaceNoise | None = None, depth: int | None = None) -> DraftTree:
        """A copy of earlier text as a chain, else the head's own tree (`own_tree`)."""
        copied = self.copied(context, budget)
        if copied:
            return dataclasses.replace(chain(context[-1], copied), copied=True)
        return self.own_tree(context, budget, params, noise, depth)

    def own_tree(self, context: list[int], budget: int, params: SamplingParams | None = None,
                 noise: RaceNoise | None = None, depth: int | None = None) -> DraftTree:
        """A tree of up to `budget` rows from `depth` (default: as many) positions of the head's
        chain along its first choices (the race's winners, for coupled sampled trees): each
        position's top tokens are a node's children (`tree_draft.draft_tree`), every one of them
        judged by the head as if the first choices led there (exact whatever they are: the target
        verifies every row)."""
        params = params or SamplingParams()
        coupled = None if noise is None or params.greedy else (params, noise, len(context))
        drafted = self._chain(context, min(budget, depth or budget), params, noise if coupled else None)
        if drafted is None:
            return chain(context[-1], [])
        logits = torch.stack(drafted[2])
        return draft_tree(raced_scores(logits, *coupled) if coupled else logits, context[-1], budget)

    def _chain(self, context: list[int], k: int, params: SamplingParams, generator: Noise):
        """(draft tokens, the distributions they were chosen from, the logits) of k applications of
        the head after `last`, all on the device; None when there is nothing to draft from."""
        k = min(k, self.max_width)
        end = len(context) - 1  # rows 0 .. end - 1 have their next token: the last of them drafts
        if k <= 0 or end < 1:
            return None
        hidden = self._write(context, end)
        if hidden is None:  # started over at `end` (`resume`): no row drafts yet
            return None
        tokens, rows, all_logits = [], [], []
        logits = self.head.logits(hidden)[0]
        for i in range(k):
            logits = add_bias(logits, params)  # the target's bias: drafts follow it
            q = draft_distribution(logits[None], params)[0]
            tokens.append(chosen_draft(q, params, generator, len(context) + i))  # draft i: the token at len + i
            rows.append(q)
            all_logits.append(logits)
            if i + 1 < k:
                hidden, logits = self._apply(tokens[-1], hidden, end + i)
                self.cache.commit(end + i + 1)
        self.cache.rollback(end)  # the drafts' rows: remade from the target's states once they are verified
        return tokens, rows, all_logits

    def _apply(self, token: torch.Tensor, hidden: torch.Tensor, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The head's output (1, H) and logits (V,) at row `position` (the graph's, when there is one;
        its logits copied out, since the next pass overwrites them and a round keeps every draft's)."""
        if self.graph is not None:
            out, logits = self.graph.pass_at(token, hidden, position)
            return out, logits.clone()
        out = self.head.forward(token.reshape(1), hidden, Step.span(position, 1, hidden.device), self.cache)
        return out, self.head.logits(out)[0]
