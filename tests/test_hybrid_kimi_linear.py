"""Kimi Linear (KDA + latent attention without RoPE, sigmoid-routed MoE) equals transformers,
keeps its KDA states across prefill chunks and speculation exactly, is counted by `lucebox info`
and the planner, and refuses what lucebox does not implement."""

import json

import pytest
import torch
from conftest import greedy_by_forwards, logits_gap
from draft_widths import vary_widths
from lucebox.models import build_model_config
from tiny_models import VOCAB

import lucebox
from lucebox.cli.info import model_summary
from lucebox.errors import ConfigError
from lucebox.memory.plan import recurrent_state_bytes

PROMPT = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(3)).tolist()
COMMON = dict(device="cpu", dtype="float64", prefill_chunk=16)


@pytest.fixture(scope="module")
def kimi(reference_models):
    return reference_models("kimi_linear")


@pytest.fixture(scope="module")
def llm(kimi):
    return lucebox.LLM(kimi[0], **COMMON)


@pytest.fixture(scope="module")
def hf(kimi):
    return json.loads((kimi[0] / "config.json").read_text())


def test_the_tiny_model_has_both_layer_kinds(llm):
    cfg = llm.config
    assert [layer.attention for layer in cfg.layers] == ["kda", "full", "kda", "full"]
    assert cfg.latent_attention.q_rank > 0 and cfg.head_dim == cfg.latent_attention.qk_dim == 20
    assert all(layer.rope.rotary_dim == 0 for layer in cfg.layers)  # MLA without RoPE
    assert [layer.mlp for layer in cfg.layers] == ["dense", "moe", "moe", "moe"]
    assert cfg.moe.router == "sigmoid" and cfg.moe.correction_bias and cfg.moe.shared_expert_size == 32


@pytest.mark.parametrize("name", ["kimi_linear", "kimi_linear_wide_v"])
def test_logits_match_transformers_across_prefill_chunks(reference_models, name, exact_reference):
    """kimi_linear_wide_v: no q latent, and v wider than q and k, so the cache pads q and k instead."""
    folder, ref = reference_models(name)
    llm = lucebox.LLM(folder, **COMMON)
    assert len(PROMPT) > 2 * llm.setup.prefill_chunk  # the KDA states cross two chunk boundaries
    assert logits_gap(llm, ref, PROMPT) <= 1e-6


def test_60_greedy_tokens_match_transformers(llm, kimi, exact_reference):
    ids = greedy_by_forwards(kimi[1], PROMPT[:12], 60)
    assert llm.generate(PROMPT[:12], max_tokens=60, ignore_eos=True).token_ids == ids[12:]


def test_greedy_ngram_speculation_equals_plain_decoding(kimi, llm):
    prompt = (PROMPT[:12] * 3)[:30]  # repeats, so the n-gram proposer drafts
    plain = llm.generate(prompt, max_tokens=24, ignore_eos=True).token_ids
    speculative = lucebox.LLM(kimi[0], draft="ngram", adaptive=False, **COMMON)
    vary_widths(speculative)
    out = speculative.generate(prompt, max_tokens=24, ignore_eos=True)
    assert out.token_ids == plain
    assert out.stats["width_histogram"].get(0, 0) < out.stats["rounds"]  # drafts were really verified


def test_info_and_the_planner_count_the_kda_states(llm):
    cfg = llm.config
    summary = model_summary(cfg)
    assert summary["layer_pattern"] == "RFRF"
    kda = next(entry for entry in summary["attention"] if entry["kind"] == "kda")
    conv, recurrent = cfg.linear_attention.state_elements()
    assert kda["layers"] == 2 and kda["state_elements_per_layer"] == conv + recurrent == 3 * 3 * 24 + 3 * 8 * 8
    full = next(entry for entry in summary["attention"] if entry["kind"] == "full")
    assert full["kv_bytes_per_token_per_layer"] == 2 * 4 * 20 * 2  # K and V of every head, padded to head_dim
    assert llm.setup.memory["recurrent_states"] == recurrent_state_bytes(cfg, torch.float64) > 0
    assert llm.session.cache.memory()["recurrent_states"] == recurrent_state_bytes(cfg, torch.float64)


def test_layer_kinds_come_from_linear_attn_config_when_layer_types_is_absent(hf, llm):
    without = {k: v for k, v in hf.items() if k != "layer_types"}
    assert build_model_config(without).layers == llm.config.layers
    default = {k: v for k, v in without.items() if k != "linear_attn_config"}  # every 4th from layer 4 is full
    assert [layer.attention for layer in build_model_config(default).layers] == ["kda"] * 4


@pytest.mark.parametrize("change, message", [
    ({"num_expert_group": 2, "topk_group": 1}, "grouped top-k routing"),
    ({"moe_router_activation_func": "softmax"}, "moe_router_activation_func"),
    ({"mla_use_nope": False}, "mla_use_nope"),
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"attention_bias": True}, "attention_bias"),
    ({"layer_types": ["linear_attention", "mamba"] * 2}, "mamba"),
    ({"kv_lora_rank": 0}, "kv_lora_rank"),
])
def test_unsupported_or_bad_fields_are_refused_by_name(hf, change, message):
    with pytest.raises(ConfigError, match=message):
        build_model_config({**hf, **change})


def test_a_layer_missing_from_linear_attn_config_is_refused(hf):
    lin = {**hf["linear_attn_config"], "kda_layers": [1]}  # layer 3 is in neither list
    with pytest.raises(ConfigError, match="no kind for layer 3"):
        build_model_config({**{k: v for k, v in hf.items() if k != "layer_types"}, "linear_attn_config": lin})
