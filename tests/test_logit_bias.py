"""OpenAI's logit_bias: each bias is added to its token's raw logit before the penalties and the rest of
sampling; -100 bans a token, +100 forces one; greedy speculation (trees and chains) commits plain
decoding's very tokens with it, seeded coupled sampling too; logprobs stay the raw distribution."""

import pytest
import torch

from lucebox.errors import InvalidArgumentError
from lucebox.sampling import SamplingParams, distribution, penalize
from lucebox.speculative.decide import decide
from lucebox.speculative.proposer import Draft

PROMPT = "def merge(left, right):\n"
N = 24


@pytest.fixture(scope="module")
def unbiased(tree_llm):
    return tree_llm.generate(PROMPT, max_tokens=N, ignore_eos=True, speculate=False).token_ids


def test_the_bias_is_added_to_the_raw_logits_before_the_penalties_by_hand():
    logits = torch.tensor([2.0, 1.8, 0.5, -1.0])
    seen = torch.tensor([False, True, False, False])
    params = SamplingParams(logit_bias={0: -3.0, 3: 4.0}, repetition_penalty=2.0)
    # bias first: [-1.0, 1.8, 0.5, 3.0]; then token 1, seen, is divided by 2: 0.9
    assert torch.allclose(penalize(logits, params, seen, None), torch.tensor([-1.0, 0.9, 0.5, 3.0]))
    sampled = SamplingParams(temperature=0.5, logit_bias={0: -3.0, 3: 4.0})
    assert torch.allclose(distribution(logits, sampled, seen), (torch.tensor([-1.0, 1.8, 0.5, 3.0]) / 0.5).softmax(-1))
    assert decide(logits[None], Draft([]), SamplingParams(), seen, "coupled", None).next_token == 0
    assert decide(logits[None], Draft([]), SamplingParams(logit_bias={3: 4.0}), seen, "coupled", None).next_token == 3
    # zero biases change nothing and are left out; a {id: bias} mapping and its pairs are one setting
    assert SamplingParams(logit_bias={2: 0.0}) == SamplingParams() and not SamplingParams(logit_bias={2: 0}).penalized
    assert SamplingParams(logit_bias={3: 1, 1: -2}).logit_bias == ((1, -2.0), (3, 1.0))


def test_minus_100_bans_the_greedy_choice_and_plus_100_forces_a_token(tree_llm, unbiased):
    banned = unbiased[3]
    out = tree_llm.generate(PROMPT, max_tokens=N, ignore_eos=True, speculate=False, logit_bias={banned: -100})
    assert out.token_ids[:3] == unbiased[:3] and banned not in out.token_ids
    forced = next(t for t in range(100, 200) if t not in unbiased)
    assert tree_llm.generate(PROMPT, max_tokens=8, ignore_eos=True, logit_bias={forced: 100}).token_ids == [forced] * 8


def test_greedy_speculation_with_a_bias_commits_plain_decoding_s_tokens_and_logprobs_stay_raw(tree_llm, chain_llm,
                                                                                                unbiased):
    bias = {unbiased[2]: -100.0, unbiased[5]: -4.0, 13: 2.5}
    options = {"max_tokens": N, "ignore_eos": True, "logit_bias": bias, "logprobs": 2}
    plain = tree_llm.generate(PROMPT, speculate=False, **options)
    assert plain.token_ids != unbiased
    ids = tree_llm.tokenizer.encode(PROMPT)
    raw = tree_llm.logits(ids + plain.token_ids).float()[len(ids) - 1 : -1]
    shift = torch.zeros(raw.shape[-1])
    shift[list(bias)] = torch.tensor(list(bias.values()))
    assert plain.token_ids == (raw + shift).argmax(-1).tolist()  # each token: the argmax of the biased logits
    raw_logprobs = torch.log_softmax(raw, -1).gather(1, torch.tensor(plain.token_ids)[:, None])[:, 0]
    for name, engine in (("trees", tree_llm), ("chain_llm", chain_llm)):
        out = engine.generate(PROMPT, **options)
        assert out.token_ids == plain.token_ids, name
        assert out.stats["acceptance_length"] > 1.2, name  # drafts were kept: speculation really ran
        assert (torch.tensor([lp.logprob for lp in out.logprobs]) - raw_logprobs).abs().max() < 1e-5, name


def test_seeded_coupled_sampling_with_a_bias_commits_plain_sampling_s_tokens(tree_llm, chain_llm, unbiased):
    options = {"max_tokens": N, "ignore_eos": True, "temperature": 0.9, "seed": 5,
               "logit_bias": {unbiased[1]: -100, 13: 3.0}, "repetition_penalty": 1.2}
    plain = tree_llm.generate(PROMPT, speculate=False, **options).token_ids
    assert plain != tree_llm.generate(PROMPT, speculate=False, **{**options, "logit_bias": None}).token_ids
    assert unbiased[1] not in plain
    for engine in (tree_llm, chain_llm):
        assert engine.generate(PROMPT, **options).token_ids == plain


@pytest.mark.parametrize("bias, message", [
    ({4096: 1.0}, "logit_bias token id must be in 0..4095, got 4096"),
    ({-1: 1.0}, "logit_bias token id must be in 0..4095, got -1"),
    ({"7": 1.0}, "logit_bias token id must be an integer, got '7'"),
    ({7: 100.5}, r"logit_bias\[7\] must be in \[-100.0, 100.0\], got 100.5"),
    ({7: float("inf")}, r"logit_bias\[7\] must be a finite number, got inf"),
    ({i: 1.0 for i in range(301)}, "logit_bias may bias at most 300 tokens, got 301"),
    ([7, 1.0], "logit_bias must be a mapping of token ids to biases"),
])
def test_bad_biases_are_refused_by_name(tree_llm, bias, message):
    with pytest.raises(InvalidArgumentError, match=message):
        tree_llm.generate(PROMPT, max_tokens=2, logit_bias=bias)
