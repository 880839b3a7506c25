"""Requests running at once share each step's forward (`engine.batcher`) and each gets exactly what
it gets alone: greedy token for token, seeded sampling the same tokens, whoever drafts (none,
n-gram, the built-in DFlash drafter's chains and trees, a draft model), on a hybrid model too, under
a JSON-schema constraint; with more requests than slots (those beyond run in caches of their own),
joining and leaving at different times. A sequence's rows in a forward never see its neighbours'."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch
from tiny_models import VOCAB

import lucebox
from lucebox.caches import Step
from lucebox.engine.batcher import Work
from lucebox.engine.runner import StepRunner
from lucebox.limits import DECODE_ROWS

CODE = ["def fib(n):", "class Stack:\n    def push(self, x):", "import os\nimport", "# sort a list\ndef sort(",
        "for i in range(10):\n", "while True:\n    x =", "def add(a, b):\n    return", "x = [1, 2, 3]\ny ="]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["name", "n"]}


def at_once(llm, prompts: list, options: list[dict]) -> list[list[int]]:
    """Each prompt's tokens, all streamed at once from threads of their own, the i-th joining once
    the one before it has its first chunk (so requests join a running batch and leave it as their
    lengths run out)."""
    results, errors = [None] * len(prompts), []
    started = [threading.Event() for _ in prompts]

    def run(i):
        try:
            ids = []
            for chunk in llm.stream(prompts[i], **options[i]):
                ids += chunk.token_ids
                started[i].set()
            results[i] = ids
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            started[i].set()

    threads = []
    for i in range(len(prompts)):
        threads.append(threading.Thread(target=run, args=(i,)))
        threads[-1].start()
        started[i].wait(60)
    for t in threads:
        t.join(120)
    assert not errors, errors
    return results


def alone(llm, prompts: list, options: list[dict]) -> list[list[int]]:
    return [llm.generate(p, **o).token_ids for p, o in zip(prompts, options, strict=True)]


def lengths(n: int, **common) -> list[dict]:
    """Each request its own length: they leave the batch one by one."""
    return [dict(max_tokens=10 + 5 * (i % 5), ignore_eos=True, **common) for i in range(n)]


@pytest.mark.parametrize("options", [
    dict(draft=None),
    dict(draft="ngram"),
    dict(draft="auto"),  # the built-in DFlash drafter's trees
    # its chains: priced widths, drafts past a request's share, cut by the batch
    dict(draft="auto", tree_budget=0),
], ids=["plain", "ngram", "dflash-trees", "dflash-chains"])
def test_eight_requests_at_once_on_four_slots_each_get_their_tokens_alone(options):
    llm = lucebox.LLM(dtype="float32", parallel=4, **options)
    greedy = lengths(8)
    expected = alone(llm, CODE, greedy)
    forwards = llm.engine.batcher.forwards
    assert at_once(llm, CODE, greedy) == expected
    assert llm.engine.batcher.forwards > forwards  # the steps really shared forwards
    if options.get("tree_budget") == 0:
        assert llm.engine.batcher.drafts_cut > 0  # drafts past the shares were cut by their chances
    if options["draft"] == "auto":  # seeded sampling: the same tokens (`verify="coupled"`)
        sampled = lengths(8, temperature=0.8, seed=11)
        assert at_once(llm, CODE, sampled) == alone(llm, CODE, sampled)


@pytest.mark.parametrize("tree_budget", [0, None], ids=["chains", "trees"])
def test_where_steps_run_as_graphs_a_batch_runs_each_sequence_through_the_graph_body(tree_budget):
    """A GPU's path on the CPU (`StepRunner(capture=False)`: the graphed step's body, eagerly): the
    first slot's steps alone replay its graph body, a batch's sequences attend through the same
    body (`runner.step_context`), chains and trees."""
    llm = lucebox.LLM(dtype="float32", parallel=3, tree_budget=tree_budget)
    llm.engine.runner = StepRunner(llm.engine.decoder, graphs=True, capture=False)
    greedy = lengths(5)
    expected = alone(llm, CODE[:5], greedy)
    assert llm.engine.runner.widths  # the first slot's steps ran through the graph body
    assert at_once(llm, CODE[:5], greedy) == expected


def test_requests_at_once_under_a_json_schema_each_get_their_object_alone():
    llm = lucebox.LLM(parallel=3)
    prompts = [f"// record {i}\n" for i in range(3)]
    options = [dict(max_tokens=24 + 8 * i, json_schema=SCHEMA) for i in range(3)]
    assert at_once(llm, prompts, options) == alone(llm, prompts, options)


@pytest.fixture(scope="module")
def hybrid(reference_models):
    return reference_models("qwen3_next")[0]


@pytest.mark.parametrize("draft", [None, "draft_model"])
def test_a_hybrid_models_requests_at_once_each_keep_their_own_recurrent_state(hybrid, reference_models, draft):
    draft = reference_models("llama")[0] if draft == "draft_model" else draft
    llm = lucebox.LLM(hybrid, draft=draft, device="cpu", dtype="float64", max_context=256, prefill_chunk=16,
                      adaptive=False, parallel=3)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB, (9 + 4 * i,), generator=g).tolist() * 2 for i in range(5)]
    options = lengths(5)
    assert at_once(llm, prompts, options) == alone(llm, prompts, options)


def test_a_conversation_back_after_others_finds_its_rows_in_its_slot():
    llm = lucebox.LLM(parallel=4)
    first = [f"def helper_{i}(x):\n    " + "y = x * 2\n    " * 12 for i in range(4)]
    for prompt in first:  # one after another: each takes the slot used least recently
        llm.generate(prompt, max_tokens=4)
    back = first[0] + "return y\n"
    again = llm.generate(back, max_tokens=8, ignore_eos=True)
    assert again.stats["cached_prompt_tokens"] >= len(llm.tokenizer.encode(first[0])) - 1
    assert again.token_ids == lucebox.LLM(parallel=1).generate(back, max_tokens=8, ignore_eos=True).token_ids
    llm.generate(first[1] + "return y\n", max_tokens=2)  # the slot of the second one is there too
    assert llm.session.last_stats["cached_prompt_tokens"] > 0


def _forward(llm, prompts: list[list[int]], rows: list[list[int]]):
    """One forward of each prompt's cache's next `rows`, side by side: each sequence's logits."""
    engine = llm.engine
    works = []
    for prompt, mine in zip(prompts, rows, strict=True):
        cache = engine.new_cache()
        for _ in engine.prefill(prompt, cache):
            pass
        works.append(Work(mine, Step.span(len(prompt), len(mine), llm.device), cache))
    return [out.logits.clone() for out in engine.batcher._steps(works)]


@torch.inference_mode()
def test_a_sequences_logits_do_not_depend_on_what_its_neighbours_hold():
    """The first sequence's rows beside two others, then beside two others of other tokens and
    contexts but the same row counts: the same bits (attention and recurrent state per sequence;
    every other op a row at a time). A forward that let a row see another sequence fails here."""
    llm = lucebox.LLM(dtype="float32", draft=None)
    g = torch.Generator().manual_seed(3)

    def ids(n):
        return torch.randint(0, llm.config.vocab_size, (n,), generator=g).tolist()

    mine, rows = ids(37), ids(3)
    first = _forward(llm, [mine, ids(20), ids(50)], [rows, ids(2), ids(4)])
    second = _forward(llm, [mine, ids(45), ids(9)], [rows, ids(2), ids(4)])
    assert torch.equal(first[0], second[0])
    alone = _forward(llm, [mine], [rows])[0]
    torch.testing.assert_close(first[0], alone, rtol=1e-4, atol=1e-4)  # other row counts: other rounding only


def test_the_memory_plan_counts_every_slots_caches_and_serve_opens_the_slots_that_fit(monkeypatch, capsys):
    from lucebox.cli import build_parser
    from lucebox.engine.config import EngineConfig
    from lucebox.engine.setup import plan_engine
    from lucebox.engine_flags import in_flag_terms
    from lucebox.errors import InsufficientMemoryError, InvalidArgumentError
    from lucebox.server import command

    one, four = (plan_engine(EngineConfig(parallel=n)).memory for n in (1, 4))
    for part in ("ring_caches", "kv_pool_device", "kv_host_max", "kv_chunk_summaries_max"):
        assert four[part] == 4 * one[part]
    assert four["weights"] == one["weights"] and one["drafter"] < four["drafter"] < 4 * one["drafter"]  # weights shared

    def plan(config):  # 4 slots fit only with a smaller pool (as --vram would choose), 3 not at all
        if config.parallel == 3:
            raise InsufficientMemoryError("3 slots do not fit")
        return SimpleNamespace(prefill_chunk=512, cache=SimpleNamespace(kv_pool_tokens=1024 if config.parallel == 4
                                                                        else 4096), expert_slots=None)

    monkeypatch.setattr("lucebox.engine.setup.plan_engine", plan)
    monkeypatch.setattr(command, "open_engine", lambda args, parallel: parallel)
    assert command.open_serving_engine(build_parser().parse_args(["serve"])) == 2
    assert "do not fit; serving 2 at once" in capsys.readouterr().err
    assert command.open_serving_engine(build_parser().parse_args(["serve", "--parallel", "4"])) == 4  # as asked
    with pytest.raises(InvalidArgumentError, match="parallel must be in 1..64, got 0"):
        EngineConfig(parallel=0)
    assert in_flag_terms("parallel must be in 1..64, got 0") == "--parallel must be in 1..64, got 0"


@torch.inference_mode()
def test_a_forward_of_several_that_fails_fails_only_the_request_whose_cache_refused(monkeypatch):
    """Each step runs again alone: the one whose cache refuses gets its own error, the others their
    results; an interrupt in the turn's thread is its own, the others fail plainly, and the next
    turn runs."""
    llm = lucebox.LLM(dtype="float32", draft=None)
    engine, batcher = llm.engine, llm.engine.batcher
    works = []
    for n in (12, 20):
        cache = engine.new_cache()
        for _ in engine.prefill(list(range(1, n + 1)), cache):
            pass
        works.append(Work([5], Step.span(n, 1, llm.device), cache))
    refusing = works[1].cache.kv[0]

    def refuse(*args, **kwargs):
        raise ValueError("this cache refuses")

    monkeypatch.setattr(refusing, "write", refuse)
    batcher._settle(works, batcher._steps)
    assert works[0].error is None and works[0].result.logits.shape[0] == 1
    assert isinstance(works[1].error, ValueError)
    monkeypatch.undo()

    def interrupted(works_):
        raise KeyboardInterrupt

    others = [Work([5], w.step, w.cache) for w in works]
    others[0].thread = None  # asked by another thread
    with pytest.raises(KeyboardInterrupt):
        batcher._settle(others, interrupted)
    assert isinstance(others[0].error, RuntimeError) and all(w.done for w in others)
    assert batcher.step([5], Step.span(12, 1, llm.device), works[0].cache).logits.shape[0] == 1


def test_a_batched_request_drafts_at_most_its_share_of_a_forwards_rows(monkeypatch):
    """Each working request's round verifies at most its share of `row_budget` rows of copied text
    (16 rows among 4 requests, 4 each, 3 drafts), so the steps of all of them fit one forward; the
    drafter's own drafts may go past it with their chances of being kept, for the batch to cut
    (the test above)."""
    llm = lucebox.LLM(dtype="float32", adaptive=False, tree_budget=0)
    batcher = llm.engine.batcher
    assert batcher.row_share() == DECODE_ROWS
    batcher._working = 4
    assert batcher.row_share() == DECODE_ROWS // 4
    batcher._working = 0
    prompt = "def f(x):\n    return x + 1\n" * 6  # copies of earlier text: long drafts when allowed

    def widest() -> int:
        return max(llm.generate(prompt, max_tokens=40, ignore_eos=True).stats["width_histogram"])

    assert widest() > 3
    monkeypatch.setattr(batcher, "row_share", lambda: 4)
    assert widest() <= 3
    # Where the tokens depend on the widths (sampled, verified tokenwise), no share caps them.
    tokenwise = lucebox.LLM(dtype="float32", adaptive=False, tree_budget=0, verify="tokenwise")
    monkeypatch.setattr(tokenwise.engine.batcher, "row_share", lambda: 4)
    sampled = tokenwise.generate(prompt, max_tokens=40, ignore_eos=True, temperature=0.8, seed=3)
    assert max(sampled.stats["width_histogram"]) > 3


def test_a_batched_step_keeps_the_drafts_likeliest_to_be_kept_whoever_drafted_them():
    """`engine.turn_rows.allot`: in each forward, steps asking for more rows than it takes keep
    their first row and the drafts with the best chances of being kept (a prefix of each one's),
    the sure request's deep drafts before the unsure one's first; steps without chances keep every
    row; a forward the others fill leaves the chains a forward of their own; with step costs, only
    the drafts that raise the forward's expected tokens per second stay."""
    from lucebox.engine.turn_rows import allot

    cpu = torch.device("cpu")

    def work(drafts: int, reach=None, layers=()):
        return Work(list(range(1 + drafts)), Step.span(10, 1 + drafts, cpu), None, layers, reach=reach)

    def rows(groups):
        return [[len(w.rows) for w in group] for group in groups]

    sure = work(9, [0.95 ** (i + 1) for i in range(9)])
    unsure = work(9, [0.3 ** (i + 1) for i in range(9)])
    copy = work(3)  # a copy's drafts: its share, never cut
    other_layers = work(9, [0.1] * 9, layers=(1,))  # another forward: its own rows
    groups, cut = allot([sure, unsure, copy, other_layers], 16, cpu, None)
    assert cut == 8 and rows(groups) == [[10, 2, 4], [10]]
    assert sure.step.count == 10 and sure.step.start == 10 and unsure.rows == [0, 1] and unsure.reach == [0.3]
    fits = [work(5, [0.5] * 5), work(5, [0.1] * 5)]
    assert allot(fits, 16, cpu, None) == ([fits], 0) and rows([fits]) == [[6, 6]]
    beside_a_wide_step = [work(10), work(9, [0.9] * 9)]
    assert rows(allot(beside_a_wide_step, 16, cpu, None)[0]) == [[11, 5]]
    crowded = [work(4, [0.9] * 4) for _ in range(3)] + [work(15)]  # the wide step runs in a forward of its own
    groups, cut = allot(crowded, 16, cpu, None)
    assert cut == 0 and rows(groups) == [[5, 5, 5], [16]]
    # A forward costs 1 + 0.1 s a row: two steps' first rows make 2 tokens in 1.2 s; the drafts kept
    # at 0.9 and 0.8 raise that to 3.7 tokens in 1.4 s, the next (0.2) would lower it.
    priced = [work(3, [0.9, 0.8, 0.1]), work(2, [0.2, 0.05])]
    groups, cut = allot(priced, 16, cpu, lambda rows: 1.0 + 0.1 * rows)
    assert cut == 3 and rows(groups) == [[3, 1]]


def test_a_turn_waits_for_a_request_that_is_opening_and_takes_its_first_chunk_too(monkeypatch):
    """Opening a slot counts as working (only a drafter's prefill of the prompt goes aside): a
    request asking for its prefill while another is opening waits for it, so requests arriving
    together prefill in one turn instead of one after the other."""
    from lucebox.engine.session import Session

    llm = lucebox.LLM(dtype="float32", parallel=2, draft=None)
    opening, release = threading.Event(), threading.Event()
    open_slot = Session.open

    def slow_open(self, prompt_ids, speculate=True):
        if threading.current_thread().name == "slow":
            opening.set()
            release.wait(30)
        return open_slot(self, prompt_ids, speculate)

    monkeypatch.setattr(Session, "open", slow_open)
    first: dict[str, float] = {}

    def run(prompt: str) -> None:
        for _ in llm.stream(prompt, max_tokens=2, ignore_eos=True):
            first.setdefault(threading.current_thread().name, time.monotonic())

    slow = threading.Thread(target=run, args=(CODE[0],), name="slow")
    slow.start()
    assert opening.wait(30)
    fast = threading.Thread(target=run, args=(CODE[1],), name="fast")
    fast.start()
    time.sleep(0.3)
    released = time.monotonic()
    release.set()
    slow.join(60)
    fast.join(60)
    assert first["fast"] > released and first["slow"] > released  # the fast one's prefill waited


def test_a_batched_steps_output_says_how_long_it_waited_for_its_forward(monkeypatch):
    """The time a step waited for its forward (the others drafting, their forwards) is others':
    its output carries it (`StepOutput.waited_s`), and the round's cost measurement leaves it out."""
    from lucebox.engine.batcher import StepBatcher
    from lucebox.engine.runner import StepOutput
    from lucebox.speculative.width import WidthPolicy

    llm = lucebox.LLM(dtype="float32", tree_budget=0)
    batcher = llm.engine.batcher
    work = Work([1], Step.span(0, 1, torch.device("cpu")), None)
    work.asked_at -= 2.0  # asked two seconds ago
    out = StepOutput(torch.zeros(1, 4), torch.zeros(1, dtype=torch.long), None)
    batcher._settle([work], lambda works: [out])
    assert work.done and work.result is out and 2.0 <= out.waited_s < 60

    settle = StepBatcher._settle

    def waited_ten_seconds(self, works, run):
        settle(self, works, run)
        for w in works:
            if isinstance(w.result, StepOutput):
                w.result.waited_s = 10.0

    recorded = []
    record = WidthPolicy.record
    monkeypatch.setattr(StepBatcher, "_settle", waited_ten_seconds)
    monkeypatch.setattr(WidthPolicy, "record", lambda self, rows, seconds, drafting, drafts=1: (
        recorded.append(seconds), record(self, rows, seconds, drafting, drafts)))
    llm.generate("def f(x):\n", max_tokens=8, ignore_eos=True)
    assert recorded and all(seconds == 0.0 for seconds in recorded)  # every step's ten seconds left out
