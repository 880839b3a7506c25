"""llama.cpp GGUF files of the Gated DeltaNet hybrids (qwen3next, qwen35, qwen35moe): a file gets the
ModelConfig and the weights of its Hugging Face original, so its logits and greedy tokens equal the
transformers twin's; quantized projections stay quantized; a file missing an ssm key or tensor is
refused naming it."""

import dataclasses

import pytest
import torch
from gguf_bytes import FLOAT32, read_layout, without, write_layout
from gguf_hybrid_models import write_hybrid_gguf
from gguf_models import VOCAB, reference_logits, relative_error
from lucebox.kernels.quant import QuantizedTensor, dequantize

import lucebox
from lucebox.checkpoints.loading import describe_model
from lucebox.errors import ConfigError, CorruptCheckpointError, MissingTensorError
from lucebox.speculative.proposer import tensor_bytes

PROMPT = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(2)).tolist()
FLOAT64 = 1e-6  # transformers' Gated DeltaNet runs parts of its rule in float32, even for float64 weights


@pytest.mark.parametrize("arch,qtype,legacy", [("qwen3next", "F32", False), ("qwen3next", "Q6_K", True),
                                               ("qwen35", "Q8_0", False), ("qwen35moe", "Q4_K", False)])
def test_logits_and_greedy_tokens_equal_the_transformers_twin(arch, qtype, legacy, tmp_path):
    """Qwen3-Next as today's converter splits in_proj_qkvz (and as older ones kept it, ssm_in);
    Qwen3.5 with its value heads in llama.cpp's tiled order; each with its +1 norms and -exp(A_log)."""
    ref = write_hybrid_gguf(arch, qtype, tmp_path / "model.gguf", legacy=legacy)
    want = reference_logits(ref, PROMPT)
    llm = lucebox.LLM(tmp_path / "model.gguf", device="cpu", dtype=torch.float64)
    assert relative_error(llm.logits(PROMPT), want) <= FLOAT64
    with torch.no_grad():
        tokens = ref.generate(torch.tensor([PROMPT]), max_new_tokens=6, do_sample=False)[0, len(PROMPT):]
    assert llm.generate(PROMPT, max_tokens=6, ignore_eos=True).token_ids == tokens.tolist()
    if qtype == "Q8_0":
        llm32 = lucebox.LLM(tmp_path / "model.gguf", device="cpu", dtype="float32")
        assert relative_error(llm32.logits(PROMPT), want) <= 1e-4


def _plain(w) -> torch.Tensor:
    return dequantize(w).double() if isinstance(w, QuantizedTensor) else w.double()


@pytest.mark.parametrize("arch", ["qwen3next", "qwen35moe"])
def test_a_gguf_gets_the_config_and_weights_of_its_hugging_face_original(arch, tmp_path):
    ref = write_hybrid_gguf(arch, "Q8_0", tmp_path / "model.gguf")
    ref.save_pretrained(tmp_path / "hf")
    from_gguf, from_hf = describe_model(tmp_path / "model.gguf").cfg, describe_model(tmp_path / "hf").cfg
    # GGUF keeps eps as float32, and has no checkpoint dtype
    assert dataclasses.replace(from_gguf, rms_norm_eps=from_hf.rms_norm_eps, checkpoint_dtype="float64") == from_hf
    assert from_gguf.rms_norm_eps == pytest.approx(from_hf.rms_norm_eps, rel=1e-7)
    llm = lucebox.LLM(tmp_path / "model.gguf", device="cpu", dtype=torch.float64)
    gguf_w = llm.engine.decoder.w
    held = tensor_bytes(gguf_w.values())  # views of a fused projection share its bytes
    assert llm.setup.memory["weights"] == held  # the memory plan counts the blocks kept
    hf_w = lucebox.LLM(tmp_path / "hf", device="cpu", dtype=torch.float64).engine.decoder.w
    assert gguf_w.keys() == hf_w.keys()
    for name in hf_w:
        assert torch.allclose(_plain(gguf_w[name]), hf_w[name].double(), rtol=1e-12, atol=1e-15), name
    for name in ("layers.0.gdn_qkvz", "layers.0.gdn_ba", "layers.0.gdn_out", "layers.1.wq", "layers.1.experts_down"):
        assert isinstance(gguf_w[name], QuantizedTensor), name
    for name in ("layers.0.gdn_A_log", "layers.0.gdn_conv", "layers.0.gdn_norm", "layers.0.mlp_norm",
                 "layers.1.shared_gate"):
        assert isinstance(gguf_w[name], torch.Tensor), name


@pytest.fixture(scope="module")
def qwen35_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen35") / "model.gguf"
    write_hybrid_gguf("qwen35", "Q8_0", path)
    return path


@pytest.mark.parametrize("key", ["qwen35.ssm.conv_kernel", "qwen35.ssm.state_size", "qwen35.ssm.group_count",
                                 "qwen35.ssm.time_step_rank", "qwen35.ssm.inner_size"])
def test_a_missing_ssm_key_is_refused_naming_it(qwen35_file, tmp_path, key):
    with pytest.raises(ConfigError, match=f"lacks '{key}'"):
        lucebox.LLM(without(qwen35_file, tmp_path, key=key), device="cpu")


@pytest.mark.parametrize("key,value,refusal", [
    ("qwen35.ssm.group_count", 3, "is not a multiple of linear_num_key_heads 3"),
    ("qwen35.ssm.inner_size", 258, "'qwen35.ssm.inner_size' \\(258\\) is not a whole number"),
    ("qwen35.ssm.conv_kernel", 0, "linear_conv_kernel_dim"),
    ("qwen35.ssm.state_size", float("inf"), "'qwen35.ssm.state_size' is 'inf'; it must be a whole number"),
    ("qwen35.full_attention_interval", 1.5, "'qwen35.full_attention_interval' is '1.5'; it must be a whole")])
def test_inconsistent_ssm_sizes_are_refused_naming_the_key(qwen35_file, tmp_path, key, value, refusal):
    layout = read_layout(qwen35_file)
    field = layout.get(key)
    field.kind, field.value = (FLOAT32 if isinstance(value, float) else field.kind), value
    with pytest.raises(ConfigError, match=refusal) as refused:
        lucebox.LLM(write_layout(layout, tmp_path / "broken.gguf"), device="cpu")
    assert key in str(refused.value)


@pytest.mark.parametrize("tensor", ["blk.0.ssm_a", "blk.2.ssm_alpha.weight", "blk.0.attn_gate.weight",
                                    "blk.1.post_attention_norm.weight"])
def test_a_missing_tensor_is_refused_naming_it(qwen35_file, tmp_path, tensor):
    with pytest.raises(MissingTensorError, match=tensor):
        lucebox.LLM(without(qwen35_file, tmp_path, tensor=tensor), device="cpu")


def test_mtp_layers_and_a_non_negative_decay_are_refused(qwen35_file, tmp_path):
    layout = read_layout(qwen35_file)
    layout.get("qwen35.full_attention_interval").key = "qwen35.nextn_predict_layers"
    with pytest.raises(ConfigError, match="'qwen35.nextn_predict_layers' is 2"):
        lucebox.LLM(write_layout(layout, tmp_path / "mtp.gguf"), device="cpu")
    layout = read_layout(qwen35_file)
    record = layout.tensor("blk.0.ssm_a")  # F32: flip the sign bit of its first value
    data = bytearray(layout.data)
    data[record.offset + 3] ^= 0x80
    layout.data = bytes(data)
    with pytest.raises(CorruptCheckpointError, match="blk.0.ssm_a holds values >= 0"):
        lucebox.LLM(write_layout(layout, tmp_path / "positive.gguf"), device="cpu")
