"""MoE experts in host memory with a device cache (`experts_on_host`): the output is the one with
every expert on the device, in float64 on the CPU, with few slots (every step misses) and with
many; the traffic is counted and reported; a step choosing more experts than there are slots
runs in row groups."""

from __future__ import annotations

import pytest
import torch
from lucebox.kernels import moe
from lucebox.kernels.quant import quantize

import lucebox
from lucebox.errors import InvalidArgumentError
from lucebox.memory.expert_cache import ExpertCache, ExpertTraffic

PROMPT = [5, 9, 2, 31, 7, 7, 40, 12, 3, 18, 22, 4, 61, 8, 8, 27, 90, 1, 15, 33, 6, 2, 44, 10]  # > 16 rows: the loop


def _engine(folder, **options):
    return lucebox.LLM(folder, device="cpu", dtype="float64", **options)


@pytest.mark.parametrize("arch", ["qwen3_moe", "laguna"])
@pytest.mark.parametrize("slots", ["fewest", "most"])
def test_experts_in_host_memory_give_the_all_on_device_output(reference_models, arch, slots):
    folder, _ = reference_models(arch)
    plain = _engine(folder)
    top_k, experts = plain.config.moe.top_k, plain.config.moe.num_experts
    count = top_k if slots == "fewest" else experts
    cached = _engine(folder, experts_on_host=True, expert_slots=count)
    routed = [name for name in plain.engine.decoder.w if name.endswith("experts_gate_up")]
    assert all(name not in cached.engine.decoder.w for name in routed)
    want = plain.generate(PROMPT, max_tokens=8, ignore_eos=True)
    got = cached.generate(PROMPT, max_tokens=8, ignore_eos=True)
    assert got.token_ids == want.token_ids
    # Prefill (24 rows that choose more experts than `fewest` slots: row groups) and decode.
    assert torch.equal(cached.logits(PROMPT), plain.logits(PROMPT))
    stats = got.stats
    assert stats["expert_hits"] + stats["expert_misses"] > 0
    assert 0.0 <= stats["expert_hit_rate"] <= 1.0 and stats["expert_copied_bytes"] > 0
    if slots == "most":  # every expert fits: after the first request nothing is copied again
        again = cached.generate(PROMPT, max_tokens=8, ignore_eos=True).stats
        assert again["expert_misses"] == 0 and again["expert_hit_rate"] == 1.0 and again["expert_copied_bytes"] == 0
    else:
        assert stats["expert_misses"] > 0 and stats["expert_hit_rate"] < 1.0


def test_speculative_decoding_with_experts_in_host_memory(reference_models):
    folder, _ = reference_models("qwen3_moe")
    plain = _engine(folder).generate(PROMPT * 2, max_tokens=10, ignore_eos=True)
    cached = _engine(folder, experts_on_host=True, draft="ngram").generate(PROMPT * 2, max_tokens=10, ignore_eos=True)
    assert cached.token_ids == plain.token_ids and cached.stats["rounds"] < 10  # some drafts were kept


def test_the_cache_copies_only_missing_experts_and_evicts_the_least_recently_used():
    E, W, H = 6, 4, 8
    gate_up, down = torch.randn(E, 2 * W, H, dtype=torch.float64), torch.randn(E, H, W, dtype=torch.float64)
    traffic = ExpertTraffic()
    cache = ExpertCache(gate_up, down, 3, torch.device("cpu"), traffic)
    x, weights = torch.randn(1, H, dtype=torch.float64), torch.full((1, 2), 0.5, dtype=torch.float64)
    per_expert = (2 * W * H + H * W) * 8

    def step(*experts):
        ids = torch.tensor([list(experts)])
        out = cache.moe(moe.moe_experts, x, weights, ids)
        torch.testing.assert_close(out, moe.moe_experts(x, gate_up, down, weights, ids), rtol=0, atol=0)
        return [traffic.hits, traffic.misses, traffic.copied_bytes // per_expert]

    assert step(0, 1) == [0, 2, 2]
    assert step(1, 2) == [1, 3, 3]
    assert step(3, 1) == [2, 4, 4]  # 0 was least recently used: 3 takes its slot
    assert sorted(e for e in cache.expert_in) == [1, 2, 3]
    assert step(2, 0) == [3, 5, 5]  # 2 hits; 0 evicts 1 (in the last step 1 was used, then 3 copied in)
    assert sorted(e for e in cache.expert_in) == [0, 2, 3]


def test_a_quantized_expert_stack_is_cached_field_by_field():
    E, W, H = 4, 8, 32
    f64 = torch.float64
    gate_up = quantize(torch.randn(E, 2 * W, H, dtype=f64), "int4", 16)
    down = quantize(torch.randn(E, H, W, dtype=f64), "int8")
    cache = ExpertCache(gate_up, down, 2, torch.device("cpu"), ExpertTraffic())
    x, weights = torch.randn(3, H, dtype=f64), torch.rand(3, 2, dtype=f64)
    ids = torch.tensor([[0, 3], [3, 1], [2, 0]])
    out = cache.moe(moe.moe_experts, x, weights, ids)  # 4 distinct experts, 2 slots: row groups
    torch.testing.assert_close(out, moe.moe_experts(x, gate_up, down, weights, ids), rtol=1e-12, atol=1e-12)


def test_bad_expert_options_are_refused(reference_models):
    folder, _ = reference_models("qwen3_moe")
    with pytest.raises(InvalidArgumentError, match="expert_slots=1 must be between top_k"):
        _engine(folder, experts_on_host=True, expert_slots=1)
    with pytest.raises(InvalidArgumentError, match="expert_slots needs the experts in host memory"):
        _engine(folder, experts_on_host=False, expert_slots=4)
    assert _engine(folder, expert_slots=4).setup.expert_slots == 4  # a cache size asks for the cache
    dense, _ = reference_models("llama")
    with pytest.raises(InvalidArgumentError, match="needs a mixture-of-experts model"):
        _engine(dense, experts_on_host=True)


@pytest.mark.parametrize("rows", [1, 3, 40])  # the gathered, dense and loop paths of the reference
def test_the_moe_reference_does_not_depend_on_how_experts_are_numbered(rows):
    """An expert cache renumbers experts by slot: each row's k outputs must be summed in choice
    order, not expert order, for the result to stay bit for bit the same (k >= 3 shows it)."""
    E, W, H, k = 8, 6, 16, 4
    gen = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(E, 2 * W, H, dtype=torch.float64, generator=gen)
    down = torch.randn(E, H, W, dtype=torch.float64, generator=gen)
    x = torch.randn(rows, H, dtype=torch.float64, generator=gen)
    weights = torch.rand(rows, k, dtype=torch.float64, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(rows)])
    new_number = torch.randperm(E, generator=gen)  # expert e is now new_number[e]
    old_of_new = torch.argsort(new_number)
    renumbered = moe.moe_experts(x, gate_up[old_of_new], down[old_of_new], weights, new_number[ids])
    assert torch.equal(renumbered, moe.moe_experts(x, gate_up, down, weights, ids))


def test_the_triton_kernels_give_the_same_output_with_experts_in_host_memory(reference_models):
    """The Triton MoE kernel (through the interpreter) over cache slots, with few slots."""
    folder, _ = reference_models("qwen3_moe")
    options = dict(device="cpu", dtype="float32", backend="triton")
    plain = lucebox.LLM(folder, **options)
    cached = lucebox.LLM(folder, experts_on_host=True, expert_slots=2, **options)
    got = cached.generate(PROMPT[:6], max_tokens=3, ignore_eos=True)  # a 6-row prefill in row groups, 2 decodes
    assert got.token_ids == plain.generate(PROMPT[:6], max_tokens=3, ignore_eos=True).token_ids
    assert got.stats["expert_misses"] > 0


def test_a_budget_too_small_for_every_expert_moves_them_to_host_memory(reference_models):
    from lucebox.checkpoints.loading import describe_model
    from lucebox.memory.vram import plan_for_budget

    folder, _ = reference_models("qwen3_moe")
    cfg = describe_model(folder).cfg
    fixed = dict(max_context=1024, prefill_chunk=512, kv_pool_tokens=1024)  # only the experts can give way
    plan = dict(fixed, dtype=torch.float64, graphs=False)
    on_device = plan_for_budget(cfg, 2**40, experts_on_host=False, **plan).device_total
    budget = on_device - 1
    chosen = plan_for_budget(cfg, budget, **plan)
    assert chosen.fits and chosen.choices["experts_on_host"]
    llm = _engine(folder, **fixed, vram_budget=budget)
    assert llm.setup.expert_slots == chosen.choices["expert_slots"] < cfg.moe.num_experts
    assert llm.memory()["weights"] < on_device
    want = _engine(folder, max_context=1024).generate(PROMPT, max_tokens=5, ignore_eos=True).token_ids
    assert llm.generate(PROMPT, max_tokens=5, ignore_eos=True).token_ids == want


def test_row_groups_run_in_the_whole_steps_layout_on_the_triton_kernel():
    """A 17-row step (the prefill layout: 64-wide tiles over H and I) run as row groups of a
    3-slot cache: each group is computed in the whole step's layout (`layout_of`), not the one its
    own few rows would pick (the decode layout sums over other tile widths, so on a GPU its bits
    differ). The values equal the whole step's to float32 rounding. Bits are not compared here:
    the interpreter's tl.dot is numpy's matmul, whose BLAS rounds a row differently at another
    offset in its tile on some CPUs (AVX2 OpenBLAS does; a group's rows sit at other offsets)."""
    from lucebox.kernels import moe_triton

    E, W, H, k, rows = 8, 128, 128, 2, 17
    gen = torch.Generator().manual_seed(7)
    gate_up, down = torch.randn(E, 2 * W, H, generator=gen) / 16, torch.randn(E, H, W, generator=gen) / 16
    shared = (torch.randn(2 * W, H, generator=gen) / 16, torch.randn(H, W, generator=gen) / 16)
    x, weights = torch.randn(rows, H, generator=gen), torch.rand(rows, k, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(rows)])
    cache = ExpertCache(gate_up, down, 3, torch.device("cpu"), ExpertTraffic())
    layouts = []

    def watched(*args, layout_of=None, **kwargs):
        layouts.append(layout_of)
        return moe_triton.moe_experts(*args, layout_of=layout_of, **kwargs)

    got = cache.moe(watched, x, weights, ids, 2.5, *shared)
    assert len(layouts) > 1 and set(layouts) == {(rows, E)}
    torch.testing.assert_close(got, moe_triton.moe_experts(x, gate_up, down, weights, ids, 2.5, *shared),
                               rtol=1e-5, atol=1e-6)


def test_the_pinned_arena_packs_tensors_into_blocks():
    """Experts are pinned in power-of-two blocks, not one allocation each (which the caching host
    allocator would round up to a power of two): here without pinning, which needs CUDA."""
    from lucebox.memory.expert_cache import PinnedArena

    arena = PinnedArena(block=1024, pin=False)
    parts = [torch.randn(40, dtype=torch.float32), torch.randint(0, 255, (100,), dtype=torch.uint8),
             torch.randn(3, 50, dtype=torch.float16), torch.randn(200, dtype=torch.float32), torch.randn(300)]
    held = [arena.hold(t) for t in parts]
    for t, h in zip(parts, held, strict=True):
        assert torch.equal(t, h) and h.dtype == t.dtype and h.shape == t.shape and h.data_ptr() % 64 == 0
    assert len(arena.blocks) == 2 and arena.nbytes() == 2048  # 160 + 100 + 300 + 800 bytes do not fit one
    assert held[3].untyped_storage().data_ptr() == arena.blocks[1].data_ptr()  # the first that did not fit
    assert not torch.equal(held[4], torch.zeros(300)) and held[4].untyped_storage().nbytes() == 1200  # on its own
