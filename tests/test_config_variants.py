"""config.json forms found in real checkpoints: read the way transformers reads them."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import VOCAB

import lucebox
from lucebox.errors import ConfigError

IDS = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(7)).tolist()


def variant(reference_models, tmp_path, arch, change):
    folder, _ = reference_models(arch)
    dest = tmp_path / arch
    shutil.copytree(folder, dest)
    cfg = json.loads((dest / "config.json").read_text())
    change(cfg)
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


def assert_matches_transformers(folder, dtype=torch.float64, tol=1e-6):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager").eval()
    if hasattr(ref, "set_experts_implementation"):
        ref.set_experts_implementation("eager")
    with torch.no_grad():
        expected = ref(torch.tensor([IDS])).logits[0].to(torch.float64)
    name = {torch.float64: "float64", torch.bfloat16: "bfloat16"}[dtype]
    ours = lucebox.LLM(folder, device="cpu", dtype=name).logits(IDS).to(torch.float64)
    assert (ours - expected).abs().max().item() <= tol


def test_llama3_rope_without_original_length_uses_max_positions(reference_models, tmp_path):
    folder = variant(reference_models, tmp_path, "llama",
                     lambda c: c["rope_parameters"].pop("original_max_position_embeddings"))
    assert_matches_transformers(folder)


def test_rope_theta_at_top_level_completes_rope_parameters(reference_models, tmp_path):
    def change(c):
        c["rope_parameters"] = {"rope_type": "default"}
        c["rope_theta"] = 500.0

    assert_matches_transformers(variant(reference_models, tmp_path, "llama", change))


def test_legacy_rope_scaling_form(reference_models, tmp_path):
    def change(c):
        params = c.pop("rope_parameters")
        c["rope_theta"] = params.pop("rope_theta")
        c["rope_scaling"] = {"type": params.pop("rope_type"), **params}

    assert_matches_transformers(variant(reference_models, tmp_path, "llama", change))


def test_mistral_without_sliding_window_key_gets_the_default_window(reference_models, tmp_path):
    folder = variant(reference_models, tmp_path, "mistral", lambda c: c.pop("sliding_window"))
    llm = lucebox.LLM(folder, device="cpu")
    from transformers import AutoConfig

    assert {layer.window for layer in llm.config.layers} == {AutoConfig.from_pretrained(folder).sliding_window}


def test_tied_embeddings_with_an_exported_lm_head_load(reference_models, tmp_path):
    folder, _ = reference_models("qwen3")
    dest = tmp_path / "m"
    shutil.copytree(folder, dest)
    tensors = load_file(dest / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, dest / "model.safetensors")
    assert_matches_transformers(dest)


@pytest.mark.parametrize("arch", ["laguna", "llama", "mistral", "mixtral", "qwen3", "qwen3_moe"])
def test_bfloat16_logits_match_transformers(arch, reference_models):
    folder, _ = reference_models(arch)
    assert_matches_transformers(folder, dtype=torch.bfloat16, tol=0.03)


@pytest.mark.parametrize("change, message", [
    (lambda c: c.update(num_hidden_layers="two"), "wrong type"),
    (lambda c: c.update(rms_norm_eps=None), "wrong type"),
    (lambda c: c.update(num_attention_heads=3, head_dim=16), "not a multiple of 2 KV heads"),
    (lambda c: c.update(num_experts_per_tok=99), "num_experts_per_tok"),
])
def test_malformed_config_values_are_config_errors(reference_models, tmp_path, change, message):
    arch = "mixtral" if "num_experts_per_tok" in message else "llama"
    folder = variant(reference_models, tmp_path, arch, change)
    with pytest.raises(ConfigError, match=message):
        lucebox.LLM(folder, device="cpu", load_format="dummy")
