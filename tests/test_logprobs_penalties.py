"""Logprobs are log_softmax of the target's own logits (speculation or not); presence and frequency
penalties follow OpenAI's formula over the generated tokens, losslessly under speculation; a seed
repeats a sampled output whatever the cache held."""

import pytest
import torch

from lucebox.errors import InvalidArgumentError
from lucebox.sampling import SamplingParams, distribution, penalize
from lucebox.speculative.decide import decide
from lucebox.speculative.proposer import Draft

PROMPT = "def merge(left, right):\n"


def _reference(tree_llm, prompt_ids, generated):
    """log_softmax of LLM.logits at the rows that chose each generated token: (n, V)."""
    return torch.log_softmax(tree_llm.logits(prompt_ids + generated).float(), -1)[len(prompt_ids) - 1 : -1]


@pytest.mark.parametrize("options", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 3}])
def test_logprobs_equal_log_softmax_of_llm_logits_with_and_without_speculation(tree_llm, chain_llm, options):
    ids = tree_llm.tokenizer.encode(PROMPT)
    runs = {}
    greedy = options["temperature"] == 0.0  # sampled: the tree rounds alone (their logits are the target's)
    engines = [("dflash", tree_llm, True), ("chains", chain_llm, True), ("plain", tree_llm, False)]
    engines = engines[: 3 if greedy else 1]
    for name, engine, speculate in engines:
        out = engine.generate(PROMPT, max_tokens=16, logprobs=5, speculate=speculate, ignore_eos=True, **options)
        ref = _reference(tree_llm, ids, out.token_ids)
        assert [lp.token_id for lp in out.logprobs] == out.token_ids
        got = torch.tensor([lp.logprob for lp in out.logprobs])
        assert (got - ref.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]).abs().max() < 1e-5
        values, top_ids = ref.topk(5, -1)
        for lp, want_values, want_ids in zip(out.logprobs, values, top_ids, strict=True):
            assert len(lp.top) == 5
            assert torch.allclose(torch.tensor([v for _, v in lp.top]), want_values, atol=1e-5)
            assert [i for i, _ in lp.top][0] == want_ids[0]
        runs[name] = out
    if greedy:  # every run chose the same tokens, so the logprobs match too
        assert runs["dflash"].stats["acceptance_length"] > 1.2 and runs["chains"].stats["acceptance_length"] > 1.2
        plain = torch.tensor([lp.logprob for lp in runs["plain"].logprobs])
        for name in ("dflash", "chains"):
            assert runs[name].token_ids == runs["plain"].token_ids
            assert (torch.tensor([lp.logprob for lp in runs[name].logprobs]) - plain).abs().max() < 1e-5
    assert tree_llm.generate(PROMPT, max_tokens=4).logprobs is None  # only when asked
    assert all(lp.top == [] for lp in tree_llm.generate(PROMPT, max_tokens=4, logprobs=0).logprobs)


def test_presence_and_frequency_penalties_follow_openai_s_formula_by_hand():
    logits = torch.tensor([2.0, 1.8, 0.5, 1.0])
    counts = torch.tensor([2.0, 1.0, 0.0, 0.0])  # token 0 generated twice, token 1 once
    seen = torch.zeros(4, dtype=torch.bool)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.4)
    # logit - count * 0.4 - (count > 0) * 0.5: 2.0 - 0.8 - 0.5 = 0.7, 1.8 - 0.4 - 0.5 = 0.9, 0.5, 1.0
    assert torch.allclose(penalize(logits, params, seen, counts), torch.tensor([0.7, 0.9, 0.5, 1.0]))
    sampled = SamplingParams(temperature=0.5, presence_penalty=0.5, frequency_penalty=0.4)  # before the temperature
    want = (torch.tensor([0.7, 0.9, 0.5, 1.0]) / 0.5).softmax(-1)
    assert torch.allclose(distribution(logits, sampled, seen, counts), want)
    assert decide(logits[None], Draft([]), SamplingParams(), seen, "coupled", None, counts=counts).next_token == 0
    assert decide(logits[None], Draft([]), params, seen, "coupled", None, counts=counts).next_token == 3
    # A verify row counts the drafts before it: after drafting 3, token 3's logit is 1.0 - 0.4 - 0.5 = 0.1.
    verdict = decide(logits[None].repeat(2, 1), Draft([3]), params, seen, "coupled", None, counts=counts)
    assert (verdict.accepted, verdict.next_token) == (1, 1)
    for name in ("presence_penalty", "frequency_penalty"):
        with pytest.raises(InvalidArgumentError, match=name):
            SamplingParams(**{name: 2.5})


def test_penalties_count_generated_tokens_only_and_speculation_keeps_the_tokens(tree_llm, chain_llm):
    ids = tree_llm.tokenizer.encode(PROMPT)
    options = {"max_tokens": 16, "presence_penalty": 0.8, "frequency_penalty": 0.6, "ignore_eos": True}
    plain = tree_llm.generate(PROMPT, speculate=False, **options).token_ids
    assert plain != tree_llm.generate(PROMPT, max_tokens=16, ignore_eos=True, speculate=False).token_ids
    raw = tree_llm.logits(ids + plain).float()[len(ids) - 1 : -1]
    counts = torch.zeros(raw.shape[-1])
    for row, token in zip(raw, plain, strict=True):  # each token: the argmax after OpenAI's penalties
        assert token == int((row - counts * 0.6 - (counts > 0) * 0.8).argmax())
        counts[token] += 1
    for engine in (tree_llm, chain_llm):
        assert engine.generate(PROMPT, **options).token_ids == plain
    sampled = {**options, "temperature": 1.0, "seed": 11}
    plain_sampled = tree_llm.generate(PROMPT, speculate=False, **sampled).token_ids
    assert tree_llm.generate(PROMPT, **sampled).token_ids == plain_sampled


def test_a_seed_repeats_the_output_whatever_the_cache_held(tree_llm):
    options = {"max_tokens": 12, "temperature": 0.9, "seed": 42, "presence_penalty": 0.3}
    first = tree_llm.generate(PROMPT, **options).token_ids
    assert tree_llm.generate(PROMPT, **options).token_ids == first  # the prompt's prefix cached
    tree_llm.generate("import os\n", max_tokens=4)
    assert tree_llm.generate(PROMPT, **options).token_ids == first  # another prompt in the cache
    tree_llm.drop_cache()
    assert tree_llm.generate(PROMPT, **options).token_ids == first  # nothing cached
    assert tree_llm.generate(PROMPT, **{**options, "seed": 43}).token_ids != first
    with pytest.raises(InvalidArgumentError, match="logprobs"):
        tree_llm.generate(PROMPT, max_tokens=2, logprobs=21)
