"""Which rows of a drafted tree the width policy verifies: the highest calibrated reach, as many
as pay for their verification (`speculative.tree_width`)."""

import math

import pytest
from test_tree import random_top_k

from lucebox.speculative.keep_model import KeepModel
from lucebox.speculative.tree import build_tree, positional_children
from lucebox.speculative.tree_width import calibrated_reach, choose_rows, top_path


def drafted_tree(budget=12, seed=0):
    _, ids, probs = random_top_k(5, 3, 16, seed=seed)
    return build_tree(9, budget, positional_children(ids, probs)), ids, probs


def test_reach_is_the_path_probability_calibrated_per_depth():
    tree, _, _ = drafted_tree()
    assert calibrated_reach(tree, KeepModel()) == pytest.approx(tree.probabilities)  # kept == confidence: unscaled
    keep = KeepModel.from_calibration([0.5, 0.25], [1.0, 1.0])  # depth 1 halves, depth 2 and on quarter
    reach = calibrated_reach(tree, keep)
    for i in range(1, len(tree)):
        scale = math.prod(0.5 if tree.depths[r] == 1 else 0.25 for r in [*tree.path(i)])
        assert reach[i] == pytest.approx(tree.probabilities[i] * scale)


def test_the_chosen_rows_are_the_highest_reach_and_pay_for_their_rows():
    tree, _, _ = drafted_tree()
    keep = KeepModel()
    free = choose_rows(tree, keep, lambda rows: 1.0)  # rows cost nothing: every row that can be kept is worth it
    assert len(free) == len(tree)
    assert len(choose_rows(tree, keep, lambda rows: float(rows) ** 3)) == 1  # rows cost a lot: a plain step
    cost = lambda rows: 1.0 + 0.15 * rows  # noqa: E731
    chosen = choose_rows(tree, keep, cost)
    reach = sorted(calibrated_reach(tree, keep)[1:], reverse=True)
    rates = [(1 + sum(reach[:b])) / cost(b + 1) for b in range(len(reach) + 1)]
    assert len(chosen) - 1 == max(range(len(rates)), key=rates.__getitem__)
    assert 1 < len(chosen) < len(tree)
    kept_paths = {tuple(chosen.tokens[r] for r in chosen.path(i)) for i in range(1, len(chosen))}
    all_paths = {tuple(tree.tokens[r] for r in tree.path(i)): p for i, p in enumerate(tree.probabilities) if i}
    threshold = min(all_paths[p] for p in kept_paths)
    assert all(p in kept_paths for p, q in all_paths.items() if q > threshold)  # nothing better was left out
    for i in range(1, len(chosen)):
        assert chosen.parents[i] < i and chosen.depths[i] == chosen.depths[chosen.parents[i]] + 1


def test_untimed_choice_keeps_rows_above_the_reach_floor():
    tree, _, _ = drafted_tree()
    chosen = choose_rows(tree, KeepModel(), None, min_reach=0.2)
    assert sorted(chosen.probabilities[1:]) == sorted(p for p in tree.probabilities[1:] if p >= 0.2)


def test_top_path_is_the_drafter_first_choice_at_each_depth():
    tree, ids, probs = drafted_tree(budget=15)
    tokens, confidence = top_path(tree)
    depth = len(tokens)
    assert depth >= 2 and tokens == [ids[d][0] for d in range(depth)]
    assert confidence == pytest.approx([probs[d][0] for d in range(depth)])


def test_a_subtree_keeps_every_kept_row_s_path():
    from lucebox.speculative.tree import subtree

    tree, _, _ = drafted_tree(budget=15)
    deepest = max(range(len(tree)), key=lambda i: (tree.depths[i], -i))
    rows = [0, *tree.path(deepest)]  # one path: its rows' siblings (earlier rows) are left out
    assert rows != list(range(len(rows)))
    cut = subtree(tree, rows)
    assert [cut.tokens[r] for r in cut.path(len(cut) - 1)] == [tree.tokens[r] for r in tree.path(deepest)]
    with pytest.raises(ValueError, match="not a sub-tree"):
        subtree(tree, [0, deepest])
