"""The engine with rings and the paged pool equals the plain full cache (and transformers)."""

import dataclasses

import pytest
import torch
from tiny_models import VOCAB, WINDOW

import lucebox
import lucebox.memory.plan
from lucebox.caches import SequenceCache, Step
from lucebox.errors import ContextLengthError, InvalidArgumentError

PROMPT = torch.randint(0, VOCAB, (60,), generator=torch.Generator().manual_seed(2)).tolist()


def stepwise_logits(llm, ids, n_prefill, reference=False):
    """Logits of every position: a chunked prefill of ids[:n_prefill], then one decode step per token."""
    settings = dataclasses.replace(llm.setup.cache, reference=reference)
    cache = SequenceCache(llm.config, settings, llm.dtype, llm.device)
    out = [llm.engine.decoder.logits(h) for h in llm.engine.prefill(ids[:n_prefill], cache)]
    for i in range(n_prefill, len(ids)):
        hidden = llm.engine.decoder.forward(torch.tensor([ids[i]]), Step(torch.tensor([i])), cache)
        cache.commit(i + 1)
        out.append(llm.engine.decoder.logits(hidden))
    return torch.cat(out), cache


@pytest.mark.parametrize("arch", ["laguna", "mistral", "qwen3"])
def test_ring_engine_equals_full_cache_and_transformers_over_many_windows(arch, reference_models):
    folder, ref = reference_models(arch)
    llm = lucebox.LLM(folder, device="cpu", dtype="float64", prefill_chunk=16)  # rings of WINDOW + 16 slots
    got = llm.generate(PROMPT, max_tokens=200, ignore_eos=True).token_ids
    ids = PROMPT + got
    assert len(ids) > 5 * (WINDOW + 16)  # every ring wraps many times
    ours, _ = stepwise_logits(llm, ids, len(PROMPT))
    full, _ = stepwise_logits(llm, ids, len(PROMPT), reference=True)
    with torch.no_grad():
        expected_logits = ref(torch.tensor([ids])).logits[0]
        expected_tokens = ref.generate(torch.tensor([PROMPT]), max_new_tokens=200, do_sample=False,
                                       eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    assert (ours - full).abs().max() < 1e-9
    assert (ours - expected_logits).abs().max() < 1e-6
    assert got == expected_tokens


@pytest.mark.parametrize("arch", ["laguna", "llama"])
def test_exact_kvflash_with_a_small_pool_equals_the_full_cache(arch, reference_models):
    folder, _ = reference_models(arch)
    llm = lucebox.LLM(folder, device="cpu", dtype="float64", max_context=2048, kv_pool_tokens=256,
                      kv_policy="exact", prefill_chunk=64)
    ids = torch.randint(0, VOCAB, (1100,), generator=torch.Generator().manual_seed(3)).tolist()
    assert 4 * 256 < len(ids)
    ours, cache = stepwise_logits(llm, ids, 1000)  # prefill streams host chunks; then 100 decode steps do
    full, _ = stepwise_logits(llm, ids, 1000, reference=True)
    assert (ours - full).abs().max() < 1e-9
    memory = cache.memory()
    # Chunks that left the pool live on the host: 1100 rows in a pool of 256 moves most of them.
    assert memory["kv_host"] > 0 and 0 < memory["kv_pool_device"] <= memory["kv_host"] / 4


def test_generation_with_offload_matches_full_cache_tokens(reference_models):
    folder, _ = reference_models("laguna")
    kwargs = dict(device="cpu", dtype="float64", max_context=1024, prefill_chunk=64)
    small = lucebox.LLM(folder, kv_pool_tokens=256, kv_policy="exact", **kwargs)
    big = lucebox.LLM(folder, kv_pool_tokens=1024, **kwargs)
    prompt = torch.randint(0, VOCAB, (500,), generator=torch.Generator().manual_seed(4)).tolist()
    assert big.setup.cache.kv_policy == "exact"  # the default when the context fits the pool
    a = small.generate(prompt, max_tokens=100, ignore_eos=True).token_ids
    assert a == big.generate(prompt, max_tokens=100, ignore_eos=True).token_ids


def test_select_policy_runs_with_bounded_device_memory(reference_models):
    folder, _ = reference_models("laguna")
    llm = lucebox.LLM(folder, device="cpu", dtype="float32", max_context=4096, kv_pool_tokens=1024,
                      kv_policy="select", prefill_chunk=64)
    pools = []
    prompt = [1, 2, 3]
    for _ in range(4):
        out = llm.generate(prompt, max_tokens=300, ignore_eos=True)
        prompt = prompt + out.token_ids
        pools.append((llm.memory()["kv_pool_device"], llm.memory()["ring_caches"]))
    assert len(prompt) > 1024  # past the pool
    assert len(set(pools)) == 1  # the resident KV never grows
    assert llm.memory()["kv_host"] > 0


def test_no_score_matrix_is_wider_than_the_pool_or_a_streamed_block(reference_models):
    folder, _ = reference_models("laguna")
    llm = lucebox.LLM(folder, device="cpu", dtype="float32", max_context=4096, kv_pool_tokens=256,
                      kv_policy="exact", prefill_chunk=64)
    widths = []
    real = llm.engine.decoder.kernels.attention_partial

    def spy(q, k, *args, **kwargs):
        widths.append((q.shape[0], k.shape[0]))
        return real(q, k, *args, **kwargs)

    llm.engine.decoder.kernels = dataclasses.replace(llm.engine.decoder.kernels, attention_partial=spy)
    llm.logits(torch.randint(0, VOCAB, (3000,), generator=torch.Generator().manual_seed(5)).tolist())
    stream_block = llm.setup.cache.kvflash().stream_chunks * 64
    assert max(w for _, w in widths) <= max(256, stream_block, WINDOW + 64)
    assert max(t for t, _ in widths) <= 64


def test_second_turn_reuses_the_cache_and_prefills_only_new_tokens(reference_models):
    folder, _ = reference_models("laguna")
    llm = lucebox.LLM(folder, device="cpu", dtype="float64", prefill_chunk=16)
    first = llm.generate(PROMPT, max_tokens=30, ignore_eos=True)
    follow_up = PROMPT + first.token_ids + [5, 6, 7]
    second = llm.generate(follow_up, max_tokens=30, ignore_eos=True)
    assert second.stats["cached_prompt_tokens"] == len(PROMPT) + 29  # the last generated token was never forwarded
    fresh = lucebox.LLM(folder, device="cpu", dtype="float64", prefill_chunk=16)
    assert second.token_ids == fresh.generate(follow_up, max_tokens=30, ignore_eos=True).token_ids
    # A prompt that leaves the old path re-prefills without reusing rows the rings no longer hold.
    other = llm.generate(PROMPT[:10], max_tokens=5, ignore_eos=True)
    assert other.stats["cached_prompt_tokens"] == 0
    assert other.token_ids == fresh.generate(PROMPT[:10], max_tokens=5, ignore_eos=True).token_ids


def test_a_context_that_cannot_fit_names_the_largest_that_does(reference_models, monkeypatch):
    folder, _ = reference_models("laguna")
    monkeypatch.setattr(lucebox.memory.plan, "_host_available", lambda: 64 * 2**20)
    with pytest.raises(ContextLengthError, match=r"largest context that fits is about (\d+) tokens") as info:
        lucebox.LLM(folder, device="cpu", max_context=10_000_000, kv_pool_tokens=1024)
    largest = int(info.value.args[0].split("about ")[-1].split(" tokens")[0])
    assert 1024 < largest < 10_000_000
    lucebox.LLM(folder, device="cpu", max_context=largest, kv_pool_tokens=1024)


def test_bad_cache_arguments_are_typed(reference_models):
    folder, _ = reference_models("laguna")
    with pytest.raises(InvalidArgumentError, match="kv_policy"):
        lucebox.LLM(folder, device="cpu", kv_policy="magic")
    with pytest.raises(InvalidArgumentError, match="kv_pool_tokens=128 is too small"):
        lucebox.LLM(folder, device="cpu", max_context=4096, kv_pool_tokens=128, prefill_chunk=512)
