"""llama.cpp GGUF files of GLM-4.5 (`glm4moe`): a file gets the ModelConfig and the weights of its
Hugging Face original, so its logits and greedy tokens equal the transformers twin's (float32 and
Q8_0); quantized projections stay quantized; the multi-token-prediction block after the model's is
the model's drafter, the very head its Hugging Face original drafts with; unsupported keys are
refused by name."""

import dataclasses

import pytest
import torch
from conftest import add_nextn_layer
from gguf_bytes import UINT32, Field, read_layout, write_layout
from gguf_glm_models import with_nextn_block, write_glm_gguf
from gguf_models import VOCAB, reference_logits, relative_error
from lucebox.kernels.quant import QuantizedTensor
from mtp_cases import head_over, target_hidden

import lucebox
from lucebox.checkpoints.loading import describe_model
from lucebox.errors import ConfigError

PROMPT = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(2)).tolist()


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_logits_and_greedy_tokens_equal_the_transformers_twin(qtype, tmp_path):
    ref = write_glm_gguf(qtype, tmp_path / "model.gguf")
    want = reference_logits(ref, PROMPT)
    llm = lucebox.LLM(tmp_path / "model.gguf", device="cpu", dtype=torch.float64)
    assert relative_error(llm.logits(PROMPT), want) <= 1e-6
    with torch.no_grad():
        tokens = ref.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False)[0, len(PROMPT):]
    assert llm.generate(PROMPT, max_tokens=8, ignore_eos=True).token_ids == tokens.tolist()
    if qtype == "Q8_0":  # the blocks kept
        w = llm.engine.decoder.w
        assert isinstance(w["layers.1.experts_down"], QuantizedTensor) and isinstance(w["layers.0.wqkv"],
                                                                                      QuantizedTensor)


def test_a_gguf_gets_the_config_of_its_hugging_face_original(tmp_path):
    ref = write_glm_gguf("F32", tmp_path / "model.gguf")
    ref.save_pretrained(tmp_path / "hf")
    from_gguf, from_hf = describe_model(tmp_path / "model.gguf").cfg, describe_model(tmp_path / "hf").cfg
    # GGUF keeps eps as float32, and has no checkpoint dtype
    assert dataclasses.replace(from_gguf, rms_norm_eps=from_hf.rms_norm_eps, checkpoint_dtype="float64") == from_hf
    assert from_gguf.layers[0].rope.rotary_dim == from_gguf.head_dim // 2 and not from_gguf.attention_output_bias


@pytest.mark.parametrize("key, value, message", [
    ("glm4moe.expert_gating_func", 1, "lucebox routes glm4moe with a sigmoid"),
    ("glm4moe.nextn_predict_layers", 9, "not fewer than 'glm4moe.block_count'"),
    ("glm4moe.expert_group_used_count", 2, "grouped top-k routing"),
])
def test_unsupported_keys_are_refused_naming_them(tmp_path, key, value, message):
    write_glm_gguf("F32", tmp_path / "model.gguf")
    layout = read_layout(tmp_path / "model.gguf")
    fields = [f for f in layout.fields if f.key != key] + [Field(key, UINT32, value)]
    write_layout(dataclasses.replace(layout, fields=fields), tmp_path / "bad.gguf")
    with pytest.raises(ConfigError, match=message):
        lucebox.LLM(tmp_path / "bad.gguf", device="cpu")


def test_the_mtp_block_is_the_drafter_its_hugging_face_original_drafts_with(tmp_path):
    ref = write_glm_gguf("F32", tmp_path / "model.gguf")
    ref.save_pretrained(tmp_path / "hf")
    add_nextn_layer(tmp_path / "hf")
    with_nextn_block(tmp_path / "model.gguf", tmp_path / "hf")
    from_gguf, from_hf = (lucebox.LLM(tmp_path / name, device="cpu", dtype=torch.float64)
                          for name in ("model.gguf", "hf"))
    with torch.no_grad():
        logits = [llm.proposer.head.logits(head_over(llm.proposer.head, PROMPT[1:], target_hidden(llm, PROMPT)[:-1]))
                  for llm in (from_gguf, from_hf)]
    assert relative_error(*logits) <= 1e-9
    options = dict(max_tokens=30, ignore_eos=True, logit_bias={5: 30.0, 6: 30.0, 7: 30.0})
    plain = lucebox.LLM(tmp_path / "model.gguf", device="cpu", dtype=torch.float64, draft=None)
    got = from_gguf.generate(PROMPT, **options)
    assert got.token_ids == plain.generate(PROMPT, **options).token_ids and got.stats["drafter"] == "mtp"
