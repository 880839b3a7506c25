"""The adaptive width: per-position keep probabilities learned from every drafted block (verified
or not), drafting cost in the cost model, and no round switches drafting off for good."""

import pytest
import torch

import lucebox
from lucebox.sampling import SamplingParams
from lucebox.speculative.keep_model import DraftJudge, KeepModel, expected_tokens
from lucebox.speculative.width import MAX_PROBE_EVERY, PROBE_EVERY, RoundCosts, WidthPolicy

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
    # Still not paying: each probe doubles the wait before the next (up to MAX_PROBE_EVERY).
    assert [p.should_draft(7) for _ in range(2 * PROBE_EVERY)] == [False] * (2 * PROBE_EVERY - 1) + [True]
    for _ in range(8 * MAX_PROBE_EVERY):
        p.should_draft(7)
    assert sum(p.should_draft(7) for _ in range(4 * MAX_PROBE_EVERY)) == 4
    p.keep.kept = [0.9] * 7
    assert p.should_draft(7)  # the drafter does better: drafting is back
    p.keep.kept = [0.1] * 7  # and a new bad stretch is probed at the first interval again
    assert [p.should_draft(7) for _ in range(PROBE_EVERY)] == [False] * (PROBE_EVERY - 1) + [True]
    costly = policy(draft_seconds=20.0)
    costly.keep.kept = [0.9] * 7
    assert not costly.should_draft(7)  # expected 5.8 tokens cannot pay 21 steps' time


def test_a_new_request_goes_on_with_the_probe_schedule_of_its_mode():
    """Where drafting does not pay (sampled text the drafter cannot follow), each short request
    must not start probing every PROBE_EVERY rounds again: the schedule is the engine's, by mode."""
    import torch

    from lucebox.sampling import SamplingParams
    from lucebox.speculative.learned import Learned, read_calibration
    from lucebox.speculative.rounds import DecodeContext, _policy

    learned = Learned(RoundCosts(dict(STEPS), draft_seconds=0.2), read_calibration(None))
    context = DecodeContext(None, None, None, learned, 7, "coupled", True, 16, torch.device("cpu"))
    sampled, greedy = SamplingParams(temperature=0.8), SamplingParams()

    def request(params, rounds):
        p = _policy(context, params, True)
        p.keep.kept = [0.1] * 7  # drafting does not pay
        return [p.should_draft(7) for _ in range(rounds)]

    probes = [i for i, drafted in enumerate(request(sampled, 8 * MAX_PROBE_EVERY)) if drafted]
    assert probes[-1] - probes[-2] == MAX_PROBE_EVERY  # backed off to the longest wait
    assert not any(request(sampled, 2 * PROBE_EVERY))  # the next request waits on where it stood
    assert request(greedy, PROBE_EVERY)[-1]  # greedy decoding keeps a schedule of its own
    assert not any(request(sampled, 2 * PROBE_EVERY))


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


def test_a_stalled_round_does_not_price_drafting_out():
    p = policy(draft_seconds=0.2)
    p.keep.kept = [0.9] * 7
    for _ in range(50):
        p.record(8, 1.2, 0.2)
        p.record(1, 1.0, None)
    p.record(8, 1.2, 60.0)  # the machine stalled during one drafting (300x its usual time)
    p.record(1, 100.0, None)  # and during one plain step
    assert p.costs.drafting() < 0.25 and p.costs.step(1) < 1.2
    assert p.should_draft(7)  # drafting still pays: the next round drafts
    for _ in range(200):  # a lasting slowdown is followed, clip after clip
        p.record(1, 10.0, 6.0)
    assert abs(p.costs.drafting() - 6.0) < 0.1 and abs(p.costs.step(1) - 10.0) < 0.5
    fresh = RoundCosts(dict(STEPS))  # an engine's first drafting (prompt catch-up, first calls) is left out
    fresh.refine_drafting(9.0)
    assert fresh.drafting() == 0.0
    fresh.refine_drafting(0.3)
    assert fresh.drafting() == 0.3


def test_a_calibration_turns_reach_into_keep_rates_and_the_builtin_drafter_ships_one(tmp_path):
    import pytest

    from lucebox.builtin import builtin_model
    from lucebox.errors import DraftModelError
    from lucebox.speculative.drafters import paired_drafter
    from lucebox.speculative.learned import CALIBRATION_FILE, calibration_record, read_calibration

    record = calibration_record({"acceptance_by_position": [0.8, 0.4], "confidence_by_position": [0.5, 0.3]})
    assert record["greedy"]["keep_rate_by_position"] == [0.8, 0.5]  # reaching 2 given 1 was kept: 0.4 / 0.8
    shipped = read_calibration(paired_drafter(builtin_model()))
    assert 0.7 < shipped["greedy"].kept[0] < 0.95 and shipped["sampled"].kept[0] < shipped["greedy"].kept[0]
    (tmp_path / CALIBRATION_FILE).write_text('{"greedy": {"keep_rate_by_position": 3}}')
    with pytest.raises(DraftModelError, match="is not a drafter calibration"):
        read_calibration(tmp_path)


def test_a_seeded_sampled_request_gives_the_same_tokens_whatever_ran_before():
    import lucebox

    llm = lucebox.LLM(device="cpu", dtype="float32")
    request = dict(max_tokens=40, temperature=0.8, seed=3, ignore_eos=True)
    first = llm.generate("def parse(line):\n", **request).token_ids
    for seed in range(3):  # other sampled requests teach the engine's running keep rates
        llm.generate("class Stack:\n", max_tokens=40, temperature=0.8, seed=seed, ignore_eos=True)
        llm.generate("import os\n", max_tokens=40, temperature=0.8, ignore_eos=True)
    assert llm.generate("def parse(line):\n", **request).token_ids == first


def test_only_the_drafter_s_own_passes_price_drafting(builtin_llm, monkeypatch):
    """A prompt-lookup copy costs next to nothing: timed as drafting, it would make the drafter look
    free and the policy draft where it does not pay. Each drafting time recorded is a drafter pass."""
    from lucebox.speculative.dflash import DFlashProposer

    passes, copies, drafting_times = [], [], []

    def counted(method, log):
        return lambda self, *a: (lambda out: (log.append(getattr(out, "copied", True)), out)[1])(method(self, *a))
    monkeypatch.setattr(DFlashProposer, "block_pass", counted(DFlashProposer.block_pass, passes))
    monkeypatch.setattr(DFlashProposer, "propose", counted(DFlashProposer.propose, copies))
    monkeypatch.setattr(DFlashProposer, "propose_tree", counted(DFlashProposer.propose_tree, copies))
    record = WidthPolicy.record
    monkeypatch.setattr(WidthPolicy, "record", lambda self, rows, step_s, draft_s, drafts=1: (
        drafting_times.append(draft_s), record(self, rows, step_s, draft_s, drafts))[1])
    # Every other copy is cut to nothing (the round then drafts with the drafter) and the rest kept in
    # part, under rows priced by a fixed line: both kinds of round happen, whatever earlier requests'
    # times taught the shared engine (which once left every copy kept and the drafter idle).
    from lucebox.speculative.rounds import Speculation

    cuts = []
    monkeypatch.setattr(Speculation, "cut_copy", lambda self, copied, limit: (
        cuts.append(copied), copied[:2] if len(cuts) % 2 else [])[1])
    monkeypatch.setattr(builtin_llm.engine.learned, "costs", RoundCosts({1: 1.0, 8: 1.7}))
    builtin_llm.generate("def f(x):\n    return x\n" * 4, max_tokens=48, ignore_eos=True)
    assert any(copies) and passes  # lookups copied, and the drafter ran too
    assert len([t for t in drafting_times if t is not None]) == len(passes)


def test_copies_the_copy_keep_rates_do_not_pay_for_are_cut(builtin_llm, monkeypatch):
    """Copies have keep rates of their own (under sampling few copies are kept): a copy they do not
    pay for is cut, even to nothing (a plain round), and judged whole all the same."""
    from lucebox.speculative.rounds import Speculation

    cuts, cut_copy = [], Speculation.cut_copy
    monkeypatch.setattr(Speculation, "cut_copy", lambda self, copied, limit: (
        lambda kept: (cuts.append((len(copied), len(kept))), kept)[1])(cut_copy(self, copied, limit)))
    monkeypatch.setitem(builtin_llm.engine.learned.copies, "greedy", KeepModel.from_calibration([0.02], [0.02]))
    # Rows priced by a fixed line (0.9 + 0.1 per row), not by what earlier requests' times taught the
    # shared engine (on a loaded machine they can fit a slope of 0: every width priced as one row).
    monkeypatch.setattr(builtin_llm.engine.learned, "costs", RoundCosts({1: 1.0, 8: 1.7}))
    monkeypatch.setattr(WidthPolicy, "record", lambda self, rows, step_s, draft_s, drafts=1: None)
    builtin_llm.generate("def f(x):\n    return x\n" * 4, max_tokens=24, ignore_eos=True)
    assert cuts and cuts[0][0] > 2 and cuts[0][1] <= 1
    assert builtin_llm.engine.learned.copies["greedy"].kept[0] > 0.02  # the copy was judged: it was kept


@pytest.mark.parametrize("shape", ["tree", "chain"])
def test_a_copy_cut_to_nothing_leaves_the_round_to_the_drafter(builtin_llm, monkeypatch, shape):
    """Text that repeats itself offers a copy at every round. Where the copies' keep rates pay for
    none of it, the round asks the width policy once whether the drafter pays (or its probe is due)
    and, if so, drafts with it rather than decoding plainly (otherwise such text would never draft,
    measure or probe the drafter), the whole copy still going to the copies' judge. Tree rounds (the
    built-in model's default) and chain rounds (a tree budget of 0)."""
    import dataclasses

    from lucebox.speculative.dflash import DFlashProposer
    from lucebox.speculative.rounds import Speculation
    from lucebox.speculative.tree_width import ShapeRates

    events = []  # in order: "round", "propose", "nothing" / "some" (a copy cut), "should", "own", ("judge", copy)

    def logged(method, event):
        return lambda self, *a: (events.append(event(a)), method(self, *a))[1]
    cut_copy = Speculation.cut_copy
    monkeypatch.setattr(Speculation, "cut_copy", lambda self, copied, limit: (
        lambda kept: (events.append("some" if kept else "nothing"), kept)[1])(cut_copy(self, copied, limit)))
    monkeypatch.setattr(Speculation, "to_judge", logged(Speculation.to_judge, lambda a: ("judge", len(a[2]))))
    monkeypatch.setattr(Speculation, "round", logged(Speculation.round, lambda a: "round"))
    for name, event in (("propose", "propose"), ("propose_tree", "propose"), ("own_draft", "own"), ("own_tree", "own")):
        monkeypatch.setattr(DFlashProposer, name, logged(getattr(DFlashProposer, name), lambda a, e=event: e))
    monkeypatch.setitem(builtin_llm.engine.learned.copies, "greedy", KeepModel.from_calibration([0.0], [0.0]))
    # The drafter pays (what earlier requests taught the shared engine's policy is not this test's matter)
    monkeypatch.setattr(WidthPolicy, "should_draft", lambda self, limit: (
        events.append("should"), self.has_drafter and limit > 0)[1])
    if shape == "chain":
        monkeypatch.setattr(builtin_llm.engine, "setup", dataclasses.replace(builtin_llm.engine.setup, tree_budget=0))
    else:
        monkeypatch.setattr(ShapeRates, "choose", lambda self: "tree")
    text = "def f(x):\n    return x\n" * 4
    plain = builtin_llm.generate(text, max_tokens=24, ignore_eos=True, speculate=False).token_ids
    events.clear()
    assert builtin_llm.generate(text, max_tokens=24, ignore_eos=True).token_ids == plain
    rounds = [events[i:] for i, e in enumerate(events) if e == "nothing"]
    rounds = [r[: r.index("round")] if "round" in r else r for r in rounds]  # up to the next round
    assert rounds
    for r in rounds:  # the policy asked once, the drafter's own drafts taken, the whole copy judged last
        assert r.count("should") == 1 and "own" in r
        assert [e for e in r if isinstance(e, tuple)][-1][1] > 0


def test_a_sequential_drafter_pays_per_draft_and_drafts_only_as_deep_as_pays():
    """An MTP head makes each draft with a pass of its own: the same keep rates and a draft that
    costs 0.3 of a step buy a shorter round than a block drafter's one pass for all of them,
    the round drafts one past that width (not all it may), and a round's drafting time is learned
    per draft."""
    keep = KeepModel.from_calibration([0.9] * 8, [0.9] * 8)
    costs = {1: 1.0, 8: 1.1}  # wide verify steps cost little more than one row

    def policy(sequential):
        return WidthPolicy(RoundCosts(dict(costs), draft_seconds=0.3), keep, sequential=sequential)

    block, sequential = policy(False), policy(True)
    widths = [p.rate(keep.predict(None, 8), p.costs.drafting())[0] for p in (block, sequential)]
    assert widths[1] < widths[0] == 8
    assert sequential.depth(8) == widths[1] + 1 and block.depth(8) == 8
    sequential.record(1, 1.0, 2.4, drafts=8)
    assert sequential.costs.drafting() == pytest.approx(0.3)  # 2.4 s for 8 drafts: 0.3 each


def test_a_draft_model_is_sequential_and_drafts_only_as_deep_as_the_round_asks(laguna):
    """A forward per draft, like an MTP head: the chain round asks it for `WidthPolicy.depth` drafts."""
    proposer = lucebox.LLM(laguna, draft=str(laguna), device="cpu", dtype="float64").proposer
    assert proposer.sequential
    context = list(range(5, 30))
    with torch.inference_mode():
        proposer.start(context[:-1], None)
        assert len(proposer.propose(context, 8, SamplingParams(), None, own_k=3).tokens) == 3
        assert len(proposer.propose(context, 8, SamplingParams(), None).tokens) == 8
