"""GLM-4.5 (`glm4_moe`) beyond the parity tests every architecture runs (tests/test_parity.py): the
tiny reference uses every feature those tests rely on, config.json's defaults are transformers',
the model loads beside an incomplete multi-token-prediction layer, and speculation is lossless."""

import json
import shutil

import pytest
import torch
from lucebox.models import build_model_config
from safetensors.torch import load_file, save_file

import lucebox
from lucebox.errors import ConfigError

PROMPT = [3, 17, 42, 99, 5, 64, 8, 120, 33, 7]


def test_the_glm4_moe_reference_exercises_every_feature(reference_models):
    folder, ref = reference_models("glm4_moe")
    cfg = lucebox.LLM(folder, device="cpu", dtype="float32").config
    assert cfg.layers[0].rope.rotary_dim == cfg.head_dim // 2
    assert cfg.attention_bias and not cfg.attention_output_bias and cfg.qk_norm
    assert [layer.mlp for layer in cfg.layers] == ["dense", "moe", "moe"]
    assert cfg.moe.router == "sigmoid" and cfg.moe.routed_scaling == 2.5 and cfg.moe.shared_expert_size == 32
    assert ref.model.layers[1].mlp.gate.e_score_correction_bias.abs().min() > 0
    assert ref.model.layers[0].self_attn.o_proj.bias is None and ref.model.layers[0].self_attn.q_proj.bias is not None


def test_config_defaults_are_transformers_and_grouped_routing_is_refused(reference_models):
    hf = json.loads((reference_models("glm4_moe")[0] / "config.json").read_text())
    hf.pop("rope_parameters", None)
    assert build_model_config(hf).layers[0].rope.rotary_dim == 8  # half of head_dim 16, as transformers fills in
    assert build_model_config({**hf, "partial_rotary_factor": 1.0}).layers[0].rope.rotary_dim == 16
    with pytest.raises(ConfigError, match="grouped top-k routing"):
        build_model_config({**hf, "n_group": 2, "topk_group": 1})
    with pytest.raises(ConfigError, match="use_qk_norm"):
        build_model_config({**hf, "use_qk_norm": "yes"})


def test_an_incomplete_mtp_layer_after_the_model_s_is_left_unread_with_a_warning(reference_models, tmp_path):
    """(A whole one is the drafter: tests/test_mtp_glm.py.) Any other stray tensor stops the load."""
    folder = tmp_path / "glm"
    shutil.copytree(reference_models("glm4_moe")[0], folder)
    weights = load_file(folder / "model.safetensors")
    n = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    extra = {f"model.layers.{n}.{name}": torch.zeros(4, 4) for name in ("eh_proj.weight", "enorm.weight",
                                                                        "shared_head.norm.weight")}
    save_file({**weights, **extra}, folder / "model.safetensors")
    with pytest.warns(Warning, match="MTP head is incomplete"):
        with_head = lucebox.LLM(folder, device="cpu", dtype="float64")
    plain = lucebox.LLM(reference_models("glm4_moe")[0], device="cpu", dtype="float64")
    assert torch.equal(with_head.logits(PROMPT), plain.logits(PROMPT))
    save_file({**weights, "model.layers.9.stray.weight": torch.zeros(2)}, folder / "model.safetensors")
    with pytest.raises(lucebox.LuceboxError, match="stray"):
        lucebox.LLM(folder, device="cpu", dtype="float64")


@pytest.mark.parametrize("draft", ["ngram", "model"])
def test_speculation_equals_plain_decoding(reference_models, draft):
    """n-gram copies (a repeating prompt) and a draft model (the model drafting for itself: drafts
    kept; then a random other one: drafts refused)."""
    folder = reference_models("glm4_moe")[0]
    options = dict(device="cpu", dtype="float64", adaptive=False)
    prompt = PROMPT * 3
    plain = lucebox.LLM(folder, draft=None, **options).generate(prompt, max_tokens=40, ignore_eos=True).token_ids
    drafters = [str(folder), str(reference_models("qwen3_moe")[0])] if draft == "model" else ["ngram"]
    for i, drafter in enumerate(drafters):
        got = lucebox.LLM(folder, draft=drafter, **options).generate(prompt, max_tokens=40, ignore_eos=True)
        assert got.token_ids == plain
        assert (got.stats["acceptance_length"] > 1) == (i == 0)


def test_the_triton_engine_matches_the_torch_engine(reference_models):
    """q/k/v biases in the fused projection without an o bias, partial RoPE, QK norms and the sigmoid
    router with shared experts, through the Triton kernels (the interpreter on the CPU)."""
    from test_triton_backend import _assert_same_greedy_tokens_and_close_logits, _pair

    torch_llm, triton_llm = _pair(reference_models("glm4_moe")[0])
    assert triton_llm.setup.backend == "triton"
    _assert_same_greedy_tokens_and_close_logits(torch_llm, triton_llm, PROMPT * 2, 6)


def test_a_config_that_does_not_declare_the_mtp_layer_still_loads_beside_it(mtp_folder, tmp_path):
    """transformers reads a missing num_nextn_predict_layers as 1: the checkpoint's layer is the head."""
    folder = tmp_path / "glm"
    shutil.copytree(mtp_folder("glm4_moe"), folder)
    config = json.loads((folder / "config.json").read_text())
    config.pop("num_nextn_predict_layers")
    (folder / "config.json").write_text(json.dumps(config))
    assert lucebox.LLM(folder, device="cpu", dtype="float64", draft=None).generate(PROMPT, max_tokens=2).token_ids
    assert lucebox.LLM(folder, device="cpu", dtype="float64").proposer.name == "mtp"
