"""llama.cpp GGUF files of Kimi Linear (`kimi-linear`): a file gets the ModelConfig and the weights of
its Hugging Face original, so its logits and greedy tokens equal the transformers twin's (float32
and Q8_0, MLA's kv_b split for llama.cpp's absorbed cache or kept whole, with and without a q
latent); quantized projections stay quantized; missing or unsupported keys and missing tensors
are refused by name."""

import dataclasses

import pytest
import torch
from gguf_bytes import STRING, UINT32, Field, read_layout, without, write_layout
from gguf_kimi_models import write_kimi_gguf
from gguf_models import VOCAB, reference_logits, relative_error
from lucebox.kernels.quant import QuantizedTensor, dequantize

import lucebox
from lucebox.checkpoints.loading import describe_model
from lucebox.errors import ConfigError, MissingTensorError
from lucebox.speculative.proposer import tensor_bytes

PROMPT = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(2)).tolist()
FLOAT64 = 1e-6  # transformers runs parts of the KDA rule in float32, even for float64 weights


@pytest.mark.parametrize("qtype,q_lora_rank,legacy", [("F32", 32, False), ("Q8_0", None, False),
                                                      ("Q8_0", 32, True)])
def test_logits_and_greedy_tokens_equal_the_transformers_twin(qtype, q_lora_rank, legacy, tmp_path):
    ref = write_kimi_gguf(qtype, tmp_path / "model.gguf", q_lora_rank=q_lora_rank, legacy=legacy)
    want = reference_logits(ref, PROMPT)
    llm = lucebox.LLM(tmp_path / "model.gguf", device="cpu", dtype=torch.float64)
    assert relative_error(llm.logits(PROMPT), want) <= FLOAT64
    with torch.no_grad():
        tokens = ref.generate(torch.tensor([PROMPT]), max_new_tokens=6, do_sample=False)[0, len(PROMPT):]
    assert llm.generate(PROMPT, max_tokens=6, ignore_eos=True).token_ids == tokens.tolist()
    if qtype == "Q8_0" and not legacy:  # the blocks kept, run in float32
        llm32 = lucebox.LLM(tmp_path / "model.gguf", device="cpu", dtype="float32")
        assert relative_error(llm32.logits(PROMPT), want) <= 1e-4


def _plain(w) -> torch.Tensor:
    return dequantize(w).double() if isinstance(w, QuantizedTensor) else w.double()


def test_a_gguf_gets_the_config_and_weights_of_its_hugging_face_original(tmp_path):
    ref = write_kimi_gguf("Q8_0", tmp_path / "model.gguf")
    ref.save_pretrained(tmp_path / "hf")
    from_gguf, from_hf = describe_model(tmp_path / "model.gguf").cfg, describe_model(tmp_path / "hf").cfg
    # GGUF keeps eps as float32, and has no checkpoint dtype
    assert dataclasses.replace(from_gguf, rms_norm_eps=from_hf.rms_norm_eps, checkpoint_dtype="float64") == from_hf
    llm = lucebox.LLM(tmp_path / "model.gguf", device="cpu", dtype=torch.float64)
    gguf_w = llm.engine.decoder.w
    held = tensor_bytes(gguf_w.values())  # views of a fused projection share its bytes
    assert llm.setup.memory["weights"] == held  # the memory plan counts the blocks kept
    hf_w = lucebox.LLM(tmp_path / "hf", device="cpu", dtype=torch.float64).engine.decoder.w
    assert gguf_w.keys() == hf_w.keys()
    for name in hf_w:
        assert torch.allclose(_plain(gguf_w[name]), hf_w[name].double(), rtol=1e-12, atol=1e-15), name
    for name in ("layers.0.kda_q", "layers.0.kda_f_b", "layers.0.kda_b", "layers.0.kda_out", "layers.1.wq_a",
                 "layers.1.wq_b", "layers.1.wkv_a", "layers.1.wo", "layers.1.experts_down"):
        assert isinstance(gguf_w[name], QuantizedTensor), name
    for name in ("layers.1.wkv_b", "layers.0.kda_conv", "layers.0.kda_A_log", "layers.0.kda_norm",
                 "layers.1.router_bias"):
        assert isinstance(gguf_w[name], torch.Tensor), name


@pytest.fixture(scope="module")
def kimi_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi") / "model.gguf"
    write_kimi_gguf("F32", path)
    return path


@pytest.mark.parametrize("key", ["kimi-linear.kda.head_dim", "kimi-linear.attention.kv_lora_rank",
                                 "kimi-linear.attention.key_length_mla", "kimi-linear.expert_gating_func",
                                 "kimi-linear.attention.head_count_kv", "kimi-linear.expert_count"])
def test_a_missing_key_is_refused_naming_it(kimi_file, tmp_path, key):
    with pytest.raises(ConfigError, match=f"lacks '{key}'"):
        lucebox.LLM(without(kimi_file, tmp_path, key=key), device="cpu")


@pytest.mark.parametrize("key,value,refusal", [
    ("kimi-linear.expert_gating_func", 1, "is 1; lucebox routes kimi-linear with a sigmoid"),
    ("kimi-linear.expert_group_count", 2, "grouped top-k routing is not implemented"),
    ("kimi-linear.attention.kv_lora_rank", 0, "kv_lora_rank"),
    ("kimi-linear.attention.head_count_kv", 1, "must list one count for each of the 4 layers"),
    ("kimi-linear.hidden_activation", "situ", "runs SiLU MLPs only"),
    ("kimi-linear.moe_latent_size", 64, "latent MoE projections")])
def test_unsupported_or_inconsistent_keys_are_refused_naming_them(kimi_file, tmp_path, key, value, refusal):
    layout = read_layout(kimi_file)
    kind = STRING if isinstance(value, str) else UINT32
    layout.fields = [f for f in layout.fields if f.key != key] + [Field(key, kind, value)]
    with pytest.raises(ConfigError, match=refusal) as refused:
        lucebox.LLM(write_layout(layout, tmp_path / "broken.gguf"), device="cpu")
    assert key in str(refused.value)


@pytest.mark.parametrize("tensor", ["blk.1.attn_k_b.weight", "blk.0.ssm_conv1d_v.weight", "blk.0.ssm_f_a.weight",
                                    "blk.2.ssm_a", "blk.3.exp_probs_b.bias", "blk.3.attn_q_a_norm.weight"])
def test_a_missing_tensor_is_refused_naming_it(kimi_file, tmp_path, tensor):
    with pytest.raises(MissingTensorError, match=tensor):
        lucebox.LLM(without(kimi_file, tmp_path, tensor=tensor), device="cpu")
