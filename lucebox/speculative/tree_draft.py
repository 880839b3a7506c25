"""From one drafter pass's logits to a draft tree (`speculative.tree`), with one host read."""

from __future__ import annotations

from collections.abc import Callable

import torch

from lucebox.speculative.tree import ChildrenFn, DraftTree, build_tree, positional_children

# Given the pass's logits (P, V) and the top-k read back (ids and probabilities per position, host
# lists), the children of each node; a head that biases a position's logits by the node's own token
# (a "Markov head") returns a hook of its own here.
ChildrenHook = Callable[[torch.Tensor, list[list[int]], list[list[float]]], ChildrenFn]


def top_k_lists(logits: torch.Tensor, k: int) -> tuple[list[list[int]], list[list[float]]]:
    """Each position's k most likely ids and their probabilities (softmax of logits (P, V)), read
    back in one transfer."""
    k = min(k, logits.shape[-1])
    probs, ids = torch.softmax(logits.float(), dim=-1).topk(k, dim=-1)  # (P, k) each
    both = torch.cat([ids.double(), probs.double()], dim=1).tolist()  # ids < 2^53: exact
    return [[int(t) for t in row[:k]] for row in both], [row[k:] for row in both]


def draft_tree(logits: torch.Tensor, last: int, budget: int, hook: ChildrenHook | None = None) -> DraftTree:
    """The best-first tree of `budget` draft rows below `last` from logits (P, V) of positions
    1..P after it (a node at depth d takes its children from position d + 1)."""
    if budget <= 0 or logits.shape[0] == 0:
        return build_tree(last, 0, positional_children([], []))
    ids, probs = top_k_lists(logits, budget)  # no node has more children than the budget holds
    children = positional_children(ids, probs) if hook is None else hook(logits, ids, probs)
    return build_tree(last, budget, children)
