"""Speculation on a hybrid (Gated DeltaNet + full attention) target is lossless, whoever drafts
(n-gram, a draft model, a DFlash drafter that `lucebox distill` trained through the recurrent
layers): a verify step keeps the recurrent state after each of its rows, a commit keeps the
accepted row's, and a rollback inside the last step is exact. Refused: draft models with
recurrent layers, draft trees."""

import json
import shutil

import pytest
import torch
from conftest import with_tokenizer
from draft_widths import vary_widths
from drafters import save_dflash
from tiny_models import VOCAB

import lucebox
from lucebox.caches import Step
from lucebox.caches.recurrent import RecurrentState
from lucebox.errors import CacheRewindError, SpeculationUnsupportedError

PROMPT = (torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(7)).tolist() * 3)[:30]
N = 24
COMMON = dict(device="cpu", dtype="float64", max_context=512, prefill_chunk=16, adaptive=False)


@pytest.fixture(scope="module")
def target(reference_models):
    return reference_models("qwen3_next")[0]


@pytest.fixture(scope="module")
def draft_model(reference_models, target):
    folder = reference_models("llama")[0]  # plain attention layers, the same vocabulary
    vocab = [json.loads((f / "config.json").read_text())["vocab_size"] for f in (folder, target)]
    assert vocab[0] == vocab[1]
    return folder


@pytest.fixture(scope="module")
def dflash(target, tmp_path_factory):
    """A DFlash drafter for the target made by `lucebox distill` (the command's whole path: the
    target's greedy continuations and features through its recurrent layers, a few steps; the
    target copied with a tokenizer, which distill reads text through)."""
    from lucebox.cli import main
    from lucebox.training.corpus import stdlib_root

    root = tmp_path_factory.mktemp("hybrid_dflash")
    text_target, drafter = with_tokenizer(target, root / "target"), root / "drafter"
    data = [str(stdlib_root() / name) for name in ("bisect.py", "colorsys.py")]
    assert main(["distill", str(text_target), "--out", str(drafter), "--data", *data,
                 "--eval-data", str(stdlib_root() / "heapq.py"), "--steps", "3", "--batch", "2", "--anchors", "4",
                 "--sequences", "4", "--prompt-tokens", "16", "--generated-tokens", "16", "--layers", "1",
                 "--attention-heads", "2", "--kv-heads", "1", "--head-dim", "8", "--intermediate-size", "32",
                 "--block-size", "4", "--mask-token-id", "0", "--target-layers", "0,2", "--eval-prompts", "1",
                 "--eval-tokens", "16"]) == 0
    return drafter


@pytest.fixture(scope="module")
def draft_for(request):
    """kind -> the `draft=` argument: "ngram", or the folder of the module's fixture of that name."""
    return lambda kind: "ngram" if kind == "ngram" else request.getfixturevalue(kind)


@pytest.fixture(scope="module")
def plain(target):
    return lucebox.LLM(target, draft=None, **COMMON).generate(PROMPT, max_tokens=N, ignore_eos=True).token_ids


def speculative(target, draft, **options):
    llm = lucebox.LLM(target, draft=draft, **COMMON)
    if hasattr(llm.proposer, "lookup"):  # DFlash: the block drafter alone (prompt lookup is the n-gram case)
        llm.proposer.lookup = None
    vary_widths(llm)
    return llm.generate(PROMPT, ignore_eos=True, **options)


def rejected_drafts(out) -> bool:
    return any(a < 1.0 for a in out.stats["acceptance_by_position"])


@pytest.mark.parametrize("kind", ["ngram", "draft_model", "dflash"])
def test_greedy_speculation_on_a_hybrid_equals_plain_decoding(target, draft_for, plain, kind):
    out = speculative(target, draft_for(kind), max_tokens=N)
    assert out.token_ids == plain
    assert out.stats["width_histogram"].get(0, 0) < out.stats["rounds"]  # drafts were really verified


@pytest.mark.parametrize("kind", ["ngram", "draft_model", "dflash"])
def test_coupled_sampling_on_a_hybrid_commits_what_plain_sampling_commits(target, draft_for, kind):
    options = dict(max_tokens=N, temperature=0.9, top_p=0.95, seed=11)
    plain = lucebox.LLM(target, draft=None, **COMMON).generate(PROMPT, ignore_eos=True, **options).token_ids
    out = speculative(target, draft_for(kind), **options)
    assert out.token_ids == plain and rejected_drafts(out)


@pytest.mark.parametrize("kind", ["draft_model", "dflash"])
def test_a_commit_keeps_the_accepted_rows_state_not_the_last(target, draft_for, plain, kind, monkeypatch):
    """A variant that returns to the last row's state after a rejection (what one state per layer,
    no slots, would do) decodes something else; the real slots decode plain's tokens."""
    drafter = draft_for(kind)
    out = speculative(target, drafter, max_tokens=N)
    assert out.token_ids == plain and rejected_drafts(out)
    rollback = RecurrentState.rollback

    def keep_the_last_rows_state(self, to_position):
        last = self.rows
        rollback(self, to_position)
        if to_position < last:  # one state per layer: the newest stays, whatever was accepted
            self._copy(last % self.ring, to_position % self.ring)

    monkeypatch.setattr(RecurrentState, "rollback", keep_the_last_rows_state)
    assert speculative(target, drafter, max_tokens=N).token_ids != plain


def test_dflash_follow_up_requests_on_a_hybrid_equal_plain_decoding(target, dflash):
    """A request that extends the last one keeps the target's state and the drafter's context
    ring (`Proposer.resume`); one that diverges prefills both from 0. Either way: plain's tokens."""
    llm = lucebox.LLM(target, draft=dflash, **COMMON)
    llm.proposer.lookup = None
    plain = lucebox.LLM(target, draft=None, **COMMON)
    first = llm.generate(PROMPT, max_tokens=8, ignore_eos=True).token_ids
    for prompt, reused in ((PROMPT + first + PROMPT[:5], True), (PROMPT[:10] + PROMPT[20:], False)):
        out = llm.generate(prompt, max_tokens=N, ignore_eos=True)
        assert out.token_ids == plain.generate(prompt, max_tokens=N, ignore_eos=True).token_ids
        assert (out.stats["cached_prompt_tokens"] > 0) == reused


def test_rollback_inside_the_last_step_then_decoding_equals_a_fresh_cache(target):
    llm = lucebox.LLM(target, draft=None, **COMMON)
    decoder, device, ids = llm.engine.decoder, llm.device, torch.tensor(PROMPT)

    def prefilled(n):
        cache = llm.engine.new_cache()
        decoder.forward(ids[:n], Step.span(0, n, device, prefill=True), cache)
        cache.commit(n)
        return cache

    for back_to in (8, 10, 13):  # the step's start, inside it, its end
        cache = prefilled(8)
        decoder.forward(ids[8:13], Step.span(8, 5, device), cache)  # a verify step of 5 rows
        state = cache.layers[0]  # a recurrent layer: it kept the state after each of the step's rows
        assert state.can_rewind_to(back_to) and not state.can_rewind_to(7)
        cache.commit(back_to)
        cache.rollback(back_to)
        got = decoder.logits(decoder.forward(ids[back_to:20], Step.span(back_to, 20 - back_to, device), cache))
        fresh = prefilled(back_to)
        expected = decoder.logits(decoder.forward(ids[back_to:20], Step.span(back_to, 20 - back_to, device), fresh))
        assert (got - expected).abs().max().item() < 1e-10
        with pytest.raises(CacheRewindError, match="recurrent"):  # a position whose state was never kept
            cache.rollback(5)


def test_recurrent_draft_models_and_draft_trees_are_refused_on_a_hybrid(target, tmp_path):
    """DFlash drafters run on a hybrid as chains (the default there); a tree asked for is refused
    by name, as is a draft model with recurrent layers."""
    folder = tmp_path / "model"
    shutil.copytree(target, folder)
    shutil.copytree(target, folder / "draft")  # a draft model with recurrent layers, found by draft="auto"
    with pytest.raises(SpeculationUnsupportedError, match="draft model with recurrent.*draft='auto' found"):
        lucebox.LLM(folder, device="cpu", dtype="float64")
    hf = json.loads((target / "config.json").read_text())
    dflash = save_dflash(tmp_path / "dflash", hf, "zlab", target_layer_ids=(0, 2))
    with pytest.raises(SpeculationUnsupportedError, match="tree_budget=4: draft trees .* recurrent"):
        lucebox.LLM(target, device="cpu", dtype="float64", draft=dflash, tree_budget=4)
    assert lucebox.LLM(target, device="cpu", dtype="float64", draft=dflash).setup.tree_budget == 0
    assert lucebox.LLM(target, device="cpu", dtype="float64", draft=dflash, tree_budget=0).setup.tree_budget == 0
