"""Qwen3.5 and Qwen3.5-MoE (text) equal transformers: the GDN input projections in their flat
order, mrope on text positions, the MoE block in every layer; image-text checkpoints load their
text model; the MTP head and the vision tower are skipped by name, any other unknown tensor refused."""

import json
import warnings

import pytest
import torch
from conftest import add_mtp_head, greedy_by_forwards, rewrite_weights
from lucebox.models import build_model_config
from safetensors.torch import load_file
from tiny_models import VOCAB, build_image_text

import lucebox
from lucebox.errors import ConfigError, LuceboxWarning, UnexpectedTensorError

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
def test_an_image_text_checkpoint_loads_its_text_model_and_says_the_vision_tower_is_not(name, tmp_path,
                                                                                       exact_reference):
    """The published checkpoints are image-text ones (ForConditionalGeneration: text_config, the
    text model under model.language_model.*, a vision tower under model.visual.*): lucebox runs the
    text model exactly as transformers' text-only forward of the whole model, and says it left the
    vision tower out."""
    ref = build_image_text(name)
    ref.save_pretrained(tmp_path)
    assert any(n.startswith("model.visual.") for n in load_file(tmp_path / "model.safetensors"))
    with pytest.warns(LuceboxWarning, match=r"model\.visual\.\*: the vision tower.*text model only"):
        llm = lucebox.LLM(tmp_path, device="cpu", dtype="float64", prefill_chunk=16)
    with torch.no_grad():
        expected = ref(torch.tensor([PROMPT])).logits[0]
    assert (llm.logits(PROMPT) - expected).abs().max().item() <= 1e-6


@pytest.mark.parametrize("name", ARCHS)
def test_an_image_text_checkpoint_still_refuses_a_tensor_no_rule_covers(name, tmp_path):
    build_image_text(name).save_pretrained(tmp_path)
    rewrite_weights(tmp_path, lambda t: t.update({"model.visual_adapter.weight": torch.zeros(2)}))
    with pytest.raises(UnexpectedTensorError, match=r"model\.visual_adapter\.weight"):
        lucebox.LLM(tmp_path, device="cpu", dtype="float64")


@pytest.mark.parametrize("name", ARCHS)
def test_the_model_s_load_passes_over_the_mtp_head_and_generation_is_unchanged(name, reference_models, model_copy):
    """The head is the drafter's (tests/test_mtp.py): the model's own load leaves it without a word."""
    folder = model_copy(name)
    add_mtp_head(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LuceboxWarning)
        with_mtp = lucebox.LLM(folder, device="cpu", dtype="float64", draft=None)
    plain = lucebox.LLM(reference_models(name)[0], device="cpu", dtype="float64")
    assert (with_mtp.generate(PROMPT[:12], max_tokens=16, ignore_eos=True).token_ids
            == plain.generate(PROMPT[:12], max_tokens=16, ignore_eos=True).token_ids)


@pytest.mark.parametrize("name", ARCHS)
def test_a_tensor_beside_the_mtp_head_is_still_refused_by_name(name, model_copy):
    folder = model_copy(name)
    add_mtp_head(folder)
    rewrite_weights(folder, lambda t: t.update({"mtp_scale": torch.zeros(2)}))  # not under mtp.
    with pytest.raises(UnexpectedTensorError, match=r"1 tensor\(s\).*: mtp_scale\."):
        lucebox.LLM(folder, device="cpu", dtype="float64")


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
