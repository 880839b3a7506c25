"""Draft trees: several continuations of `last` verified in one target step.

Vocabulary (beside `verify.py`'s): a *tree* has `last` as its root (row 0) and one row per draft
node; `parents[i]` is row i's parent row, `depths[i]` its distance from the root (the node's draft
position), so node i continues `last` by the tokens on its root-to-node *path*. Rows are in
breadth-first order (by depth, then by how likely the drafter found them), so a parent's row is
always before its children's and a path's rows increase with depth: row a_j of a path's j-th node
has a_j >= j, which is what lets the caches move an accepted path into place in order
(`KVCache.accept_path`). The row *budget* counts the draft rows (the root excluded); budget 0 is
a chain of no drafts, today's plain step.

`build_tree` grows the tree best first by path probability (the product of the drafter's
probabilities along the path): the drafter's top-k at each position, for the children of every
node at the depth before it, unless a `children` hook says otherwise.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lucebox.errors import InvalidArgumentError

# A node's children candidates given its depth and its own token: (ids, probabilities), most likely
# first; ([], []) for none. The default reads the drafter's distribution at position depth + 1
# whatever the token (a head that conditions on the previous token plugs in here).
ChildrenFn = Callable[[int, int], tuple[Sequence[int], Sequence[float]]]


@dataclass(frozen=True)
class DraftTree:
    tokens: list[int]  # row i's token; tokens[0] is `last`
    parents: list[int]  # parents[0] = -1
    depths: list[int]
    probabilities: list[float]  # the drafter's path probability of each row (1.0 for the root)
    copied: bool = False  # a chain copied from the context (prompt lookup), not the drafter's

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def ancestor_bits(self) -> list[int]:
        """Per row, bit j set when row j is an ancestor of it or itself (what attention reads)."""
        bits: list[int] = []
        for i, parent in enumerate(self.parents):
            bits.append((bits[parent] if parent >= 0 else 0) | (1 << i))
        return bits

    def child(self, row: int, token: int) -> int | None:
        """The child row of `row` carrying `token`, or None."""
        for i in range(row + 1, len(self.tokens)):
            if self.parents[i] == row and self.tokens[i] == token:
                return i
        return None

    def path(self, row: int) -> list[int]:
        """The rows from the root's first child down to `row` (empty for the root)."""
        rows = []
        while row > 0:
            rows.append(row)
            row = self.parents[row]
        return rows[::-1]

    @property
    def depth(self) -> int:
        return max(self.depths)


def chain(last: int, drafts: Sequence[int]) -> DraftTree:
    """The tree of one path: today's chain of drafts."""
    n = len(drafts)
    return DraftTree([last, *drafts], list(range(-1, n)), list(range(n + 1)), [1.0] * (n + 1))


def positional_children(top_ids: Sequence[Sequence[int]], top_probs: Sequence[Sequence[float]]) -> ChildrenFn:
    """The default hook: the children of a node at depth d are position d + 1's top-k, whatever
    the node's token (top_ids[d] holds position d + 1's ids)."""

    def children(depth: int, token: int) -> tuple[Sequence[int], Sequence[float]]:
        if depth >= len(top_ids):
            return [], []
        return top_ids[depth], top_probs[depth]

    return children


def build_tree(last: int, budget: int, children: ChildrenFn) -> DraftTree:
    """The `budget` most probable nodes (by path probability) below `last`, best first, then in
    breadth-first order. A child is never more probable than its parent, so every node's parent
    is chosen before it."""
    if budget < 0:
        raise InvalidArgumentError(f"a tree's row budget must be >= 0, got {budget}")
    tokens, parents, depths, probs = [last], [-1], [0], [1.0]
    frontier: list[tuple[float, int, int, int]] = []  # (-path probability, order, parent row, token)
    order = 0

    def expand(row: int) -> None:
        nonlocal order
        ids, ps = children(depths[row], tokens[row])
        for token, p in zip(ids, ps, strict=True):
            heapq.heappush(frontier, (-probs[row] * float(p), order, row, int(token)))
            order += 1

    expand(0)
    while frontier and len(tokens) <= budget:
        neg, _, parent, token = heapq.heappop(frontier)
        tokens.append(token)
        parents.append(parent)
        depths.append(depths[parent] + 1)
        probs.append(-neg)
        expand(len(tokens) - 1)
    return _breadth_first(DraftTree(tokens, parents, depths, probs))


def _breadth_first(tree: DraftTree) -> DraftTree:
    """The same tree with rows sorted by depth (stable: best first within a depth)."""
    order = sorted(range(len(tree)), key=lambda i: tree.depths[i])
    new_row = {old: new for new, old in enumerate(order)}
    return DraftTree([tree.tokens[i] for i in order],
                     [new_row[tree.parents[i]] if tree.parents[i] >= 0 else -1 for i in order],
                     [tree.depths[i] for i in order], [tree.probabilities[i] for i in order])

