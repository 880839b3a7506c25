"""Deciding which path of a draft tree to keep, from one target step over the tree's rows.

p_i: the target's processed distribution at row i (after `last` and row i's path). The target's own
choice walks down the tree: at row i it picks a token from p_i (its argmax when greedy); if a child
of i carries that token the walk moves there, else it stops and the pick is the next token. Every
committed token is thus the target's own pick given the tokens before it, whatever the tree holds,
so the output equals plain decoding (greedy) and follows the target's distribution exactly
(sampled; the drafts are a deterministic top-k tree, never themselves sampled).

Sampled, "coupled" rule: each row's pick is its race against the request's noise at its own
position (`sampling.RaceNoise`), and the walk follows the picks as greedy does. Other rules:
`tree_outcomes` writes the walk as its exact outcome distribution, stop[i, x] = the
probability that the walk reaches row i and picks x there, which no child of i carries (reach_i
is the product of p along the path), and one draw over all (i, x) decides the round: one read.
`tests/test_tree_verify.py` enumerates it against the target's own sequence probabilities.

Penalties: each row's history is the committed tokens plus its own path (`path_histories`,
`speculative.histories`), as a chain's row sees the drafts before it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lucebox.sampling import RaceNoise, SamplingParams, distribution, draw, greedy_choices, penalize
from lucebox.speculative.decide import check_finite
from lucebox.speculative.histories import mark_paths, row_histories
from lucebox.speculative.tree import DraftTree


@dataclass(frozen=True)
class TreeVerdict:
    path: list[int]  # the accepted rows, from the root's child down (empty: no draft kept)
    next_token: int  # the correction or the bonus

    @property
    def accepted(self) -> int:
        return len(self.path)


def walk(tree: DraftTree, picks: list[int]) -> TreeVerdict:
    """Follow the target's pick at each row (picks[i]) down the tree while a child carries it."""
    row, path = 0, []
    while (child := tree.child(row, picks[row])) is not None:
        path.append(child)
        row = child
    return TreeVerdict(path, picks[row])


def tree_paths(tree: DraftTree) -> list[list[int]]:
    """Each row's path: the draft tokens from the root's child down to the row itself."""
    return [[tree.tokens[j] for j in tree.path(i)] for i in range(len(tree))]


def path_histories(seen: torch.Tensor, tree: DraftTree) -> torch.Tensor:
    """(T, V) bool: row i's token history, `seen` (committed tokens, `last` included) plus the
    drafts on its path."""
    return mark_paths(seen, tree_paths(tree))


def tree_outcomes(p: torch.Tensor, tree: DraftTree) -> torch.Tensor:
    """stop (T, V) float64 from p (T, V) float64: the probability that the walk ends at row i with
    next token x. Sums to 1 over (i, x)."""
    T, device = len(tree), p.device
    parents = torch.tensor([max(q, 0) for q in tree.parents], device=device)
    tokens = torch.tensor(tree.tokens, device=device)
    edge = p[parents, tokens]  # (T,): p of row i's token at its parent
    edge[0] = 1.0
    bits = torch.tensor(tree.ancestor_bits, device=device)
    ancestor = ((bits[:, None] >> torch.arange(T, device=device)[None, :]) & 1) == 1  # (T, T)
    reach = torch.where(ancestor, edge[None, :], torch.ones_like(edge)[None, :]).prod(dim=1)
    carried = torch.zeros_like(p, dtype=torch.bool)
    carried[parents[1:], tokens[1:]] = True  # picks that move the walk on rather than end it
    return reach[:, None] * p.masked_fill(carried, 0.0)


def decide_tree(
    logits: torch.Tensor,  # (T, V): the target at each row of the tree
    tree: DraftTree,
    params: SamplingParams,
    seen: torch.Tensor,  # (V,) bool: tokens so far, `last` included
    generator: torch.Generator | RaceNoise | None,  # RaceNoise: the "coupled" rule
    choices: torch.Tensor | None = None,  # greedy_choices(logits), when the step computed them already
    position: int = 0,  # index in the sequence of the token the root row chooses
    counts: torch.Tensor | None = None,  # (V,) float32: generated tokens' counts (presence/frequency penalties)
) -> TreeVerdict:
    if params.reads_history:
        seen, counts = row_histories(seen, counts, tree_paths(tree), params)
    if params.greedy:
        if choices is None or params.penalized:
            choices = greedy_choices(penalize(logits.float(), params, seen, counts))
        verdict = walk(tree, choices.tolist())
    else:
        p = distribution(logits, params, seen, counts).double()
        if isinstance(generator, RaceNoise):  # a row at depth d chooses the token at position + d
            verdict = walk(tree, generator.choose(p, torch.tensor(tree.depths, device=p.device) + position).tolist())
        else:
            stop = tree_outcomes(p, tree)
            pick = torch.where(torch.isfinite(stop).all(), draw(stop.flatten(), generator), -1)
            flat = int(pick)  # the round's one read
            vocab = stop.shape[1]
            verdict = TreeVerdict(tree.path(flat // vocab), flat % vocab) if flat >= 0 else TreeVerdict([], -1)
    check_finite(verdict.next_token)
    return verdict
