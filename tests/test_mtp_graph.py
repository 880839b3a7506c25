"""The MTP head's draft pass as a graph (`speculative.mtp_graph`): its body, run eagerly as on the
CPU (`capture=False`), drafts what the eager pass drafts over the same cache; an engine whose
head and steps take their graphed bodies, captured at start-up, decodes as plain decoding does,
greedy and seeded sampled; and the cache the graph reads by address is emptied in place, never
replaced, except after a step cut short (then the graph is remade over the new one)."""

import pytest
import torch
from kernel_cases import no_host_sync

import lucebox
from lucebox.engine.runner import StepRunner
from lucebox.sampling import SamplingParams

PROMPT = [5, 9, 17, 33, 2, 64, 100, 7, 7, 21, 90, 3, 44, 18, 120, 6, 75, 31, 12, 58, 99, 4, 27, 81]
BIAS = {5: 30.0, 6: 30.0, 7: 30.0}  # predictable enough that the random head's drafts are kept some of the time
COMMON = dict(device="cpu", dtype="float64", prefill_chunk=8)


def _graphed(folder, **options) -> lucebox.LLM:
    """An engine whose steps and head passes run their graphs' bodies (as captured on CUDA),
    captured at start-up, the head's pass writing its outputs into the same tensors at every
    replay, as a replay does; the head's own drafts (no prompt-lookup copies); a head ring of 16
    tokens, which the requests here wrap."""
    llm = lucebox.LLM(folder, adaptive=False, draft_ctx=16, **COMMON, **options)
    llm.proposer.lookup = None
    llm.engine.runner = StepRunner(llm.engine.decoder, graphs=True, capture=False)
    llm.proposer.graph_with(capture=False)
    _replaying(llm.proposer.graph)
    llm.session.capture_graphs()
    return llm


def _replaying(graph) -> None:
    """`graph.run` returning the first run's output tensors every time, overwritten by each run."""
    def run():
        made = graph.body()
        if graph.out is None:
            graph.out = made
        for kept, new in zip(graph.out, made, strict=True):
            kept.copy_(new)
        return graph.out

    graph.run = run


@pytest.mark.parametrize("options", [{"logit_bias": BIAS}, {"temperature": 0.8, "seed": 11, "logit_bias": BIAS}],
                         ids=["greedy", "seeded"])
def test_graphed_head_passes_decode_as_plain_decoding(mtp_folder, options):
    folder = mtp_folder("qwen3_5_moe")
    options = {"max_tokens": 40, "ignore_eos": True, **options}
    plain = lucebox.LLM(folder, draft=None, **COMMON).generate(PROMPT, **options).token_ids
    llm = _graphed(folder, draft_k=4)
    graph = llm.proposer.graph
    assert graph.out is not None and (graph.cache.kv[0].positions == -1).all()  # captured, and emptied after
    got = llm.generate(PROMPT, **options)
    assert got.token_ids == plain and got.stats["drafter"] == "mtp"
    assert llm.proposer.graph is graph and graph.inputs[1] >= len(PROMPT)  # the request's drafts replayed it


def test_the_graphed_pass_drafts_as_the_eager_one(mtp_folder):
    """Beside an engine without graphs that ran the same request (the head's ring then holds the
    same rows: which rows beyond `draft_ctx` a pass still sees depends on the drafts before it).
    On Qwen3.5's dense head: the CPU's MoE reference reads its routing on the host, which the GPU's
    kernels do on the device."""
    folder = mtp_folder("qwen3_5")
    graphed = _graphed(folder, draft_k=4)
    eager = lucebox.LLM(folder, adaptive=False, draft_ctx=16, draft_k=4, **COMMON)
    eager.proposer.lookup = None
    options = dict(max_tokens=30, ignore_eos=True, logit_bias=BIAS)
    out = graphed.generate(PROMPT, **options)
    assert eager.generate(PROMPT, **options).token_ids == out.token_ids
    context = PROMPT + out.token_ids[:-1]
    with torch.inference_mode():
        (tokens, _, logits), (eager_tokens, _, eager_logits) = (
            llm.proposer._chain(context, 4, SamplingParams(), None) for llm in (graphed, eager))
    assert torch.stack(tokens).tolist() == torch.stack(eager_tokens).tolist()
    assert torch.allclose(torch.stack(logits), torch.stack(eager_logits), rtol=0, atol=1e-10)
    assert not torch.equal(logits[1], logits[2])  # the graph's logits were copied out, not kept by address
    graph = graphed.proposer.graph
    assert graph.inputs[1] == len(context) - 1 + 2  # the last pass: the row after the third draft's
    with no_host_sync():  # what a capture records waits for nothing
        graph.body()


def test_the_cache_the_graph_reads_is_emptied_in_place_and_replaced_only_when_dirty(mtp_folder):
    llm = _graphed(mtp_folder("qwen3_5_moe"), draft_k=4)
    proposer = llm.proposer
    cache, graph = proposer.cache, proposer.graph
    llm.generate(PROMPT, max_tokens=12, ignore_eos=True)
    assert proposer.resume(10)  # back into rows written: the head starts over at 10, on an emptied cache
    assert proposer.cache is cache and proposer.graph is graph and (cache.kv[0].positions == -1).all()
    llm.generate(PROMPT[:5], max_tokens=8, ignore_eos=True)
    assert proposer.cache is cache and proposer.graph is graph
    cache.kv[0].dirty = True  # a step cut short
    proposer.start(PROMPT, None)
    assert proposer.cache is not cache and proposer.graph is not graph and proposer.graph.cache is proposer.cache


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_replayed_head_pass_drafts_as_the_eager_one_on_cuda(mtp_folder):
    """Captured at start-up with the steps (one memory pool) and replayed: speculation stays plain
    decoding, and the drafts match an engine without graphs that ran the same request."""
    folder = mtp_folder("qwen3_5_moe")
    options = dict(device="cuda", dtype="float32", draft_ctx=16, adaptive=False, draft_k=4)
    request = dict(max_tokens=40, ignore_eos=True, logit_bias=BIAS)
    plain = lucebox.LLM(folder, draft=None, device="cuda", dtype="float32").generate(PROMPT, **request).token_ids
    graphed, eager = lucebox.LLM(folder, **options), lucebox.LLM(folder, cuda_graphs=False, **options)
    assert graphed.proposer.graph.graph is not None and graphed.proposer.graph.pool is graphed.engine.runner.pool
    assert eager.proposer.graph is None
    drafted = []
    for llm in (graphed, eager):
        llm.proposer.lookup = None
        out = llm.generate(PROMPT, **request)
        assert out.token_ids == plain
        with torch.inference_mode():
            drafted.append(llm.proposer._chain(PROMPT + out.token_ids[:-1], 4, SamplingParams(), None))
    assert torch.stack(drafted[0][0]).tolist() == torch.stack(drafted[1][0]).tolist()
    assert torch.allclose(torch.stack(drafted[0][2]), torch.stack(drafted[1][2]), rtol=1e-4, atol=1e-4)


def test_a_drafter_s_graph_captures_into_the_steps_pool_of_its_time(mtp_folder, monkeypatch):
    """The runner replaces its pool when it releases its graphs (a dropped session cache): a graph the
    drafter captures later (remade after a step cut short) goes into the new pool, not the released one."""
    import lucebox.graph_capture as graph_capture

    llm = lucebox.LLM(mtp_folder("qwen3_5"), **COMMON)
    runner, proposer = llm.engine.runner, llm.proposer
    pools = iter(["pool 1", "pool 2"])
    runner.pool = next(pools)
    proposer.graph_with(capture=True, pool=lambda: runner.pool)  # as `engine.build` hands it
    used = []

    class Replayed:
        def replay(self):
            pass

    def capture(body, device, pool):
        used.append(pool)
        return Replayed(), body()

    monkeypatch.setattr(graph_capture, "capture", capture)
    proposer.capture_graph(3)
    runner.pool = next(pools)  # `StepRunner.release`
    proposer.cache.kv[0].dirty = True  # a step cut short: the cache and its graph are remade
    proposer.start(PROMPT, None)
    proposer.capture_graph(3)
    assert used == ["pool 1", "pool 2"]
