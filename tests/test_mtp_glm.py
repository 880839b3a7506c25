"""GLM-4.5's own MTP layer as the drafter (DeepSeek-V3's layout: `model.layers.{n}.` after the
model's n layers, with eh_proj, enorm, hnorm and shared_head; `models/mtp.py` layout "deepseek"):
found by draft='auto', exact as a head (against transformers' own decoder layer and plain
RMSNorms), and lossless in greedy and seeded sampled speculation."""

import pytest
import torch
from mtp_cases import head_over, target_hidden
from safetensors.torch import load_file

import lucebox

PROMPT = [5, 9, 17, 33, 2, 64, 100, 7, 7, 21, 90, 3, 44, 18, 120, 6, 75, 31, 12, 58, 99, 4, 27, 81]
BIAS = {5: 30.0, 6: 30.0, 7: 30.0}  # predictable enough that the random head's drafts are kept some of the time


def _llm(folder, **options):
    return lucebox.LLM(folder, device="cpu", dtype="float64", prefill_chunk=8, **options)


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def test_auto_drafts_with_the_layer_after_the_model_s_and_a_model_without_one_has_no_drafter(mtp_folder,
                                                                                                 reference_models):
    llm = _llm(mtp_folder("glm4_moe"))
    assert llm.proposer.head.cfg.layers[0].mlp == "moe"
    assert llm.generate(PROMPT, max_tokens=4, ignore_eos=True).stats["drafter"] == "mtp"
    plain = _llm(reference_models("glm4_moe")[0])  # declares a layer (num_nextn_predict_layers 1), holds none
    assert plain.generate(PROMPT, max_tokens=4).stats["drafter"] is None


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 11}], ids=["greedy", "seeded"])
def test_speculation_with_the_head_commits_plain_decoding_s_tokens(mtp_folder, sampling):
    folder = mtp_folder("glm4_moe")
    options = {"max_tokens": 40, "ignore_eos": True, "logit_bias": BIAS, **sampling}
    spec = _llm(folder, adaptive=False, draft_k=3)
    spec.proposer.lookup = None  # the head's own drafts
    got = spec.generate(PROMPT, **options)
    assert got.token_ids == _llm(folder, draft=None).generate(PROMPT, **options).token_ids
    assert got.stats["drafter"] == "mtp" and got.stats["acceptance_length"] > 1


def test_the_head_runs_as_transformers_runs_its_layer(mtp_folder, reference_models):
    """The head's math, independently: enorm and hnorm (plain RMSNorms), the embedding first in the
    concatenation, eh_proj, the checkpoint's layer run by transformers (the test head's layer is a
    copy of the model's last), shared_head.norm and the model's LM head."""
    folder = mtp_folder("glm4_moe")
    ref = reference_models("glm4_moe")[1]
    n = ref.config.num_hidden_layers
    w = {name: t.double() for name, t in load_file(folder / "model.safetensors").items()
         if name.startswith(f"model.layers.{n}.")}
    p, eps = f"model.layers.{n}.", ref.config.rms_norm_eps
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        hidden = ref.model(ids).last_hidden_state[0]  # after the final norm
        embedded = ref.model.embed_tokens(ids[:, 1:])[0]
        x = torch.cat([_norm(embedded, w[p + "enorm.weight"], eps), _norm(hidden[:-1], w[p + "hnorm.weight"], eps)], -1)
        x = (x @ w[p + "eh_proj.weight"].T)[None]
        positions = torch.arange(x.shape[1])[None]
        causal = torch.full((x.shape[1], x.shape[1]), float("-inf"), dtype=x.dtype).triu(1)[None, None]
        out = ref.model.layers[n - 1](x, attention_mask=causal, position_ids=positions,
                                      position_embeddings=ref.model.rotary_emb(x, positions))
        out = out[0] if isinstance(out, tuple) else out
        expected = ref.lm_head(_norm(out[0], w[p + "shared_head.norm.weight"], eps))
        llm = _llm(folder)
        head = llm.engine.proposer.head
        got = head.logits(head_over(head, PROMPT[1:], target_hidden(llm, PROMPT)[:-1]))
    assert (got - expected).abs().max().item() <= 1e-6  # as the models' own logits compare
