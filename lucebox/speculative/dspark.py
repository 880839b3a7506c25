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
    rows, qs, tokens, confidences = [], [], [], []
    for j in range(logits.shape[0]):
        row = heads.position_logits(logits[j], prev)  # (V,)
        if params.greedy:
            token = row.argmax()
        else:
            qs.append(draft_distribution(row[None], params)[0])
            token = draw(qs[-1], generator)
        confidences.append(heads.confidence(hidden[j], prev))
        rows.append(row)
        tokens.append(token)
        prev = token
    biased = torch.stack(rows)
    belief = None if heads.cfg.confidence is False else torch.stack(confidences)
    if params.greedy:
        return greedy_draft(biased, belief)  # its argmax of each biased row is the chain's token
    q = torch.stack(qs)
    belief = top_probabilities(biased, q) if belief is None else belief
    both = torch.cat([torch.stack(tokens).double(), belief.double()]).tolist()  # ids < 2^53: exact
    k = len(tokens)
    return Draft([int(t) for t in both[:k]], q, both[k:])


def markov_children(heads: DSparkHeads, budget: int):
    """A tree hook (`tree_draft.ChildrenHook`) for DSpark drafters: a node's children are the top
    `budget` of its position's logits biased by the node's own token, as the chain biases each
    position by the draft before it (one small device step and read per expanded node)."""

    def hook(logits: torch.Tensor, ids, probs):
        def children(depth: int, token: int):
            if depth >= logits.shape[0]:
                return [], []
            prev = torch.tensor(token, device=logits.device)
            top = torch.softmax(heads.position_logits(logits[depth], prev), dim=-1).topk(min(budget, logits.shape[-1]))
            both = torch.cat([top.indices.double(), top.values.double()]).tolist()  # ids < 2^53: exact
            n = len(both) // 2
            return [int(t) for t in both[:n]], both[n:]

        return children

    return hook
