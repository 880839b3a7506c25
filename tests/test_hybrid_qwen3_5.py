"""Qwen3.5 and Qwen3.5-MoE (text) equal transformers: the GDN input projections in their flat
order, mrope on text positions, the MoE block in every layer; image-text checkpoints are refused."""

import json

import pytest
import torch
from conftest import greedy_by_forwards
from lucebox.models import build_model_config
from tiny_models import VOCAB

import lucebox
from lucebox.errors import ConfigError, UnsupportedArchitectureError

PROMPT = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(5)).tolist()
ARCHS = ["qwen3_5", "qwen3_5_moe"]


@pytest.fixture(scope="module", params=ARCHS)
def model(request, reference_models):
    """(name, folder, transformers model, lucebox LLM in float64 with 16-row prefill chunks)."""
    folder, ref = reference_models(request.param)
    return request.param, folder, ref, lucebox.LLM(folder, device="cpu", dtype="float64", prefill_chunk=16)


def test_the_tiny_models_use_what_differs_from_qwen3_next(model):
    name, folder, _, llm = model
    cfg = llm.config
    assert [layer.attention for layer in cfg.layers] == ["gdn", "full", "gdn", "full"]
    assert cfg.linear_attention.projections == "flat" and cfg.linear_attention.value_heads == 4
    assert {layer.mlp for layer in cfg.layers} == ({"moe"} if name == "qwen3_5_moe" else {"dense"})
    assert cfg.layers[1].rope.rotary_dim == cfg.head_dim // 2 and cfg.norm_offset == 1.0
    rope = json.loads((folder / "config.json").read_text())["rope_parameters"]
    assert rope["mrope_section"] == [2, 1, 1]  # h and w take frequencies: equal text positions make it plain


def test_logits_match_transformers_across_prefill_chunks(model, exact_reference):
    _, _, ref, llm = model
    assert len(PROMPT) > 2 * llm.setup.prefill_chunk  # the state crosses two chunk boundaries
    with torch.no_grad():
        expected = ref(torch.tensor([PROMPT])).logits[0]
    assert (llm.logits(PROMPT) - expected).abs().max().item() <= 1e-6


def test_60_greedy_tokens_match_transformers(model, exact_reference):
    _, _, ref, llm = model
    expected = greedy_by_forwards(ref, PROMPT[:12], 60)[12:]
    assert llm.generate(PROMPT[:12], max_tokens=60, ignore_eos=True).token_ids == expected


@pytest.mark.parametrize("name", ARCHS)
def test_an_image_text_checkpoint_is_refused_naming_the_vision_tower(name, reference_models, tmp_path):
    """The published Qwen3.5 checkpoints are image-text ones (ForConditionalGeneration): refused
    before any weight is read, saying what to use instead."""
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig

    text = json.loads((reference_models(name)[0] / "config.json").read_text())
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 64}
    moe = name == "qwen3_5_moe"
    config = (Qwen3_5MoeConfig if moe else Qwen3_5Config)(text_config=text, vision_config=vision)
    config.architectures = ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"]
    config.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedArchitectureError, match="vision tower is not supported yet.*text-only"):
        lucebox.LLM(tmp_path, device="cpu", dtype="float64")


@pytest.mark.parametrize("name", ARCHS)
@pytest.mark.parametrize("field, value", [("mrope_section", [1, 2]), ("mrope_interleaved", "yes")])
def test_a_malformed_mrope_is_refused_by_name(name, field, value, reference_models):
    hf = json.loads((reference_models(name)[0] / "config.json").read_text())
    hf["rope_parameters"] = {**hf["rope_parameters"], field: value}
    with pytest.raises(ConfigError, match=field):
        build_model_config(hf)


def test_the_moe_model_needs_its_shared_expert_width(reference_models):
    hf = json.loads((reference_models("qwen3_5_moe")[0] / "config.json").read_text())
    with pytest.raises(ConfigError, match="shared_expert_intermediate_size"):
        build_model_config({**hf, "shared_expert_intermediate_size": 0})
