"""lucebox equals transformers on tiny random checkpoints of every supported architecture."""

import pytest
import torch
from conftest import ARCHITECTURES
from tiny_models import VOCAB, WINDOW

import lucebox

PROMPT = torch.randint(0, VOCAB, (20,), generator=torch.Generator().manual_seed(1)).tolist()


def reference_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_logits_match_transformers_float64(arch, reference_models, exact_reference):
    """(exact_reference: the hybrids' float32 parts in transformers run in float64.)"""
    folder, ref = reference_models(arch)
    llm = lucebox.LLM(folder, device="cpu", dtype="float64", prefill_chunk=7)  # several prefill chunks
    ours = llm.logits(PROMPT * 2)
    assert ours.dtype == torch.float64 and ours.shape == (40, VOCAB)
    assert (ours - reference_logits(ref, PROMPT * 2)).abs().max().item() <= 1e-6


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_logits_match_transformers_float32(arch, reference_models):
    folder, ref = reference_models(arch)
    ours = lucebox.LLM(folder, device="cpu", dtype="float32").logits(PROMPT)
    assert ours.dtype == torch.float32
    assert (ours.double() - reference_logits(ref, PROMPT)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_64_greedy_tokens_match_transformers_generate(arch, reference_models):
    folder, ref = reference_models(arch)
    assert len(PROMPT) + 64 > 5 * WINDOW  # crosses the sliding window several times
    with torch.no_grad():
        expected = ref.generate(torch.tensor([PROMPT]), max_new_tokens=64, do_sample=False,
                                eos_token_id=None, pad_token_id=0)[0, len(PROMPT):].tolist()
    got = lucebox.LLM(folder, device="cpu", dtype="float64").generate(PROMPT, max_tokens=64, ignore_eos=True)
    assert got.token_ids == expected
    assert got.finish_reason == "length"


def test_laguna_reference_exercises_every_feature(reference_models):
    """The Laguna parity tests above mean something only if the tiny model uses every feature."""
    folder, ref = reference_models("laguna")
    cfg = lucebox.LLM(folder, device="cpu", dtype="float32").config
    full = [layer for layer in cfg.layers if layer.attention == "full"]
    sliding = [layer for layer in cfg.layers if layer.is_sliding]
    assert full and sliding and full[0].rope.kind == "yarn" and full[0].rope.rotary_dim < cfg.head_dim
    assert full[0].num_heads != sliding[0].num_heads
    assert cfg.attention_gate == "element"
    assert cfg.moe.routed_scaling != 1.0 and cfg.moe.logit_softcap > 0
    assert {layer.mlp for layer in cfg.layers} == {"dense", "moe"} and cfg.moe.shared_expert_size > 0
    bias = ref.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.abs().min() > 0


def test_sharded_checkpoint_is_read(reference_models):
    folder, _ = reference_models("qwen3_moe")
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("*.safetensors"))) > 1


def test_tied_embeddings_have_no_lm_head(reference_models):
    folder, _ = reference_models("qwen3")
    llm = lucebox.LLM(folder, device="cpu", dtype="float32")
    assert llm.config.tie_word_embeddings and "lm_head" not in llm.engine.decoder.w
