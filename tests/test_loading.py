"""Checkpoint loading: dtype conversion, dummy weights, and a typed error for every bad input."""

import json
import shutil

import pytest
import torch
from conftest import rewrite_weights
from safetensors.torch import load_file

import lucebox
from lucebox.errors import (
    ConfigError,
    ContextLengthError,
    CorruptCheckpointError,
    InvalidArgumentError,
    MissingTensorError,
    ModelNotFoundError,
    PickleCheckpointError,
    TensorShapeError,
    TokenizerError,
    UnexpectedTensorError,
    UnsupportedArchitectureError,
)


def test_half_precision_checkpoints_are_converted_to_the_requested_dtype(llama_copy):
    rewrite_weights(llama_copy, lambda t: t.update({k: v.to(torch.bfloat16) for k, v in t.items()}))
    stored = load_file(llama_copy / "model.safetensors")["model.embed_tokens.weight"]
    llm = lucebox.LLM(llama_copy, device="cpu", dtype="float32")
    assert llm.engine.decoder.w["embed"].dtype == torch.float32
    assert torch.equal(llm.engine.decoder.w["embed"], stored.to(torch.float32))


def test_dummy_load_needs_only_config_json(tmp_path, reference_models):
    folder, _ = reference_models("laguna")
    shutil.copy(folder / "config.json", tmp_path / "config.json")
    llm = lucebox.LLM(tmp_path, device="cpu", dtype="float32", load_format="dummy")
    out = llm.generate([1, 2, 3], max_tokens=5, ignore_eos=True)
    assert len(out.token_ids) == 5
    assert llm.engine.decoder.w["layers.1.experts_gate_up"].std().item() == pytest.approx(0.02, rel=0.1)


def test_missing_folder_and_missing_config(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        lucebox.LLM(tmp_path / "nowhere")
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        lucebox.LLM(tmp_path)


def test_unsupported_architecture_lists_the_supported_ones(llama_copy):
    cfg = json.loads((llama_copy / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (llama_copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel.*LagunaForCausalLM.*Qwen3MoeForCausalLM"):
        lucebox.LLM(llama_copy)


def test_broken_config_json(llama_copy):
    (llama_copy / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json is not valid JSON"):
        lucebox.LLM(llama_copy)
    (llama_copy / "config.json").write_text(json.dumps({"hidden_size": 4}))
    with pytest.raises(ConfigError, match="architectures"):
        lucebox.LLM(llama_copy)


def test_missing_tensor_is_named_with_its_shape(llama_copy):
    rewrite_weights(llama_copy, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(MissingTensorError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight.*\[32, 64\]"):
        lucebox.LLM(llama_copy, device="cpu")


def test_unexpected_tensor_is_named(llama_copy):
    rewrite_weights(llama_copy, lambda t: t.update({"model.layers.9.mystery.weight": torch.zeros(2)}))
    with pytest.raises(UnexpectedTensorError, match=r"model\.layers\.9\.mystery\.weight"):
        lucebox.LLM(llama_copy, device="cpu")


def test_misshaped_tensor_is_named_with_both_shapes(llama_copy):
    rewrite_weights(llama_copy, lambda t: t.update({"model.layers.0.mlp.down_proj.weight": torch.zeros(64, 95)}))
    with pytest.raises(TensorShapeError, match=r"down_proj\.weight has shape \[64, 95\].*\[64, 96\]"):
        lucebox.LLM(llama_copy, device="cpu")


@pytest.mark.parametrize("damage", ["truncated", "garbage_header", "short_data", "tiny"])
def test_corrupt_safetensors_is_refused(llama_copy, damage):
    path = llama_copy / "model.safetensors"
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage_header":
        path.write_bytes(data[:8] + b"\xff" * 64 + data[72:])
    elif damage == "short_data":
        path.write_bytes(data[:-4])
    else:
        path.write_bytes(b"\x01\x02")
    with pytest.raises(CorruptCheckpointError, match="model.safetensors: not a valid safetensors file"):
        lucebox.LLM(llama_copy, device="cpu")


def test_pickle_checkpoints_are_refused_without_unpickling(llama_copy):
    (llama_copy / "model.safetensors").unlink()
    (llama_copy / "pytorch_model.bin").write_bytes(b"this would be a pickle; it must never be opened")
    with pytest.raises(PickleCheckpointError, match="never unpickles.*safetensors"):
        lucebox.LLM(llama_copy, device="cpu")


def test_missing_shard_is_reported(reference_models, tmp_path):
    folder, _ = reference_models("qwen3_moe")
    dest = tmp_path / "m"
    shutil.copytree(folder, dest)
    sorted(dest.glob("model-*.safetensors"))[-1].unlink()
    with pytest.raises(ModelNotFoundError, match="incomplete"):
        lucebox.LLM(dest, device="cpu")


def test_context_longer_than_max_context(reference_models):
    folder, _ = reference_models("llama")
    llm = lucebox.LLM(folder, device="cpu", max_context=16)
    with pytest.raises(ContextLengthError, match="max_context is 16"):
        llm.generate(list(range(10)), max_tokens=10)
    with pytest.raises(ContextLengthError):
        llm.logits(list(range(17)))
    assert len(llm.generate(list(range(10)), max_tokens=6, ignore_eos=True).token_ids) == 6


def test_bad_arguments_are_typed(reference_models):
    folder, _ = reference_models("llama")
    with pytest.raises(InvalidArgumentError, match="dtype"):
        lucebox.LLM(folder, dtype="float8")
    with pytest.raises(InvalidArgumentError, match="load_format"):
        lucebox.LLM(folder, load_format="gguf")
    llm = lucebox.LLM(folder, device="cpu")
    with pytest.raises(InvalidArgumentError, match="outside the vocabulary"):
        llm.generate([1, 100000], max_tokens=2)
    with pytest.raises(InvalidArgumentError, match="max_tokens"):
        llm.generate([1], max_tokens=0)
    with pytest.raises(InvalidArgumentError, match="top_p"):
        llm.generate([1], max_tokens=2, top_p=0.0)


def test_model_without_tokenizer_works_on_ids_and_refuses_text(reference_models):
    folder, _ = reference_models("llama")
    llm = lucebox.LLM(folder, device="cpu")
    out = llm.generate([1, 2], max_tokens=3, ignore_eos=True)
    assert len(out.token_ids) == 3
    with pytest.raises(TokenizerError, match="no tokenizer"):
        _ = out.text
    with pytest.raises(TokenizerError, match="tokenizer"):
        llm.generate("hello", max_tokens=2)
    with pytest.raises(TokenizerError):
        _ = llm.tokenizer
