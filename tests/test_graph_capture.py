"""Every step graph is captured when the engine opens (on a GPU), not by the first request: the
session's cache is left clean, the first request reuses it and its graphs, and its output is the
output of an engine that captured nothing. On the CPU the graphed body runs eagerly in place of
a capture (`StepRunner(capture=False)`), which is what this checks."""

import contextlib
import gc

import torch

import lucebox
from lucebox import graph_capture
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


class FakeCuda:
    """What `graph_capture.capture` calls on torch.cuda, recorded: the streams made and, in order,
    the garbage collections and capture starts."""

    def __init__(self):
        self.streams, self.events = [], []
        fake = self

        class Stream:
            def __init__(self, device):
                fake.streams.append(self)

            def wait_stream(self, other):
                pass

            def synchronize(self):
                pass

        class Graph:
            def capture_begin(self, pool=None, capture_error_mode=None):
                fake.events.append("capture")

            def capture_end(self):
                pass

            def replay(self):
                pass

        self.Stream, self.CUDAGraph = Stream, Graph
        self.current = Stream(None)
        self.streams.clear()

    def current_stream(self, device):
        return self.current

    def stream(self, stream):
        return contextlib.nullcontext()


def test_every_graph_is_captured_on_one_side_stream_after_a_garbage_collection(monkeypatch):
    fake = FakeCuda()
    for name in ("Stream", "CUDAGraph", "current_stream", "stream"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    monkeypatch.setattr(gc, "collect", lambda *a: fake.events.append("gc"))
    monkeypatch.setattr(graph_capture, "_capture_streams", {})
    device = torch.device("cuda", 0)
    for _ in range(3):
        graph_capture.capture(lambda: None, device, pool=None)
    assert len(fake.streams) == 1  # one side stream: the graphs' pool shares its blocks among them
    assert fake.events == ["gc", "capture"] * 3
