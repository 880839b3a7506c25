"""Drafting a block with DSpark heads (`lucebox.models.dspark`): after the one backbone pass, a
short chain on the device where block position j's logits take the Markov bias of the draft chosen
at j - 1 (position 1: the anchor `last`). Nothing is read on the host inside the chain: the drafts
and their confidences come back in one read at the end, as `greedy_draft` does for plain DFlash."""

from __future__ import annotations

import math

import torch

from lucebox.models.dspark import DSparkHeads
from lucebox.sampling import RaceNoise, SamplingParams, draw, race_scores
from lucebox.speculative.proposer import Draft, Noise, draft_distribution, greedy_draft, top_probabilities
from lucebox.speculative.tree import DraftTree, build_tree


def markov_draft(heads: DSparkHeads, logits: torch.Tensor, hidden: torch.Tensor, last: torch.Tensor,
                 params: SamplingParams, generator: Noise, first: int) -> Draft:
    """Drafts for block positions 1..k from the backbone's logits (k, V) and final hidden states
    (k, H), the chain starting from `last` (a 0-d device tensor). Greedy drafts are each biased
    row's argmax; sampled drafts are drawn from the biased row's distribution, which is the `q`
    returned (what verification must compare against, so it stays lossless). The confidence is
    the confidence head's, or without one the top-1 mass of what each draft came from. Coupled
    drafts (`generator` a `RaceNoise`; block position j drafts the token at `first` + j - 1) are
    each biased row's race winner, deterministic like greedy ones."""
    prev = last
    rows, qs, tokens = [], [], []
    raced = isinstance(generator, RaceNoise)
    if raced:  # the noise of every position at once: it does not depend on the drafts
        positions = torch.arange(first, first + logits.shape[0], device=logits.device)
        log_noise = generator.exponentials(positions, logits.shape[-1]).log()
    for j in range(logits.shape[0]):
        row = heads.position_logits(logits[j], prev)  # (V,)
        if raced:
            row = race_scores(draft_distribution(row[None], params), log_noise[j])[0]
        if params.greedy or raced:
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
    if params.greedy or raced:
        return greedy_draft(biased, belief)  # its argmax of each biased row is the chain's token
    q = torch.stack(qs)
    belief = top_probabilities(biased, q) if belief is None else belief
    both = torch.cat([torch.stack(tokens).double(), belief.double()]).tolist()  # ids < 2^53: exact
    k = len(tokens)
    return Draft([int(t) for t in both[:k]], q, both[k:])


def markov_tree(heads: DSparkHeads, logits: torch.Tensor, last: int, budget: int,
                coupled: tuple[SamplingParams, RaceNoise, int] | None = None) -> DraftTree:
    """The draft tree of a DSpark drafter: the `budget` most probable paths below `last`, where a
    node's children follow its position's logits (P, V) biased by the node's own token (as the
    chain biases each position by the draft before it).

    Built depth by depth on the device: at each depth the `budget` best extensions of the nodes
    kept at the depth before (by path log-probability), so no node of the best tree is ever left
    out (a tree of `budget` rows holds at most `budget` nodes per depth, each a child of a kept
    node); then one read, and the `budget` best nodes of all depths (a child is never more
    probable than its parent, so each node's parent is among them). `coupled` (sampling
    settings, the request's noise, the position of depth 1): rank by race scores instead."""
    P, V = logits.shape
    k = min(budget, V)
    tokens = torch.tensor([last], device=logits.device)
    logp = torch.zeros(1, dtype=torch.float32, device=logits.device)
    levels = []
    for depth in range(P if k > 0 else 0):
        # Clamped at 0 so rounding never makes a child more probable than its parent.
        biased = heads.position_logits(logits[depth][None], tokens)  # (nodes, V)
        if coupled is not None:
            params, noise, first = coupled
            biased = noise.scores(draft_distribution(biased, params), tokens.new_full((1,), first + depth))
        best = biased.topk(min(k, V), dim=-1)  # each node's best children first: a small top-k after
        scores = (best.values - biased.logsumexp(-1, keepdim=True)).clamp_max(0) + logp[:, None]
        top = scores.flatten().topk(min(k, scores.numel()))
        parents, logp = top.indices // best.indices.shape[1], top.values
        tokens = best.indices.flatten()[top.indices]
        levels.append(torch.stack([parents.double(), tokens.double(), logp.double()]))
    if not levels:
        return build_tree(last, 0, lambda depth, token: ([], []))
    values = torch.cat(levels, dim=1).tolist()  # one read: ids < 2^53 are exact in float64
    nodes = [(values[2][i], i // k + 1, i % k, int(values[0][i]), int(values[1][i])) for i in range(len(values[0]))]
    chosen = sorted(nodes, key=lambda n: (-n[0], n[1]))[:budget]  # (log p, depth, slot, parent slot, token)
    chosen.sort(key=lambda n: (n[1], -n[0]))  # breadth first, best first within a depth
    row_of = {(0, 0): 0}
    tree = DraftTree([last], [-1], [0], [1.0])
    for logp_, depth, slot, parent, token in chosen:
        row_of[(depth, slot)] = len(tree.tokens)
        tree.tokens.append(token)
        tree.parents.append(row_of[(depth - 1, parent if depth > 1 else 0)])
        tree.depths.append(depth)
        tree.probabilities.append(math.exp(logp_))
    return tree
