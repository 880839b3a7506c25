"""Drafting a block with DSpark heads (`lucebox.models.dspark`): after the one backbone pass, a
short chain on the device where block position j's logits take the Markov bias of the draft chosen
at j - 1 (position 1: the anchor `last`). Nothing is read on the host inside the chain: the drafts
and their confidences come back in one read at the end, as `greedy_draft` does for plain DFlash."""

from __future__ import annotations

import torch

from lucebox.models.dspark import DSparkHeads
from lucebox.sampling import SamplingParams, draw
from lucebox.speculative.proposer import Draft, draft_distribution, greedy_draft, top_probabilities


def markov_draft(heads: DSparkHeads, logits: torch.Tensor, hidden: torch.Tensor, last: torch.Tensor,
                 params: SamplingParams, generator: torch.Generator | None) -> Draft:
    """Drafts for block positions 1..k from the backbone's logits (k, V) and final hidden states
    (k, H), the chain starting from `last` (a 0-d device tensor). Greedy drafts are each biased
    row's argmax; sampled drafts are drawn from the biased row's distribution, which is the `q`
    returned (what verification must compare against, so it stays lossless). The confidence is
    the confidence head's, or without one the top-1 mass of what each draft came from."""
    prev = last
    rows, qs, tokens = [], [], []
    for j in range(logits.shape[0]):
        row = heads.position_logits(logits[j], prev)  # (V,)
        if params.greedy:
            token = row.argmax()
        else:
            qs.append(draft_distribution(row[None], params)[0])
            token = draw(qs[-1], generator)
        rows.append(row)
        tokens.append(token)
        prev = token
    biased = torch.stack(rows)
    # The confidence head reads each position's previous token, all known now: one batched call.
    prevs = torch.stack([last.reshape(()), *tokens[:-1]]) if tokens else last.reshape(1)[:0]
    belief = None if heads.cfg.confidence is False else heads.confidence(hidden, prevs)
    if params.greedy:
        return greedy_draft(biased, belief)  # its argmax of each biased row is the chain's token
    q = torch.stack(qs)
    belief = top_probabilities(biased, q) if belief is None else belief
    both = torch.cat([torch.stack(tokens).double(), belief.double()]).tolist()  # ids < 2^53: exact
    k = len(tokens)
    return Draft([int(t) for t in both[:k]], q, both[k:])


def markov_children(heads: DSparkHeads, budget: int, last: int):
    """A tree hook (`tree_draft.ChildrenHook`) for DSpark drafters: a node's children are the top
    `budget` of its position's logits biased by the node's own token, as the chain biases each
    position by the draft before it. The children of every likely parent are computed at once, in
    one batch and one read: at depth 0 the root `last`, at depth d the top tokens of the position
    before (the unbiased top-k the tree builder read); a node outside them is computed on its own."""

    def hook(logits: torch.Tensor, ids, probs):
        k = min(budget, logits.shape[-1])
        parents = [[last]] + [list(row) for row in ids[: logits.shape[0] - 1]]
        known = _children_of(heads, logits, parents, k)

        def children(depth: int, token: int):
            if depth >= logits.shape[0]:
                return [], []
            if (depth, token) not in known:
                known.update(_children_of(heads, logits[depth : depth + 1], [[token]], k, first_depth=depth))
            return known[(depth, token)]

        return children

    return hook


def _children_of(heads: DSparkHeads, logits: torch.Tensor, parents: list[list[int]], k: int,
                 first_depth: int = 0) -> dict:
    """{(depth, parent token): (child ids, probabilities)} for each row of `logits` (row i at depth
    first_depth + i) and its `parents`, computed in one batch and read in one transfer."""
    width = max(len(p) for p in parents)
    tokens = torch.tensor([p + p[-1:] * (width - len(p)) for p in parents], device=logits.device)  # (P, C)
    biased = heads.position_logits(logits[:, None, :], tokens)  # (P, C, V)
    top = torch.softmax(biased, dim=-1).topk(k, dim=-1)
    both = torch.cat([top.indices.double(), top.values.double()], dim=-1).tolist()  # ids < 2^53: exact
    out = {}
    for i, row in enumerate(parents):
        for j, token in enumerate(row):
            values = both[i][j]
            out[(first_depth + i, token)] = ([int(t) for t in values[:k]], values[k:])
    return out
