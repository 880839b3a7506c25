"""The memory planner under a VRAM budget: Laguna XS.2 at 256K in 24 GiB (int4, `select`), what
it says at 16 GiB, how it shrinks the pool and prefill chunk to fit, `lucebox info --vram` and
`LLM(vram_budget=...)`."""

import json

import pytest
import torch
from conftest import EXAMPLES

import lucebox
from lucebox.arguments import size
from lucebox.caches import CacheSettings
from lucebox.checkpoints.loading import describe_model
from lucebox.cli import main
from lucebox.errors import InsufficientMemoryError, InvalidArgumentError
from lucebox.memory.vram import plan_for_budget

GIB = 2**30
XS2 = describe_model(EXAMPLES / "laguna-xs2").cfg


def test_laguna_xs2_at_256k_fits_24_gib_with_int4_weights_and_select():
    plan = plan_for_budget(XS2, 24 * GIB, 262144, torch.bfloat16, "int4")
    assert plan.fits and plan.device_total <= 24 * GIB
    assert plan.choices == {"kv_pool_tokens": 8192, "prefill_chunk": 2048, "kv_policy": "select",
                            "max_context": 262144, "quantization": "int4", "dtype": "bfloat16", "kv_dtype": "auto",
                            "experts_on_host": False, "expert_slots": None, "lm_head": "float", "parallel": 1,
                            "lm_head_bytes_per_token": XS2.vocab_size * XS2.hidden_size * 2}
    assert not plan.notes  # the defaults fit: nothing given up
    # Weights are most of it: about 33.4B parameters at 4 bits plus scales, bf16 embeddings and head.
    assert 16 * GIB < plan.device["weights"] < 18 * GIB
    # The KV that leaves the pool: 10 full layers x 256K tokens x 4096 bytes, and each layer's staging
    # rows for the 120 chunks one re-selection may load (select_k at a pool of 128 chunks).
    assert plan.host["kv_host"] == 10 * (262144 + 120 * 64) * 4096
    assert all(size >= 0 for size in plan.device.values()) and plan.device["graph_pools"] > 0


def test_at_16_gib_laguna_xs2_moves_its_experts_to_host_memory():
    plan = plan_for_budget(XS2, 16 * GIB, 262144, torch.bfloat16, "int4")
    assert plan.fits and plan.device_total <= 16 * GIB
    assert plan.choices["experts_on_host"] and 8 <= plan.choices["expert_slots"] < 256
    # The default pool and prefill chunk are kept: the experts gave way instead.
    assert (plan.choices["kv_pool_tokens"], plan.choices["prefill_chunk"]) == (8192, 2048)
    assert 15 * GIB < plan.host["experts_host"] < 15.2 * GIB
    slots = plan.choices["expert_slots"]
    assert plan.device["expert_cache"] == slots * plan.host["experts_host"] // 256
    (moved,) = plan.notes
    assert f"routed experts (15.1 GiB) moved to host memory; the device caches {slots} of each" in moved
    # One slot more would not fit at that pool and prefill chunk: the cache takes what is left.
    bigger = plan_for_budget(XS2, 16 * GIB, 262144, torch.bfloat16, "int4", kv_pool_tokens=8192, prefill_chunk=2048,
                             experts_on_host=True, expert_slots=slots + 1)
    assert not bigger.fits


def test_at_16_gib_it_says_why_laguna_xs2_cannot_fit_with_every_expert_on_the_device():
    plan = plan_for_budget(XS2, 16 * GIB, 262144, torch.bfloat16, "int4", experts_on_host=False)
    assert not plan.fits
    assert plan.choices["kv_pool_tokens"] < 8192 and plan.choices["prefill_chunk"] == 256  # it tried the smallest
    (why,) = plan.notes
    assert "the weights alone need 16.7 GiB of the 16.0 GiB budget" in why
    assert "routed experts are 15.1 GiB" in why and "experts_on_host would move" in why
    tiny = plan_for_budget(XS2, 1 * GIB, 262144, torch.bfloat16, "int4")  # not even with the experts moved
    assert not tiny.fits and "even with the routed experts (15.1 GiB) in host memory" in tiny.notes[-1]


def test_a_tight_budget_lowers_the_prefill_chunk_then_the_pool():
    def total(budget=24 * GIB, **fixed):
        return plan_for_budget(XS2, budget, 262144, torch.bfloat16, "int4", experts_on_host=False, **fixed)

    roomy = total()
    prefill_only = total(roomy.device_total - 1)  # a little less room: the prefill chunk gives way
    assert prefill_only.fits and prefill_only.choices["kv_pool_tokens"] == 8192
    assert prefill_only.choices["prefill_chunk"] < 2048 and prefill_only.notes[0].startswith("prefill chunk lowered")
    tight = total(kv_pool_tokens=8192, prefill_chunk=256).device_total - 1  # less than the pool needs at any chunk
    pool_too = total(tight)
    assert pool_too.fits and pool_too.device_total <= tight and pool_too.choices["kv_pool_tokens"] < 8192
    assert pool_too.notes[0].startswith("KV pool lowered from 8192")
    assert not total(1 * GIB).fits  # and the smallest plan has its limits
    # What the caller fixes is kept: with the pool given, only the prefill chunk can give way.
    assert not total(tight, kv_pool_tokens=8192).fits


@pytest.mark.parametrize("model, context", [("laguna-xs2", 262144), ("laguna-tiny", 4096)])
def test_every_plan_that_fits_is_one_the_engine_accepts(model, context):
    """Between the smallest plan and the default one, at 200 budgets: the pool always holds what
    one prefill chunk writes (and the `select` tail), as `KVFlashSettings.validate` demands."""
    cfg = describe_model(EXAMPLES / model).cfg
    low, high = (plan_for_budget(cfg, b, context, torch.bfloat16, "int4", largest_prefill=512).device_total
                 for b in (1, 10**12))
    for budget in range(low, high + 1, max(1, (high - low) // 200)):
        plan = plan_for_budget(cfg, budget, context, torch.bfloat16, "int4", largest_prefill=512)
        assert plan.fits
        c = plan.choices
        CacheSettings(context, max(c["prefill_chunk"], 16), c["kv_policy"], c["kv_pool_tokens"]).kvflash().validate()


@pytest.mark.parametrize("text, expected", [("24GiB", 24 * GIB), ("16 GB", 16 * 10**9), ("512mib", 512 * 2**20),
                                        ("1.5GiB", int(1.5 * GIB)), (1000, 1000)])
def test_sizes_read_like_people_write_them(text, expected):
    assert size("vram_budget", text) == expected


@pytest.mark.parametrize("text", ["24Gx", "", "-1GiB", "0", "GiB"])
def test_a_size_that_is_not_one_is_refused(text):
    with pytest.raises(InvalidArgumentError, match="is not a size; write it like 24GiB"):
        size("vram_budget", text)


def test_info_prints_the_plan_as_json_with_a_top_level_fits(capsys):
    args = ["info", str(EXAMPLES / "laguna-xs2"), "--vram", "24GiB", "--quantization", "int4", "--ctx", "262144"]
    assert main([*args, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["fits"] is True and info["vram_plan"]["choices"]["kv_policy"] == "select"
    assert set(info["vram_plan"]["device_bytes"]) == {"weights", "expert_cache", "ring_caches", "kv_pool",
                                                       "kv_chunk_summaries", "drafter", "activations", "graph_pools"}
    assert info["vram_plan"]["device_total_bytes"] == sum(info["vram_plan"]["device_bytes"].values())
    assert main([*args[:3], "16GiB", *args[4:]]) == 0  # text: the plan, then the model
    out = capsys.readouterr().out
    assert "fits" in out and "moved to host memory" in out and "experts in host" in out
    assert main([*args[:3], "1GiB", *args[4:]]) == 0
    out = capsys.readouterr().out
    assert "does not fit" in out and "weights alone need" in out
    assert main([*args[:3], "24Gx"]) == 2
    assert "--vram '24Gx' is not a size" in capsys.readouterr().err


def test_the_engine_takes_the_planners_choices_and_refuses_what_cannot_fit(reference_models):
    folder, _ = reference_models("laguna")
    with pytest.raises(InsufficientMemoryError, match=r"vram_budget=0.0GiB: does not fit: the weights alone need"):
        lucebox.LLM(folder, device="cpu", dtype="float32", vram_budget="100KiB")
    cfg = describe_model(folder).cfg
    roomy = plan_for_budget(cfg, GIB, 4096, torch.float32, graphs=False, largest_prefill=512)
    smallest = plan_for_budget(cfg, 1, 4096, torch.float32, graphs=False, largest_prefill=512)
    tight = (roomy.device_total + smallest.device_total) // 2
    llm = lucebox.LLM(folder, device="cpu", dtype="float32", max_context=4096, vram_budget=tight)
    assert llm.vram_plan.fits and llm.vram_plan.notes
    assert llm.setup.cache.kv_pool_tokens == llm.vram_plan.choices["kv_pool_tokens"]
    assert llm.setup.prefill_chunk == llm.vram_plan.choices["prefill_chunk"]
    assert (llm.setup.prefill_chunk, llm.setup.cache.kv_pool_tokens) != (512, 4096)  # something gave way
    assert llm.generate([1, 2, 3], max_tokens=3, ignore_eos=True).token_ids  # and it runs


def test_commands_with_vram_print_the_plan(reference_models, capsys):
    folder, _ = reference_models("laguna")
    args = ["generate", str(folder), "--token-ids", "1,2,3", "--max-tokens", "2", "--device", "cpu", "--ctx", "1024",
            "--vram", "1GiB", "--ignore-eos"]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "VRAM plan for 1024 tokens" in err and "fits" in err and "chosen: kv_policy" in err


def test_the_allocator_cap_leaves_room_for_what_lives_outside_it(monkeypatch):
    """`--vram 24GiB` on a 24 GiB card: the CUDA context and modules (measured at start-up) come
    out of the budget before the plan and the allocator's cap, or the card would be overcommitted."""
    from types import SimpleNamespace

    from lucebox.engine import setup
    from lucebox.engine.config import EngineConfig

    capped = []
    monkeypatch.setattr(setup, "memory_outside_allocator", lambda device: 2 * GIB)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=24 * GIB))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda fraction, device: capped.append(fraction))
    config = EngineConfig(EXAMPLES / "laguna-xs2", vram_budget="24GiB", max_context=262144, quantization="int4")
    plan = setup.plan_vram(config, XS2, torch.device("cuda"), torch.bfloat16, "triton", "int4", None, None)
    assert plan.fits and plan.budget == 22 * GIB and plan.device_total <= 22 * GIB
    assert capped == [22 / 24] and "2.00 GiB of the budget is outside torch's allocator" in plan.notes[0]
    monkeypatch.setattr(setup, "memory_outside_allocator", lambda device: 25 * GIB)
    with pytest.raises(InsufficientMemoryError, match="already take 25.0 GiB"):
        setup.plan_vram(config, XS2, torch.device("cuda"), torch.bfloat16, "triton", "int4", None, None)
