"""`Speculation.apply`, the one ending of every round, carries out a verdict made by hand
(`RoundResult`), a tree's and a chain's: the caches keep exactly the verdict's rows at the positions
after the prompt (a tree's path moved into place) and roll back the rest; the drafter receives the
committed tokens and their features; the judges learn from the new tokens; the totals count the
round; the newest token and the penalties' history move on."""

import pytest
import torch

from lucebox.caches import Step
from lucebox.engine.runner import StepRunner
from lucebox.generation import Chunk
from lucebox.sampling import SamplingParams
from lucebox.speculative.proposer import Draft, Proposer
from lucebox.speculative.round_result import RoundResult
from lucebox.speculative.rounds import DecodeContext, Speculation
from lucebox.speculative.tree import DraftTree, chain

PROMPT = list(range(200, 240))
NEXT = 7  # the target's token after the kept rows (the verdict's correction or bonus)


class Recording(Proposer):
    """A drafter that drafts nothing and records what it is given to commit."""

    def __init__(self):
        self.commits: list[tuple[list[int], torch.Tensor | None]] = []

    def propose(self, context, k, params, generator) -> Draft:
        return Draft([])

    def commit(self, committed, new, features) -> None:
        self.commits.append((committed[-new:], features))


def prefilled(llm, ids: list[int]):
    cache = llm.engine.new_cache()
    *_, hidden = llm.engine.prefill(ids, cache)
    return cache, hidden


def started(llm) -> tuple[Speculation, StepRunner, list[tuple]]:
    """A request's speculation stage after its first token, over a private cache whose calls are logged."""
    engine = llm.engine
    cache, hidden = prefilled(llm, PROMPT)
    calls: list[tuple] = []
    for name in ("accept_path", "commit", "rollback"):
        method = getattr(cache, name)
        setattr(cache, name, lambda *args, method=method, name=name: (calls.append((name, *args)), method(*args))[1])
    runner = StepRunner(engine.decoder, graphs=False)  # the engine's own stays bound to the session's cache
    setup = engine.setup
    context = DecodeContext(runner, cache, engine.clock, None, 7, "coupled", False, setup.model.vocab_size,
                            setup.device)
    params = SamplingParams(repetition_penalty=1.2)  # a penalty, so the stage keeps the history it reads
    spec = Speculation(context, params, Recording(), PROMPT)
    spec.first(engine.decoder.logits(hidden[-1:]))
    return spec, runner, calls


def next_logits(llm, runner: StepRunner, cache) -> torch.Tensor:
    """The target's logits for NEXT at the first free position: what they read is what the cache holds."""
    c = cache.length
    logits = runner.step([NEXT], Step.span(c, 1, llm.engine.setup.device), cache).logits
    cache.rollback(c)
    return logits


def test_applying_a_tree_verdict_moves_its_path_into_place_and_teaches_the_judges(tree_llm):
    spec, runner, calls = started(tree_llm)
    cache, last, c = spec.context.cache, spec.state.last, len(PROMPT)
    # last -> {11, 12}, 12 -> 13: the kept path is rows 2 and 3, one row out of place
    tree = DraftTree([last, 11, 12, 13], [-1, 0, 0, 2], [0, 1, 1, 2], [1.0, 0.5, 0.4, 0.3])
    runner.step(tree.tokens, Step.span(c, len(tree), tree_llm.engine.setup.device), cache, (), tree)
    spec.to_judge([12, 14], [0.9, 0.8], [12, 13, 15])  # the drafter's block and a copy, before the verdict
    features = torch.arange(3.0)[:, None]
    calls.clear()
    spec.apply(RoundResult(Chunk([12, 13, NEXT], ""), [last, 12, 13], 4, [2, 3], features, accepted=2, depth=2,
                           confidence=[], shape="tree", drafted=True, own_drafts=True, began=0.0, stepped=0.0))

    assert calls == [("accept_path", c, [2, 3]), ("commit", c + 3), ("rollback", c + 3)]
    assert cache.length == c + 3 and spec.state.tokens == [*PROMPT, last, 12, 13] and spec.state.last == NEXT
    reference, _ = prefilled(tree_llm, [*PROMPT, last, 12, 13])
    torch.testing.assert_close(next_logits(tree_llm, runner, cache), next_logits(tree_llm, runner, reference),
                               atol=1e-4, rtol=1e-4)
    assert spec.proposer.commits == [([last, 12, 13], features)]
    drafter, copies = spec.judge.model, spec.copy_judge.model
    assert drafter.counts[:3] == [1, 1, 0] and drafter.kept[0] > 0.6 > drafter.kept[1]  # 12 kept, 14 not
    assert copies.counts[:4] == [1, 1, 1, 0] and copies.kept[1] > 0.6 > copies.kept[2]  # 12, 13 kept, 15 not
    totals = spec.totals
    assert (totals.rounds, totals.committed, totals.widths[3], totals.kept[2]) == (1, 3, 1, 1)
    assert totals.drafted[:3] == totals.accepted[:3] == [1, 1, 0]
    assert spec.state.seen[[12, 13, NEXT]].all() and not spec.state.seen[[11, 14]].any()


@pytest.mark.parametrize("kept", [1, 4])
def test_applying_a_chain_verdict_keeps_its_rows_in_place_and_rolls_back_the_rest(tree_llm, kept):
    spec, runner, calls = started(tree_llm)
    cache, last, c = spec.context.cache, spec.state.last, len(PROMPT)
    drafts = [21, 22, 23]
    runner.step(chain(last, drafts).tokens, Step.span(c, 4, tree_llm.engine.setup.device), cache)
    rows = [last, *drafts][:kept]
    calls.clear()
    spec.apply(RoundResult(Chunk([*drafts[: kept - 1], NEXT], ""), rows, 4, None, None, accepted=kept - 1, depth=3,
                           confidence=[0.9, 0.8, 0.7], shape="chain", drafted=True, own_drafts=True, began=0.0,
                           stepped=0.0))

    rolled_back = [("rollback", c + kept)] if kept < 4 else []  # every row kept: nothing to roll back
    assert calls == [("commit", c + kept), *rolled_back]
    assert cache.length == c + kept and spec.state.tokens == [*PROMPT, *rows] and spec.state.last == NEXT
    reference, _ = prefilled(tree_llm, [*PROMPT, *rows])
    torch.testing.assert_close(next_logits(tree_llm, runner, cache), next_logits(tree_llm, runner, reference),
                               atol=1e-4, rtol=1e-4)
    assert spec.proposer.commits == [(rows, None)]
    totals = spec.totals
    assert (totals.rounds, totals.committed, totals.widths[3], totals.kept[kept - 1]) == (1, kept, 1, 1)
    assert totals.confidence[:3] == [0.9, 0.8, 0.7] and totals.drafted[:3] == [1, 1, 1]
