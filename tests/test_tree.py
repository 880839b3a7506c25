"""Draft trees: the best-first builder, the greedy walk, and the sampled walk's exact outcome
distribution, enumerated against the target's own sequence probabilities (lossless)."""

import itertools
import math

import pytest
import torch

from lucebox.errors import InvalidArgumentError
from lucebox.sampling import SamplingParams
from lucebox.speculative.tree import build_tree, chain, positional_children
from lucebox.speculative.tree_draft import draft_tree, top_k_lists
from lucebox.speculative.tree_verify import decide_tree, path_histories, tree_outcomes, walk


def random_top_k(positions: int, k: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(positions, vocab, generator=g, dtype=torch.float64) * 2
    return logits, *top_k_lists(logits, k)


def path_tokens(tree, row):
    return tuple(tree.tokens[r] for r in tree.path(row))


@pytest.mark.parametrize("budget", [1, 5, 15])
def test_tree_holds_the_most_probable_paths_in_breadth_first_order(budget):
    logits, ids, probs = random_top_k(4, 3, 16, seed=budget)
    tree = build_tree(7, budget, positional_children(ids, probs))
    assert len(tree) == budget + 1 and tree.tokens[0] == 7
    # Every path of the top-k lattice, by path probability: the tree holds exactly the best `budget`.
    lattice = {}
    for depth in range(1, 5):
        for ranks in itertools.product(range(3), repeat=depth):
            lattice[tuple(ids[d][r] for d, r in enumerate(ranks))] = math.prod(probs[d][r] for d, r in enumerate(ranks))
    best = sorted(lattice, key=lattice.get, reverse=True)[:budget]
    assert {path_tokens(tree, i) for i in range(1, len(tree))} == set(best)
    for i in range(1, len(tree)):
        assert tree.parents[i] < i and tree.depths[i] == tree.depths[tree.parents[i]] + 1
        assert tree.depths[i] >= tree.depths[i - 1]  # breadth first
        assert all(a >= j + 1 for j, a in enumerate(tree.path(i)))  # what accept_path relies on
        assert tree.probabilities[i] == pytest.approx(lattice[path_tokens(tree, i)])
        bits = tree.ancestor_bits[i]
        assert [r for r in range(len(tree)) if bits >> r & 1] == [0, *tree.path(i)]


def test_children_hook_sees_each_node_depth_and_token():
    seen = []

    def children(depth, token):
        seen.append((depth, token))
        return ([token + 1, token + 2], [0.6, 0.3]) if depth < 2 else ([], [])

    tree = build_tree(10, 6, children)
    assert (0, 10) in seen and (1, 11) in seen
    assert path_tokens(tree, tree.child(tree.child(0, 11), 12)) == (11, 12)
    assert tree.depth == 2 and len(tree) == 7  # 2 + 4 nodes: the hook's depth limit holds


def test_budget_zero_is_the_root_alone_and_a_negative_one_is_refused():
    logits, ids, probs = random_top_k(3, 2, 8, seed=0)
    assert build_tree(3, 0, positional_children(ids, probs)).tokens == [3]
    assert draft_tree(logits, 3, 0).tokens == [3]
    with pytest.raises(InvalidArgumentError, match="budget"):
        build_tree(3, -1, positional_children(ids, probs))


def test_greedy_walk_follows_the_target_choice_down_the_tree():
    tree = build_tree(0, 6, lambda depth, token: ([1, 2], [0.5, 0.4]) if depth < 3 else ([], []))
    picks = [0] * len(tree)
    a = tree.child(0, 2)
    b = tree.child(a, 1)
    picks[0], picks[a], picks[b] = 2, 1, 9  # 9: no child carries it
    verdict = walk(tree, picks)
    assert verdict.path == [a, b] and verdict.next_token == 9
    assert walk(chain(5, [6, 7]), [6, 8, 0]).path == [1] and walk(chain(5, [6, 7]), [6, 8, 0]).next_token == 8


VOCAB = 3


def target(prefix: tuple) -> torch.Tensor:
    """A toy target: a distribution over 3 tokens for each prefix."""
    g = torch.Generator().manual_seed(hash(prefix) % (2**31))
    return torch.softmax(torch.randn(VOCAB, generator=g, dtype=torch.float64) * 1.5, dim=0)


def toy_tree(seed: int):
    return build_tree(0, 5, positional_children(*top_k_lists(torch.randn(3, VOCAB, generator=torch.Generator()
                                                                          .manual_seed(seed)), 2)))


def rows_p(tree) -> torch.Tensor:
    return torch.stack([target((0, *path_tokens(tree, i))) for i in range(len(tree))])


@pytest.mark.parametrize("seed", range(4))
def test_sampled_walk_commits_sequences_with_the_target_probability(seed):
    """Each outcome (stop at row i with token x), continued by the target itself to a common
    length, gives every sequence exactly the target's probability of it."""
    tree = toy_tree(seed)
    stop = tree_outcomes(rows_p(tree), tree)
    assert float(stop.sum()) == pytest.approx(1.0, abs=1e-12)
    length = tree.depth + 1
    got: dict[tuple, float] = {}
    for i, x in itertools.product(range(len(tree)), range(VOCAB)):
        head = (*path_tokens(tree, i), x)
        for tail in itertools.product(range(VOCAB), repeat=length - len(head)):
            seq = head + tail
            p = float(stop[i, x]) * math.prod(float(target((0, *seq[:j]))[seq[j]]) for j in range(len(head), length))
            got[seq] = got.get(seq, 0.0) + p
    for seq in itertools.product(range(VOCAB), repeat=length):
        want = math.prod(float(target((0, *seq[:j]))[seq[j]]) for j in range(length))
        assert got.get(seq, 0.0) == pytest.approx(want, abs=1e-12)


def test_sampled_decisions_follow_the_exact_outcomes():
    tree = toy_tree(1)
    p = rows_p(tree)
    stop = tree_outcomes(p, tree)
    g = torch.Generator().manual_seed(3)
    seen = torch.zeros(VOCAB, dtype=torch.bool)
    counts = torch.zeros_like(stop)
    draws = 3000
    for _ in range(draws):
        verdict = decide_tree(p.log(), tree, SamplingParams(temperature=1.0), seen, g)
        row = verdict.path[-1] if verdict.path else 0
        counts[row, verdict.next_token] += 1
    assert (counts / draws - stop).abs().max() < 0.03


def test_repetition_penalty_reads_each_row_s_own_path():
    tree = build_tree(0, 4, lambda depth, token: ([1, 2], [0.6, 0.3]) if depth < 2 else ([], []))
    seen = torch.zeros(4, dtype=torch.bool)
    seen[3] = True
    histories = path_histories(seen, tree)
    for i in range(len(tree)):
        want = {3, *path_tokens(tree, i)}
        assert set(histories[i].nonzero().flatten().tolist()) == want
    # Greedy with a penalty: the penalized argmax at each row, from its own history.
    logits = torch.tensor([[0.0, 1.0, 0.9, 0.0]] * len(tree), dtype=torch.float64)
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    verdict = decide_tree(logits, tree, params, seen, None)
    # root: 1; after 1: 2 (1 penalized to 0.5); after 1, 2: 1 (0.5 beats 2's 0.45), which ends the tree
    assert [tree.tokens[r] for r in verdict.path] == [1, 2] and verdict.next_token == 1
