"""Which part of a drafted tree to verify: the rows with the most expected tokens per second.

A tree row is kept when every row on its path is: its *reach* is the product, along the path, of
each node's drafter probability calibrated per depth as the width policy calibrates a chain's
confidences (`KeepModel`: measured keep rate over mean confidence at that position). A round that
verifies a set of rows closed under parents commits 1 + (the sum of their reaches) tokens on
average; since no row reaches further than its parent, the best set of B rows is the B rows of
highest reach, and the policy picks the B with the most expected tokens per second of
verification (the drafting is spent by then), B = 0 being a plain step. This is the chain rule of
`WidthPolicy.choose` extended to trees: a chain is a tree with one child per row.
"""

from __future__ import annotations

from lucebox.speculative.keep_model import KeepModel
from lucebox.speculative.tree import DraftTree, subtree


def calibrated_reach(tree: DraftTree, keep: KeepModel) -> list[float]:
    """Per row, the calibrated chance that it and every row above it are kept (1.0 for the root)."""
    reach = [1.0]
    for i in range(1, len(tree)):
        parent = tree.parents[i]
        own = tree.probabilities[i] / max(tree.probabilities[parent], 1e-12)  # the drafter's q of this node
        reach.append(reach[parent] * keep.calibrated(tree.depths[i] - 1, own))
    return reach


def choose_rows(tree: DraftTree, keep: KeepModel, step_seconds, min_reach: float | None = None) -> DraftTree:
    """The sub-tree worth verifying: the B rows of highest reach for the B with the most expected
    tokens per `step_seconds(rows)` (or, untimed, every row whose reach is at least `min_reach`)."""
    reach = calibrated_reach(tree, keep)
    # Highest reach first; on equal reach the shallower row, so a parent always precedes its children.
    order = sorted(range(1, len(tree)), key=lambda i: (-reach[i], tree.depths[i]))
    if min_reach is not None:
        best = sum(1 for i in order if reach[i] >= min_reach)
    else:
        best, best_rate, tokens = 0, 1.0 / step_seconds(1), 1.0
        for b, row in enumerate(order, start=1):
            tokens += reach[row]
            rate = tokens / step_seconds(b + 1)
            if rate > best_rate:
                best, best_rate = b, rate
    return subtree(tree, [0, *order[:best]])


def top_path(tree: DraftTree) -> tuple[list[int], list[float]]:
    """The drafter's first choice at every depth the tree reaches (each row's most likely child:
    rows are best first within a depth) and its probability: the chain the keep model judges."""
    tokens, confidence, row = [], [], 0
    while True:
        child = next((i for i in range(row + 1, len(tree)) if tree.parents[i] == row), None)
        if child is None:
            return tokens, confidence
        tokens.append(tree.tokens[child])
        confidence.append(tree.probabilities[child] / max(tree.probabilities[row], 1e-12))
        row = child
