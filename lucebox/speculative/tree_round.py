"""One speculation round over a draft tree (`speculative.tree`), for drafters that make trees.

The round of `rounds.Speculation.round` with a tree in place of the chain: the drafter proposes a
tree of up to `tree_budget` draft rows after `last`; one target step verifies every row, row i
written at scratch position c + i and attending as its true position c + depth_i to the committed
keys and its ancestors (`models.tree_mask`); the target's own picks walk down the tree
(`tree_verify`); the text stage takes the path's tokens and the next one; the cache moves the
taken path's rows to c + 1, c + 2, ... (`SequenceCache.accept_path`) and commits and rolls back as
after a chain. The drafter receives the committed tokens and the target features of those rows
alone. A tree that is a chain runs the plain step (same graphs as chain rounds).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from lucebox.caches import Step
from lucebox.generation import Chunk
from lucebox.sampling import RaceNoise
from lucebox.speculative.proposer import Draft
from lucebox.speculative.tree import DraftTree, chain
from lucebox.speculative.tree_verify import decide_tree
from lucebox.speculative.tree_width import top_path


def tree_round(spec, remaining: int, take: Callable[[list[int]], Chunk]) -> Chunk:
    """One round of `spec` (a `rounds.Speculation`); `remaining`: tokens the request may still produce."""
    ctx, cache, width = spec.context, spec.context.cache, spec.width
    c = cache.length
    budget = min(spec.draft_limit(remaining), ctx.tree_budget)
    timed = width.timed and width.adaptive
    t0 = ctx.clock(timed)
    context = spec.tokens + [spec.last]  # built once a round: it is the whole sequence
    drafting = budget > 0 and spec._drafting(budget, context)  # noqa: SLF001
    tree = _drafted_tree(spec, context, budget) if drafting else chain(spec.last, [])
    t1 = ctx.clock(timed)
    layers = spec.proposer.feature_layers
    out = ctx.runner.step(tree.tokens, Step.span(c, len(tree), ctx.device), cache, layers,
                          None if is_chain(tree) else tree)
    verdict = decide_tree(out.logits, tree, spec.params, spec.seen, spec.verify_gen,
                          None if spec.penalized else out.choices, position=c + 1, counts=spec.counts)
    chunk = take([*(tree.tokens[r] for r in verdict.path), verdict.next_token])
    rows = [0, *verdict.path][: len(chunk.token_ids)]  # fewer when a stop ends the request inside the round
    spec.attach_logprobs(chunk, out.logits, rows)  # row rows[i] chose the chunk's token i
    cache.accept_path(c, rows[1:])
    features = None if out.features is None else out.features[rows]
    # This is Speculation's own round, in a file of its own: it shares the class's commit and history.
    spec._commit([tree.tokens[r] for r in rows], len(tree), features)  # noqa: SLF001
    t2 = ctx.clock(timed)
    spec.judged(chunk.token_ids)
    spec.totals.add(Draft([0] * tree.depth), verdict.accepted, t1 - t0 if drafting else 0.0, t2 - t1,
                    width=len(tree) - 1)
    width.record(len(tree), t2 - t1, t1 - t0 if drafting and not tree.copied else None)  # a copy: not the drafter's
    if spec.shapes is not None and drafting and not tree.copied:  # a copy is a chain, whatever the shape
        spec.shapes.record("tree", len(chunk.token_ids), t2 - t0)
    spec.last = chunk.token_ids[-1]
    spec._mark_seen(chunk.token_ids)  # noqa: SLF001
    return chunk


def _drafted_tree(spec, context: list[int], budget: int) -> DraftTree:
    """The drafter's tree of up to `budget` rows; its first-choice path goes to the judge, so the
    keep rates the width policy drafts by keep learning in tree rounds. Without confidences: a
    tree's node probabilities are not what a chain reports (a DSpark chain reports its
    confidence head's), and the per-position confidence means must stay the chain's."""
    noise = spec.draft_gen if isinstance(spec.draft_gen, RaceNoise) else None  # other rules: top-k trees
    tree = spec.proposer.propose_tree(context, budget, spec.params, noise)
    copy: list[int] = []
    if tree.copied:  # a chain: cut to what the copies' keep rates pay for
        kept = spec.cut_copy(tree.tokens[1:], budget)
        if kept or not spec.width.should_draft(budget):
            return dataclasses.replace(chain(context[-1], kept), copied=True)
        # None of it pays: the drafter's own tree instead, as a chain round does (`Speculation._draft`)
        copy, tree = tree.tokens[1:], spec.proposer.own_tree(context, budget, spec.params, noise)
    spec.to_judge(top_path(tree)[0], [], copy)
    return tree


def is_chain(tree: DraftTree) -> bool:
    """Whether every row's parent is the row before it (plain causal attention serves it)."""
    return all(parent == i - 1 for i, parent in enumerate(tree.parents))
