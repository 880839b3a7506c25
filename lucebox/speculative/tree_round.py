"""One speculation round over a draft tree (`speculative.tree`), for drafters that make trees.

`chain_round.ChainRound` with a tree in place of the chain: the drafter proposes a tree of up to
`tree_budget` draft rows after `last`; one target step verifies every row, row i written at scratch
position c + i and attending as its true position c + depth_i to the committed keys and its
ancestors (`models.tree_mask`); the target's own picks walk down the tree (`tree_verify`); the
text stage takes the path's tokens and the next one. The verdict's `path` says which rows the
cache moves to c + 1, c + 2, ... (`SequenceCache.accept_path`) before committing, as after a chain;
the drafter receives the committed tokens and the target features of those rows alone. A tree
that is a chain runs the plain step (same graphs as chain rounds).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

from lucebox.caches import Step
from lucebox.generation import Chunk
from lucebox.sampling import RaceNoise
from lucebox.speculative.round_result import RoundResult
from lucebox.speculative.tree import DraftTree, chain
from lucebox.speculative.tree_verify import decide_tree
from lucebox.speculative.tree_width import top_path

if TYPE_CHECKING:
    from lucebox.speculative.rounds import Speculation


class TreeRound:
    def __init__(self, spec: Speculation):
        self.spec = spec
        self.made = 0  # positions a sequential drafter drafted this round (`_drafted_tree`)

    def run(self, remaining: int, take: Callable[[list[int]], Chunk]) -> RoundResult:
        """One round; `remaining`: tokens the request may still produce."""
        spec = self.spec
        ctx, state, cache = spec.context, spec.state, spec.context.cache
        c = cache.length
        budget = min(spec.draft_limit(remaining), ctx.tree_budget)
        began = ctx.clock(spec.timed)
        self.made = 0
        context = state.tokens + [state.last]  # built once a round: it is the whole sequence
        drafting = budget > 0 and spec.drafting(budget, context)
        tree = self._drafted_tree(context, budget) if drafting else chain(state.last, [])
        stepped = ctx.clock(spec.timed)
        out = ctx.runner.step(tree.tokens, Step.span(c, len(tree), ctx.device), cache, spec.proposer.feature_layers,
                              None if is_chain(tree) else tree)
        verdict = decide_tree(out.logits, tree, spec.params, state.seen, spec.verify_gen,
                              None if spec.penalized else out.choices, position=c + 1, counts=state.counts)
        chunk = take([*(tree.tokens[r] for r in verdict.path), verdict.next_token])
        rows = [0, *verdict.path][: len(chunk.token_ids)]  # fewer when a stop ends the request inside the round
        spec.attach_logprobs(chunk, out.logits, rows)  # row rows[i] chose the chunk's token i
        features = None if out.features is None else out.features[rows]
        return RoundResult(chunk=chunk, rows=[tree.tokens[r] for r in rows], written=len(tree), path=rows[1:],
                           features=features, accepted=verdict.accepted, depth=tree.depth, confidence=[],
                           shape="tree", drafted=drafting, own_drafts=drafting and not tree.copied,
                           began=began, stepped=stepped, forward_rows=out.forward_rows,
                           waited_s=out.waited_s, drafts_made=self.made)

    def _drafted_tree(self, context: list[int], budget: int) -> DraftTree:
        """The drafter's tree of up to `budget` rows; its first-choice path goes to the judge, so the
        keep rates the width policy drafts by keep learning in tree rounds. Without confidences: a
        tree's node probabilities are not what a chain reports (a DSpark chain reports its
        confidence head's), and the per-position confidence means must stay the chain's."""
        spec = self.spec
        noise = spec.draft_gen if isinstance(spec.draft_gen, RaceNoise) else None  # other rules: top-k trees
        # A sequential drafter (a pass per position) drafts as deep as the policy expects to pay
        deep = {"depth": spec.width.depth(budget)} if spec.proposer.sequential else {}
        self.made = deep.get("depth", 0)
        tree = spec.proposer.propose_tree(context, budget, spec.params, noise, **deep)
        copy: list[int] = []
        if tree.copied:  # a chain: cut to what the copies' keep rates pay for
            kept = spec.cut_copy(tree.tokens[1:], budget)
            if kept or not spec.width.should_draft(budget):
                return dataclasses.replace(chain(context[-1], kept), copied=True)
            # None of it pays: the drafter's own tree instead, as a chain round does (`ChainRound._draft`)
            copy, tree = tree.tokens[1:], spec.proposer.own_tree(context, budget, spec.params, noise, **deep)
        spec.to_judge(top_path(tree)[0], [], copy)
        return tree


def is_chain(tree: DraftTree) -> bool:
    """Whether every row's parent is the row before it (plain causal attention serves it)."""
    return all(parent == i - 1 for i, parent in enumerate(tree.parents))
