"""GLM-4.5 / 4.6 (Zhipu, `glm4_moe`; GLM-4.5-Air): Llama-style attention with biases on q, k and v
(none on o), optional QK RMSNorm, partial RoPE (half the head by default), and DeepSeek-V3-style
MoE: a sigmoid router whose correction bias steers selection only, renormalized top-k weights
times routed_scaling_factor, ungated shared experts; the first `first_k_dense_replace` layers are
dense. Plain RMSNorms.

The checkpoints also keep a multi-token-prediction layer after the model's (DeepSeek-V3's layout:
`model.layers.{num_hidden_layers}.` with eh_proj, enorm, hnorm and shared_head): not part of the
model, but the drafter lucebox runs by default (`models/mtp.py`, layout "deepseek").
Not implemented, and refused: grouped top-k routing (topk_group < n_group)."""

from __future__ import annotations

from lucebox.models.hf_config import common_fields, integer, require, sigmoid_moe, uniform_layers
from lucebox.models.layout import hf_sources
from lucebox.models.sources import Unloaded

from lucebox.config import ModelConfig
from lucebox.errors import ConfigError

ARCHITECTURES = ("Glm4MoeForCausalLM",)


def build_config(hf: dict) -> ModelConfig:
    n = integer(require(hf, "num_hidden_layers"), "num_hidden_layers", 1, 1024)
    dense = integer(hf.get("first_k_dense_replace", 1), "first_k_dense_replace", 0, 1024)
    qk_norm = hf.get("use_qk_norm", False)
    if not isinstance(qk_norm, bool):
        raise ConfigError(f"config.json: use_qk_norm must be true or false, got {qk_norm!r}")
    # transformers' default: half the head rotates (its config fills it in when config.json has none)
    hf = hf if _rotary_fraction_given(hf) else {**hf, "partial_rotary_factor": 0.5}
    moe = sigmoid_moe(hf, experts=("n_routed_experts", "num_local_experts", "num_experts"), scaling=1.0)
    layers = uniform_layers(hf, [None] * n, ["dense" if i < dense else "moe" for i in range(n)])
    # transformers' default: one (the published checkpoints hold one); 0 stated leaves one allowed too
    mtp = max(1, integer(hf.get("num_nextn_predict_layers", 1), "num_nextn_predict_layers", 0, 16))
    return ModelConfig(layers=layers, moe=moe, qk_norm=qk_norm, attention_output_bias=False,
                       extra={"mtp_layers": mtp}, **common_fields(hf))


def _rotary_fraction_given(hf: dict) -> bool:
    params = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    return hf.get("partial_rotary_factor") is not None or params.get("partial_rotary_factor") is not None


def unloaded(cfg: ModelConfig) -> tuple[Unloaded, ...]:
    """The multi-token-prediction layers after the model's (`num_nextn_predict_layers` of them, one
    in the published checkpoints): the drafter's weights, read by the drafter's own load (draft='auto'
    or 'mtp'), so the model's load passes over them without a word."""
    n = len(cfg.layers)
    return tuple(Unloaded(f"model.layers.{n + i}.", "the multi-token-prediction (MTP) layer, which the drafter "
                          "loads", quiet=True) for i in range(cfg.extra.get("mtp_layers", 0)))


sources = hf_sources
