"""Sampling: processed distributions equal transformers' logits processors; draws follow them;
seeded runs repeat; stop token ids and max_tokens end a generation."""

import json
import shutil

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import lucebox
from lucebox import sampling
from lucebox.sampling import MIN_ROWS_KEPT, RaceNoise, SamplingParams, distribution, draw

V = 50
CASES = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=7),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=0.9, min_p=0.1),
    SamplingParams(temperature=1.1, top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.3),
]


def transformers_distribution(logits, params, history):
    ids = torch.tensor([history])
    scores = logits[None].clone()
    processors = []
    if params.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    processors.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k:
        processors.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1:
        processors.append(TopPLogitsWarper(params.top_p))
    if params.min_p:
        processors.append(MinPLogitsWarper(params.min_p))
    for p in processors:
        scores = p(ids, scores)
    return scores.softmax(-1)[0]


@pytest.mark.parametrize("params", CASES, ids=lambda p: repr(p)[15:-1])
def test_distribution_equals_transformers_processors(params):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(V, generator=g) * 3
    history = [1, 4, 4, 9, 30]
    seen = torch.zeros(V, dtype=torch.bool)
    seen[history] = True
    ours = distribution(logits, params, seen)
    expected = transformers_distribution(logits, params, history)
    assert torch.allclose(ours, expected, atol=1e-6)
    assert (ours > 0).sum() == (expected > 0).sum()
    # Rows at once (a verify step's), each with its own history, equal each row on its own.
    rows = torch.stack([logits, logits.flip(0) * 0.5])
    histories = torch.stack([seen, seen.roll(3)])
    both = distribution(rows, params, histories)
    assert torch.allclose(both[0], ours) and torch.allclose(both[1], distribution(rows[1], params, histories[1]))


def test_race_noise_picks_follow_the_distribution_independently_per_position():
    """Coupled sampling: the race winner at each position is a sample of that row, positions are
    independent of each other, and the noise is a pure function of (seed, position, token)."""
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0, 0.125], dtype=torch.float64)
    n = 40000
    picks = RaceNoise(7).choose(probs.expand(n, -1), torch.arange(n))
    counts = torch.bincount(picks, minlength=5)
    assert counts[3] == 0
    assert (counts / n - probs).abs().sum() / 2 < 0.01
    pairs = torch.bincount(picks[:-1] * 5 + picks[1:], minlength=25).reshape(5, 5) / (n - 1)  # neighbours
    assert (pairs - probs[:, None] * probs[None, :]).abs().sum() / 2 < 0.015
    noise = RaceNoise(2**40 + 3)
    again = noise.exponentials(torch.tensor([5, 9]), 6)
    assert torch.equal(again, noise.exponentials(torch.tensor([5, 9]), 6))
    assert torch.equal(again[1], noise.exponentials(torch.tensor([9]), 6)[0])  # a row's noise is its own
    assert not torch.equal(again, RaceNoise(3).exponentials(torch.tensor([5, 9]), 6))  # the seed's high bits count
    assert not torch.equal(again[0], again[1])


def test_race_noise_rows_kept_on_the_cpu_are_the_hashed_rows(monkeypatch):
    """A request's noise keeps each position's row once hashed (the drafter and the verification race
    the same positions): what comes back is the hash of exactly the positions asked for, in order,
    repeats included, and the rows kept stay bounded."""
    noise, vocab = RaceNoise(11), 50
    monkeypatch.setattr(sampling, "ROW_VALUES_KEPT", 4 * vocab)  # a big vocabulary's bound: MIN_ROWS_KEPT rows
    first = noise.exponentials(torch.tensor([3, 4, 5]), vocab)
    again = noise.exponentials(torch.tensor([5, 4, 6, 5]), vocab)  # kept rows, and one new
    assert torch.equal(first, RaceNoise(11)._hashed(torch.tensor([3, 4, 5]), vocab))
    assert torch.equal(again, RaceNoise(11)._hashed(torch.tensor([5, 4, 6, 5]), vocab))
    for start in range(0, 4 * MIN_ROWS_KEPT, 8):
        noise.exponentials(torch.arange(start, start + 8), vocab)
    assert len(noise._rows) == MIN_ROWS_KEPT
    assert torch.equal(noise.exponentials(torch.tensor([3]), vocab), first[:1])  # hashed again once forgotten


def test_draws_follow_the_distribution():
    probs = torch.tensor([0.5, 0.25, 0.125, 0.0, 0.125])
    g = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.stack([draw(probs, g) for _ in range(20000)]), minlength=5)
    assert counts[3] == 0
    assert (counts / 20000 - probs).abs().sum() / 2 < 0.02


@pytest.fixture(scope="module")
def llm(reference_models):
    folder, _ = reference_models("llama")
    return lucebox.LLM(folder, device="cpu", dtype="float64")


def test_seeded_sampling_repeats_and_seeds_differ(llm):
    def run(seed):
        return llm.generate([5, 6, 7], max_tokens=24, temperature=1.5, top_p=0.95, seed=seed, ignore_eos=True).token_ids

    assert run(11) == run(11)
    assert run(11) != run(12)


def test_greedy_with_repetition_penalty_matches_transformers(llm, reference_models):
    _, ref = reference_models("llama")
    prompt = [3, 9, 27, 81, 115]
    with torch.no_grad():
        expected = ref.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False, repetition_penalty=1.5,
                                eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    got = llm.generate(prompt, max_tokens=30, repetition_penalty=1.5, ignore_eos=True).token_ids
    assert got == expected


def test_stop_token_ids_and_eos_end_generation(llm):
    free = llm.generate([1, 2, 3], max_tokens=12, ignore_eos=True)
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    target = free.token_ids[4]
    first = free.token_ids.index(target)
    stopped = llm.generate([1, 2, 3], max_tokens=12, stop=[target], ignore_eos=True)
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: first + 1]


def test_eos_from_generation_config_stops_unless_ignored(reference_models, tmp_path):
    folder, _ = reference_models("llama")
    shutil.copytree(folder, tmp_path / "m")
    free = lucebox.LLM(tmp_path / "m", device="cpu").generate([1, 2, 3], max_tokens=12, ignore_eos=True).token_ids
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"eos_token_id": [free[5]]}))
    llm = lucebox.LLM(tmp_path / "m", device="cpu")
    stopped = llm.generate([1, 2, 3], max_tokens=12)
    assert stopped.finish_reason == "stop" and stopped.token_ids == free[: free.index(free[5]) + 1]
    assert llm.generate([1, 2, 3], max_tokens=12, ignore_eos=True).token_ids == free


def test_stream_yields_the_same_tokens_as_generate(llm):
    chunks = list(llm.stream([1, 2, 3], max_tokens=10, ignore_eos=True))
    assert [t for c in chunks for t in c.token_ids] == llm.generate([1, 2, 3], max_tokens=10, ignore_eos=True).token_ids
    assert all(c.finish_reason is None for c in chunks[:-1]) and chunks[-1].finish_reason == "length"
    stats = chunks[-1].stats
    for key in ("prefill_tokens_per_s", "decode_tokens_per_s", "tokens_per_s", "generated_tokens"):
        assert stats[key] > 0
    assert stats["generated_tokens"] == 10


def test_unseeded_sampling_leaves_torchs_global_rng_alone(llm):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    llm.generate([1, 2], max_tokens=4, temperature=1.0, ignore_eos=True)
    assert torch.equal(torch.rand(3), expected)


def test_two_open_streams_do_not_share_a_cache(llm):
    def alone(seed):
        return llm.generate([4, 5, 6], max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True).token_ids

    a_alone, b_alone = alone(1), alone(2)
    a = llm.stream([4, 5, 6], max_tokens=12, temperature=1.0, seed=1, ignore_eos=True)
    b = llm.stream([4, 5, 6], max_tokens=12, temperature=1.0, seed=2, ignore_eos=True)
    a_ids, b_ids = [], []
    for ca, cb in zip(a, b, strict=True):
        a_ids += ca.token_ids
        b_ids += cb.token_ids
    assert (a_ids, b_ids) == (a_alone, b_alone)
