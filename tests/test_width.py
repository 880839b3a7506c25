"""The adaptive width: per-position keep probabilities learned from every drafted block (verified
or not), drafting cost in the cost model, and no round switches drafting off for good."""

from lucebox.speculative.keep_model import DraftJudge, KeepModel, expected_tokens
from lucebox.speculative.width import PROBE_EVERY, RoundCosts, WidthPolicy

STEPS = {1: 1.0, 2: 1.05, 4: 1.1, 8: 1.2, 16: 1.4}


def policy(**kw) -> WidthPolicy:
    return WidthPolicy(RoundCosts(dict(STEPS), draft_seconds=kw.pop("draft_seconds", 0.3)), KeepModel(), **kw)


def test_confidence_is_calibrated_per_position_by_what_is_committed():
    p = policy()
    judge = DraftJudge(p.keep)
    beliefs = [0.3] * 7  # an underconfident drafter: says 0.3, is always right
    before = p.choose(beliefs, 7, 7)
    for _ in range(60):
        judge.drafted(list(range(7)), beliefs)
        judge.committed(list(range(8)))
    assert all(k / c > 2.5 for k, c in zip(p.keep.kept[:7], p.keep.confidence[:7], strict=True))
    assert p.choose(beliefs, 7, 7) == 7 > before


def test_an_overconfident_drafter_is_trimmed():
    p = policy()
    judge = DraftJudge(p.keep)
    beliefs = [0.95] * 7  # says 0.95, the first draft is always wrong
    assert p.choose(beliefs, 7, 7) == 7
    for _ in range(60):
        judge.drafted(list(range(7)), beliefs)
        judge.committed([99])
    assert p.keep.kept[0] < 0.1 and p.choose(beliefs, 7, 7) < 3


def test_unverified_drafts_are_judged_by_the_tokens_that_come_later():
    keep = KeepModel()
    judge = DraftJudge(keep)
    judge.drafted([5, 6, 7, 8], [0.5] * 4)  # a round that verified none of them
    judge.committed([5])  # a plain step: the first draft would have been kept
    judge.committed([6])
    judge.committed([0])  # the third would not: the fourth is never judged
    judge.committed([8])
    assert keep.judged == 3 and keep.kept[0] > 0.6 and keep.kept[2] < 0.6 and keep.kept[3] == 0.6


def test_drafting_cost_counts_and_a_bad_stretch_is_probed_again():
    p = policy(draft_seconds=0.2)
    p.keep.kept = [0.1] * 7  # a bad stretch: drafting does not pay
    assert not any(p.should_draft(7) for _ in range(PROBE_EVERY - 1))
    assert p.should_draft(7)  # the probe: the drafter runs, its block is judged
    p.keep.kept = [0.9] * 7
    assert p.should_draft(7)  # the drafter does better: drafting is back
    costly = policy(draft_seconds=20.0)
    costly.keep.kept = [0.9] * 7
    assert not costly.should_draft(7)  # expected 5.8 tokens cannot pay 21 steps' time


def test_expected_tokens_multiply_keep_rates():
    assert expected_tokens([0.5, 0.5]) == [1.0, 1.5, 1.75]


def test_step_costs_pool_every_width_so_one_noisy_measurement_moves_them_little():
    costs = RoundCosts({1: 1.0, 8: 1.7})  # a line: 0.9 + 0.1 * rows
    assert abs(costs.step(4) - 1.3) < 1e-9
    costs.refine_step(6, 0.5)  # one fast outlier at width 6
    assert costs.step(5) < costs.step(6) < costs.step(7)  # still a line: no width looks cheaper than a narrower one
    for _ in range(100):  # plain steps got slower: the whole line follows, widths never measured too
        costs.refine_step(1, 2.0)
        costs.refine_step(8, 2.7)
    assert abs(costs.step(1) - 2.0) < 0.05 and abs(costs.step(4) - 2.3) < 0.05
