"""Chain or tree rounds, chosen by the tokens per second each delivered (`speculative.tree_width`),
and the first-choice path of a tree that the keep rates learn from."""

import pytest
from test_tree import random_top_k

from lucebox.speculative.tree import build_tree, positional_children
from lucebox.speculative.tree_width import EXPLORE_EARLY, EXPLORE_EVERY, FEW, SWITCH_MARGIN, ShapeRates, top_path


def test_top_path_is_the_drafter_first_choice_at_each_depth():
    _, ids, probs = random_top_k(5, 3, 16, seed=0)
    tree = build_tree(9, 15, positional_children(ids, probs))
    tokens, confidence = top_path(tree)
    depth = len(tokens)
    assert depth >= 2 and tokens == [ids[d][0] for d in range(depth)]
    assert confidence == pytest.approx([probs[d][0] for d in range(depth)])


def test_rounds_take_the_faster_shape_and_try_the_other_now_and_then():
    shapes = ShapeRates()
    assert shapes.choose() == "chain"  # untried shapes first
    shapes.record("chain", 4, 0.02)  # 200 tokens/s
    assert shapes.choose() == "tree"
    shapes.record("tree", 3, 0.02)  # 150 tokens/s
    assert shapes.rates == pytest.approx({"chain": 200.0, "tree": 150.0})
    shapes.record("tree", 9, 0.02)  # 450: the average of the first rounds is a plain mean
    assert shapes.rates["tree"] == pytest.approx(300.0)
    for _ in range(FEW):
        shapes.record("chain", 4, 0.02)
        shapes.record("tree", 9, 0.02)
    choices = [shapes.choose() for _ in range(4 * EXPLORE_EVERY)]
    assert choices.count("chain") == 4 and choices.count("tree") == 4 * EXPLORE_EVERY - 4  # the faster, mostly


def test_few_measurements_explore_more_often():
    shapes = ShapeRates()
    shapes.record("chain", 8, 0.02)
    shapes.record("tree", 2, 0.02)
    choices = [shapes.choose() for _ in range(4 * EXPLORE_EARLY)]
    assert choices.count("tree") == 4 and EXPLORE_EARLY < EXPLORE_EVERY


def test_the_shape_in_use_stays_until_the_other_is_faster_by_a_margin():
    """Two shapes about as fast must not swap on each noisy round (runs of one command would then
    differ in what they verify): the one in use stays until the other beats it by SWITCH_MARGIN."""
    shapes = ShapeRates()
    shapes.counts = {"chain": FEW, "tree": FEW}
    shapes.rates = {"chain": 200.0, "tree": 190.0}
    shapes.rounds = 1  # not a round that explores
    assert shapes.choose() == "chain"  # the faster, once both are measured
    shapes.rates["tree"] = 200.0 * (1 + (SWITCH_MARGIN - 1) / 2)
    assert shapes.choose() == "chain"  # faster, but by less than the margin
    shapes.rates["tree"] = 200.0 * SWITCH_MARGIN * 1.01
    assert shapes.choose() == "tree"
    shapes.rates["chain"] = shapes.rates["tree"] * (1 + (SWITCH_MARGIN - 1) / 2)
    assert shapes.choose() == "tree"
