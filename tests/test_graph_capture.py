"""Every step graph is captured when the engine opens (on a GPU), not by the first request: the
session's cache is left clean, the first request reuses it and its graphs, and its output is the
output of an engine that captured nothing. On the CPU the graphed body runs eagerly in place of
a capture (`StepRunner(capture=False)`), which is what this checks."""

import lucebox
from lucebox.engine.runner import StepRunner
from lucebox.limits import DECODE_ROWS

PROMPT = [5, 9, 3, 17, 2, 11, 30, 8, 1, 4]


def test_graphs_are_captured_at_start_up_and_the_first_request_reuses_them(reference_models):
    folder, _ = reference_models("laguna")
    plain = lucebox.LLM(folder, device="cpu", dtype="float32")
    expected = plain.generate(PROMPT, max_tokens=12, ignore_eos=True).token_ids
    llm = lucebox.LLM(folder, device="cpu", dtype="float32")
    llm.engine.runner = StepRunner(llm.engine.decoder, graphs=True, capture=False)
    reported = []
    llm.session.capture_graphs(lambda done, total: reported.append((done, total)))
    assert reported == [(i, DECODE_ROWS) for i in range(1, DECODE_ROWS + 1)]
    graphs = dict(llm.engine.runner.widths)
    assert set(graphs) == {(width, (), False) for width in range(1, DECODE_ROWS + 1)}
    cache = llm.session.cache
    assert cache.length == 0 and not cache.dirty and llm.engine.runner._bound is cache
    llm.session.warm()  # what opening does next with a drafter: it replays the graphs, keeping them
    assert llm.engine.runner.widths == graphs and llm.session.cache is cache
    assert llm.generate(PROMPT, max_tokens=12, ignore_eos=True).token_ids == expected
    assert llm.session.cache is cache and llm.engine.runner.widths[(1, (), False)] is graphs[(1, (), False)]
