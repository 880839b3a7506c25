"""Verification is lossless: enumerating every draft block and every outcome, the committed
tokens are distributed exactly as the target samples them (to 1e-9)."""

import itertools
from collections import defaultdict

import pytest
import torch

from lucebox.speculative.verify import block_outcomes, sample, tokenwise_outcomes, verify_greedy


def random_table(V, seed, zeros=0.0, one_hot=False):
    """P(x | prefix) for every prefix, made on demand and remembered."""
    gen = torch.Generator().manual_seed(seed)
    table = {}

    def dist(prefix):
        if prefix not in table:
            if one_hot:
                d = torch.zeros(V, dtype=torch.float64)
                d[int(torch.randint(V, (1,), generator=gen))] = 1.0
            else:
                d = torch.rand(V, generator=gen, dtype=torch.float64) ** 2
                d[torch.rand(V, generator=gen) < zeros] = 0.0
                if d.sum() == 0:
                    d[int(torch.randint(V, (1,), generator=gen))] = 1.0
                d /= d.sum()
            table[prefix] = d
        return table[prefix]

    return dist


def committed_distribution(outcomes_fn, P, Q, V, K):
    """Probability of every length-(K+1) sequence: one verified round, then the target samples
    on to length K+1 (so only the round itself can break equality)."""
    total = defaultdict(float)
    for drafts in itertools.product(range(V), repeat=K):
        q_prob = 1.0
        for i, d in enumerate(drafts):
            q_prob *= float(Q(drafts[:i])[d])
        if q_prob == 0:
            continue
        p = torch.stack([P(drafts[:i]) for i in range(K + 1)])
        q = torch.stack([Q(drafts[:i]) for i in range(K)])
        o = outcomes_fn(p, q, list(drafts))
        assert abs(float(o.accept.sum()) - 1) < 1e-12
        for n in range(K + 1):
            for t in range(V):
                mass = q_prob * float(o.accept[n]) * float(o.next_dists[n][t])
                if mass == 0:
                    continue
                head = drafts[:n] + (t,)
                for tail in itertools.product(range(V), repeat=K - n):
                    m = mass
                    for j, x in enumerate(tail):
                        m *= float(P(head + tail[:j])[x])
                    total[head + tail] += m
    return total


def target_distribution(P, V, K):
    out = {}
    for seq in itertools.product(range(V), repeat=K + 1):
        m = 1.0
        for j, x in enumerate(seq):
            m *= float(P(seq[:j])[x])
        out[seq] = m
    return out


CASES = {
    "random": lambda V: (random_table(V, 1), random_table(V, 2)),
    "zeros_in_both": lambda V: (random_table(V, 3, zeros=0.4), random_table(V, 4, zeros=0.4)),
    "deterministic_drafts": lambda V: (random_table(V, 5), random_table(V, 6, one_hot=True)),
    "draft_equals_target": lambda V: (random_table(V, 7),) * 2,
    "greedy_target": lambda V: (random_table(V, 8, one_hot=True), random_table(V, 9)),
    "disjoint_support": lambda V: (random_table(V, 10, zeros=0.6), random_table(V, 11, zeros=0.6)),
}


@pytest.mark.parametrize("rule", [tokenwise_outcomes, block_outcomes], ids=["tokenwise", "block"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("V, K", [(6, 2), (4, 3)])
def test_committed_tokens_follow_the_target_exactly(rule, case, V, K):
    P, Q = CASES[case](V)
    got = committed_distribution(rule, P, Q, V, K)
    expected = target_distribution(P, V, K)
    assert max(abs(got.get(s, 0.0) - m) for s, m in expected.items()) < 1e-9
    assert sum(got.values()) == pytest.approx(1.0, abs=1e-9)


def test_block_verification_keeps_at_least_as_many_drafts_on_average():
    V, K = 4, 3
    P, Q = random_table(V, 21), random_table(V, 22)
    expected_len = {}
    for name, rule in (("tokenwise", tokenwise_outcomes), ("block", block_outcomes)):
        mean = 0.0
        for drafts in itertools.product(range(V), repeat=K):
            q_prob = 1.0
            for i, d in enumerate(drafts):
                q_prob *= float(Q(drafts[:i])[d])
            p = torch.stack([P(drafts[:i]) for i in range(K + 1)])
            q = torch.stack([Q(drafts[:i]) for i in range(K)])
            o = rule(p, q, list(drafts))
            mean += q_prob * sum(n * float(o.accept[n]) for n in range(K + 1))
        expected_len[name] = mean
    assert expected_len["block"] >= expected_len["tokenwise"] - 1e-12
    assert expected_len["block"] > expected_len["tokenwise"]  # strictly better on this example


def test_sampling_follows_the_outcome_distribution():
    V, K = 5, 3
    P, Q = random_table(V, 31), random_table(V, 32)
    drafts = [1, 2, 3]
    p = torch.stack([P(tuple(drafts[:i])) for i in range(K + 1)])
    q = torch.stack([Q(tuple(drafts[:i])) for i in range(K)])
    o = block_outcomes(p, q, drafts)
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(K + 1)
    for _ in range(20000):
        counts[sample(o, gen).accepted] += 1
    assert (counts / 20000 - o.accept.float()).abs().max() < 0.015


def test_greedy_keeps_the_matching_prefix_and_takes_the_targets_next_token():
    assert verify_greedy([5, 6, 7, 8], [5, 6, 9]).__dict__ == {"accepted": 2, "next_token": 7}
    assert verify_greedy([5, 6, 7, 8], [5, 6, 7]).__dict__ == {"accepted": 3, "next_token": 8}
    assert verify_greedy([4], []).__dict__ == {"accepted": 0, "next_token": 4}
