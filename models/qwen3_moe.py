"""Qwen3-MoE: Qwen3 attention, softmax top-k router; dense layers from mlp_only_layers/decoder_sparse_step."""

from __future__ import annotations

from lucebox.models.hf_config import common_fields, require, softmax_moe, uniform_layers
from lucebox.models.layout import hf_sources

from lucebox.config import ModelConfig

ARCHITECTURES = ("Qwen3MoeForCausalLM",)


def build_config(hf: dict) -> ModelConfig:
    n = int(require(hf, "num_hidden_layers"))
    moe = softmax_moe(hf, ("num_experts", "num_local_experts"), normalize=bool(hf.get("norm_topk_prob", False)))
    dense_only = set(hf.get("mlp_only_layers") or [])
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    mlp = ["moe" if i not in dense_only and (i + 1) % step == 0 else "dense" for i in range(n)]
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    return ModelConfig(
        layers=uniform_layers(hf, [window] * n, mlp), moe=moe, qk_norm=True, **common_fields(hf)
    )


sources = hf_sources
