"""Speculative decoding through the real engine: lossless for every proposer and cache policy."""

import json
import shutil

import pytest
import torch
from draft_widths import vary_widths
from drafters import save_dflash
from tiny_models import VOCAB

import lucebox
from lucebox.errors import CheckpointError, DraftModelError, InvalidArgumentError

# Repetitive enough for the n-gram drafter to find matches; long enough to cross many windows.
PROMPT = (torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(5)).tolist() * 4)[:70]
N = 512
COMMON = dict(device="cpu", dtype="float64", max_context=1024, prefill_chunk=64)
POOLS = {"exact": 256, "select": 512}  # both smaller than prompt + 512 generated tokens


@pytest.fixture(scope="module")
def drafters(laguna, reference_models, tmp_path_factory):
    target_cfg = json.loads((laguna / "config.json").read_text())
    root = tmp_path_factory.mktemp("drafters")
    return {
        "ngram": "ngram",
        "draft_model": reference_models("llama")[0],  # another model, same vocabulary: disagrees often
        "self_draft": laguna,  # the target as its own drafter: agrees always
        "dflash_zlab": save_dflash(root / "zlab", target_cfg, "zlab"),
        "dflash_laguna": save_dflash(root / "laguna", target_cfg, "laguna"),
    }


@pytest.fixture(scope="module")
def plain(laguna):
    return {policy: lucebox.LLM(laguna, kv_policy=policy, kv_pool_tokens=pool, **COMMON)
            .generate(PROMPT, max_tokens=N, ignore_eos=True).token_ids for policy, pool in POOLS.items()}


@pytest.mark.parametrize("policy", sorted(POOLS))
@pytest.mark.parametrize("proposer", ["ngram", "draft_model", "self_draft", "dflash_zlab", "dflash_laguna"])
def test_greedy_speculation_equals_plain_decoding(laguna, drafters, plain, proposer, policy):
    llm = lucebox.LLM(laguna, draft=drafters[proposer], kv_policy=policy, kv_pool_tokens=POOLS[policy],
                      adaptive=False, tree_budget=0, **COMMON)
    if proposer.startswith("dflash"):
        llm.proposer.lookup = None  # the drafter's own drafts (lookup drafts: test_prompt_lookup_...)
    vary_widths(llm)
    out = llm.generate(PROMPT, max_tokens=N, ignore_eos=True)
    assert out.token_ids == plain[policy]
    stats = out.stats
    assert stats["rounds"] < N or proposer in ("draft_model", "dflash_zlab", "dflash_laguna")
    assert sum(stats["accepted_histogram"].values()) == stats["rounds"]
    assert stats["width_histogram"].get(0, 0) < stats["rounds"]  # drafts were really verified
    assert max(stats["accepted_histogram"]) > 0  # and some were kept
    if proposer == "self_draft" and policy == "exact":  # the target drafting for itself: every draft is kept
        assert stats["acceptance_by_position"] and all(a == 1.0 for a in stats["acceptance_by_position"])
    assert len([k for k in stats["width_histogram"] if k > 0]) >= 3  # the width changed from round to round


def test_adaptive_width_stays_lossless(laguna, drafters, plain):
    llm = lucebox.LLM(laguna, draft=drafters["self_draft"], kv_policy="exact", kv_pool_tokens=256, **COMMON)
    out = llm.generate(PROMPT, max_tokens=N, ignore_eos=True)
    assert out.token_ids == plain["exact"]
    assert out.stats["rounds"] < N


def test_memory_reports_the_drafter(laguna, drafters):
    for name in ("draft_model", "dflash_laguna"):
        llm = lucebox.LLM(laguna, draft=drafters[name], **COMMON)
        llm.generate(PROMPT, max_tokens=4, ignore_eos=True)
        assert llm.memory()["drafter"] > 0
    assert lucebox.LLM(laguna, draft="ngram", **COMMON).memory()["drafter"] == 0


def test_speculative_stats_are_reported(laguna):
    out = lucebox.LLM(laguna, draft="ngram", **COMMON).generate(PROMPT, max_tokens=40, ignore_eos=True)
    s = out.stats
    for key in ("acceptance_length", "acceptance_by_position", "draft_time_s", "verify_time_s", "rounds"):
        assert key in s
    assert s["acceptance_length"] == pytest.approx(39 / s["rounds"])  # the first token comes from the prefill
    assert all(0 <= a <= 1 for a in s["acceptance_by_position"])


@pytest.mark.parametrize("proposer", ["ngram", "draft_model", "self_draft", "dflash_laguna"])
def test_coupled_sampling_commits_what_plain_sampling_commits(laguna, drafters, proposer):
    """The default "coupled" rule: target and drafter race against one noise keyed by seed and
    position, so a seeded speculative run commits plain sampled decoding's very tokens, whatever
    the widths (cut at random here) and drafts; the target drafting for itself keeps every draft."""
    options = dict(max_tokens=96, temperature=0.9, top_p=0.95, top_k=40, seed=11, ignore_eos=True)
    if proposer != "self_draft":  # the verifier's alone: a drafter that ignores it still agrees often
        options["repetition_penalty"] = 1.2
    plain = lucebox.LLM(laguna, draft=None, **COMMON).generate(PROMPT, **options).token_ids
    llm = lucebox.LLM(laguna, draft=drafters[proposer], adaptive=False, **COMMON)  # drafts whatever the clock says
    vary_widths(llm)
    out = llm.generate(PROMPT, **options)
    assert out.token_ids == plain
    assert out.stats["width_histogram"].get(0, 0) < out.stats["rounds"]  # drafts were really verified
    if proposer == "self_draft":
        assert all(a == 1.0 for a in out.stats["acceptance_by_position"])


@pytest.mark.parametrize("rule", ["tokenwise", "block"])
def test_seeded_speculative_sampling_repeats(laguna, drafters, rule):
    llm = lucebox.LLM(laguna, draft=drafters["draft_model"], verify=rule, **COMMON)
    runs = [llm.generate(PROMPT, max_tokens=24, temperature=0.9, top_p=0.95, seed=s, ignore_eos=True).token_ids
            for s in (3, 3, 4)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_stop_inside_a_round_ends_at_that_token(laguna, plain):
    llm = lucebox.LLM(laguna, draft="ngram", kv_policy="exact", kv_pool_tokens=256, **COMMON)
    stop = plain["exact"][30]
    out = llm.generate(PROMPT, max_tokens=N, stop=[stop], ignore_eos=True)
    assert out.token_ids == plain["exact"][: plain["exact"].index(stop) + 1]
    again = llm.generate(PROMPT + out.token_ids, max_tokens=5, ignore_eos=True)  # the cache holds exactly those
    fresh = lucebox.LLM(laguna, kv_policy="exact", kv_pool_tokens=256, **COMMON)
    assert again.token_ids == fresh.generate(PROMPT + out.token_ids, max_tokens=5, ignore_eos=True).token_ids


def test_nothing_past_a_stop_is_ever_committed(laguna, plain, monkeypatch):
    """A round's new tokens go through the text stage before the cache commits them, so a stop
    inside a round commits the rows up to it and no further (none are committed and rolled back)."""
    from lucebox.caches import SequenceCache

    # The target drafting for itself: every draft is kept, so a stop lands inside a round's drafts.
    llm = lucebox.LLM(laguna, draft=laguna, adaptive=False, kv_policy="exact", kv_pool_tokens=256, **COMMON)
    lengths = []  # what the target's cache commits (the draft model's own cache commits its drafts)
    commit = SequenceCache.commit

    def watched(cache, length, **options):  # options: a prefill chunk's `choose`
        if cache is llm.session.cache:
            lengths.append(length)
        commit(cache, length, **options)

    monkeypatch.setattr(SequenceCache, "commit", watched)
    reference = plain["exact"]
    for position in (20, 30, 40, 50):  # stops at different places of the rounds
        stop = reference[position]
        lengths.clear()
        out = llm.generate(PROMPT, max_tokens=N, stop=[stop], ignore_eos=True)
        assert out.token_ids == reference[: reference.index(stop) + 1]
        assert max(lengths) == len(PROMPT) + len(out.token_ids) - 1  # the stop token itself is never forwarded


def drafter_variant(folder, tmp_path, change_config=None, change_tensors=None):
    from safetensors.torch import load_file, save_file

    dest = tmp_path / "bad"
    shutil.copytree(folder, dest)
    if change_config:
        cfg = json.loads((dest / "config.json").read_text())
        change_config(cfg)
        (dest / "config.json").write_text(json.dumps(cfg))
    if change_tensors:
        t = load_file(dest / "model.safetensors")
        change_tensors(t)
        save_file(t, dest / "model.safetensors")
    return dest


@pytest.mark.parametrize("layout", ["dflash_zlab", "dflash_laguna"])
@pytest.mark.parametrize("damage, error, message", [
    ({"config": lambda c: c["dflash_config"].pop("target_layer_ids")}, DraftModelError, "target_layer_ids"),
    ({"config": lambda c: c.update(vocab_size=99)}, DraftModelError, "vocabulary 99"),
    ({"config": lambda c: c["dflash_config"].update(target_layer_ids=[0, 9])}, DraftModelError, r"\[9\]"),
    ({"tensors": lambda t: t.update({"fc.weight": torch.zeros(64, 65)})}, CheckpointError, "fc.weight"),
    # the values a drafter's config computes with are held to the target's checks first: these were
    # a ZeroDivisionError, a list repeated head-size times, and a KeyError
    ({"config": lambda c: c.update(num_attention_heads=0, head_dim=None)}, DraftModelError,
     "drafter config.json: num_attention_heads must be in 1..4096, got 0"),
    ({"config": lambda c: c.update(partial_rotary_factor=[0.5] * 100_000)}, DraftModelError,
     "drafter config.json: partial_rotary_factor has the wrong type"),
    ({"config": lambda c: c.pop("hidden_size")}, DraftModelError, "drafter config.json has no 'hidden_size'"),
])
def test_malformed_drafters_are_refused(laguna, drafters, tmp_path, layout, damage, error, message):
    bad = drafter_variant(drafters[layout], tmp_path, damage.get("config"), damage.get("tensors"))
    with pytest.raises(error, match=message):
        lucebox.LLM(laguna, draft=bad, **COMMON)


def test_draft_model_with_another_vocabulary_is_refused(laguna, reference_models, tmp_path):
    bad = drafter_variant(reference_models("llama")[0], tmp_path, lambda c: c.update(vocab_size=64))
    with pytest.raises(DraftModelError, match="vocabulary"):
        lucebox.LLM(laguna, draft=bad, **COMMON)


def test_auto_draft_uses_a_paired_drafter_or_none(laguna, drafters, tmp_path):
    assert lucebox.LLM(laguna, draft="auto", **COMMON).proposer is None
    model = tmp_path / "model"
    shutil.copytree(laguna, model)
    shutil.copytree(drafters["dflash_zlab"], model / "dflash")
    assert lucebox.LLM(model, draft="auto", **COMMON).proposer is not None


def test_bad_speculation_arguments(laguna):
    with pytest.raises(InvalidArgumentError, match="verify"):
        lucebox.LLM(laguna, draft="ngram", verify="magic", **COMMON)
    with pytest.raises(InvalidArgumentError, match="draft_k"):
        lucebox.LLM(laguna, draft="ngram", draft_k=40, **COMMON)


def test_ngram_copies_what_followed_the_latest_match():
    from lucebox.sampling import SamplingParams
    from lucebox.speculative.ngram import NgramProposer

    p = NgramProposer()
    p.start([5, 1, 2, 3, 9, 1, 2, 3, 7], None)
    assert p.propose([5, 1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2, SamplingParams(), None).tokens == [7, 1]
    p.start([4, 8], None)
    # A match right before the end continues the repeating pattern past the context's end.
    assert p.propose([4, 8, 4, 8], 5, SamplingParams(), None).tokens == [4, 8, 4, 8, 4]
    assert p.propose([4, 8, 6], 3, SamplingParams(), None).tokens == []


def test_next_request_after_a_stop_inside_a_round_matches_a_fresh_engine(reference_models):
    """Rejected drafts wrote ring rows past the committed length; reusing the cache for a prompt
    that rewinds must not read rows those writes overwrote."""
    folder, _ = reference_models("mistral")  # every layer a sliding ring
    kwargs = dict(device="cpu", dtype="float64", prefill_chunk=16)
    plain = lucebox.LLM(folder, **kwargs)
    fresh = lucebox.LLM(folder, **kwargs)
    mismatches = []
    for seed in range(6):
        prompt = (torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(seed)).tolist() * 4)
        reference = plain.generate(prompt, max_tokens=40, ignore_eos=True).token_ids
        llm = lucebox.LLM(folder, draft="ngram", adaptive=False, **kwargs)
        stop = reference[12]
        first = llm.generate(prompt, max_tokens=40, stop=[stop], ignore_eos=True).token_ids
        held = prompt + first
        for back in (3, 8, 14, 16):
            follow = held[: len(held) - back] + [7]
            got = llm.generate(follow, max_tokens=12, ignore_eos=True).token_ids
            if got != fresh.generate(follow, max_tokens=12, ignore_eos=True).token_ids:
                mismatches.append((seed, back))
            llm.generate(held, max_tokens=1, ignore_eos=True)  # put the held tokens back for the next rewind
    assert mismatches == []


def test_lazy_drafter_context_rows_draft_as_eager_ones(laguna, drafters, monkeypatch):
    """DFlash context rows are written when drafting resumes, in one batch: the drafts (with their
    confidences) equal those of a drafter writing its rows at every commit, across plain stretches
    longer than a ring step, and in a next request that reuses a prefix ending among waiting rows."""
    from lucebox.caches import Step
    from lucebox.speculative.dflash import DFlashProposer
    from lucebox.speculative.width import WidthPolicy

    def drafts(eager: bool) -> list:
        rounds = iter(range(10**6))
        monkeypatch.setattr(WidthPolicy, "should_draft", lambda self, limit: next(rounds) % 80 in (0, 1))
        llm = lucebox.LLM(laguna, draft=drafters["dflash_zlab"], adaptive=False, tree_budget=0, **COMMON)
        llm.proposer.lookup = None  # every draft from the drafter's rings
        seen, propose = [], llm.proposer.propose

        def record(context, k, params, generator):
            draft = propose(context, k, params, generator)
            seen.append((len(context), draft.tokens, draft.confidence))
            return draft

        def commit_now(self, committed, new, features):  # every commit's rows written at once, by position
            start = len(committed) - new
            self.drafter.context_rows(features[:new], Step.span(start, new, self.drafter.device), self.rings)
            self.length = len(committed)

        llm.proposer.propose = record
        if eager:
            monkeypatch.setattr(DFlashProposer, "commit", commit_now)
        out = llm.generate(PROMPT, max_tokens=400, ignore_eos=True)
        # The next request reuses the prefix, cut among the rows still waiting (the last rounds were plain).
        llm.generate(PROMPT + out.token_ids[:390], max_tokens=60, ignore_eos=True)
        monkeypatch.undo()
        return seen

    lazy, eager = drafts(False), drafts(True)
    assert len(lazy) >= 8 and [d[:2] for d in lazy] == [d[:2] for d in eager]
    for (_, _, a), (_, _, b) in zip(lazy, eager, strict=True):
        assert a == pytest.approx(b, abs=1e-9)


def test_prompt_lookup_before_the_drafter_stays_lossless(laguna, drafters, plain):
    """A DFlash proposer copies repeated text (prompt lookup) before drafting: longer drafts than
    its block, in chain and tree rounds, and the output stays plain decoding's."""
    for budget in (0, 15):
        llm = lucebox.LLM(laguna, draft=drafters["dflash_zlab"], kv_policy="exact", kv_pool_tokens=256,
                          adaptive=False, tree_budget=budget, **COMMON)
        out = llm.generate(PROMPT, max_tokens=N, ignore_eos=True)
        assert out.token_ids == plain["exact"]
        block = llm.proposer.block_width
        assert max(out.stats["width_histogram"]) > block  # lookup drafts, longer than a drafter block
        assert out.stats["acceptance_length"] > 2


def test_copied_drafts_are_judged_apart_from_the_drafter(laguna, drafters, plain, monkeypatch):
    """Prompt-lookup drafts go to a judge of their own: the drafter's keep rates stay its own, and the
    copies' (here repeating greedy text, kept) let whole copies be verified."""
    from lucebox.speculative.keep_model import DraftJudge

    judged = []  # (the judge's keep model, the block) of every block handed to a judge
    drafted = DraftJudge.drafted
    monkeypatch.setattr(DraftJudge, "drafted", lambda self, tokens, confidence: (
        judged.append((self.model, list(tokens))), drafted(self, tokens, confidence)))
    llm = lucebox.LLM(laguna, draft=drafters["dflash_zlab"], kv_policy="exact", kv_pool_tokens=256, tree_budget=0,
                      **COMMON)
    copies, propose = [], llm.proposer.propose

    def record(context, k, params, generator):
        draft = propose(context, k, params, generator)
        if draft.copied:
            copies.append((k, draft.tokens))
        return draft

    llm.proposer.propose = record
    out = llm.generate(PROMPT, max_tokens=N, ignore_eos=True)
    assert out.token_ids == plain["exact"] and len(copies) > 5
    learned = llm.engine.learned
    for _, tokens in copies:
        judges = [model for model, block in judged if block == tokens]
        assert any(m is learned.copies["greedy"] for m in judges)
        assert not any(m is learned.keep["greedy"] for m in judges)
    verified = out.stats["width_histogram"]
    assert any(len(tokens) > 7 for _, tokens in copies) and max(verified) > 7  # whole copies verified
