"""Qwen3.5-MoE (text): Qwen3.5 (`models/qwen3_5.py`) with Qwen3-Next's MoE block in every layer
(softmax top-k router whose top-k weights are always renormalized, and a shared expert scaled by a
sigmoid gate). transformers' Qwen3.5-MoE has no dense layers and no norm_topk_prob switch: configs
stating mlp_only_layers, decoder_sparse_step or norm_topk_prob are read as transformers reads them,
which ignores them."""

from __future__ import annotations

from lucebox.models.hf_config import integer, require

# The same tensor names, image-text layout and skipped tensors as the dense model's
from lucebox.models.qwen3_5 import UNLOADED as UNLOADED
from lucebox.models.qwen3_5 import check_mrope
from lucebox.models.qwen3_5 import sources as sources
from lucebox.models.qwen3_5 import text_model_fields as text_model_fields
from lucebox.models.qwen3_next import gated_shared_expert_moe, hybrid_config

from lucebox.config import ModelConfig

ARCHITECTURES = ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")  # as `models/qwen3_5.py`


def build_config(hf: dict) -> ModelConfig:
    check_mrope(hf)
    n = integer(require(hf, "num_hidden_layers"), "num_hidden_layers", 1, 1024)
    integer(require(hf, "num_experts"), "num_experts", 1, 4096)
    integer(require(hf, "moe_intermediate_size"), "moe_intermediate_size", 1, 2**20)
    # transformers builds the shared expert and its gate whatever this says: a width is needed
    integer(require(hf, "shared_expert_intermediate_size"), "shared_expert_intermediate_size", 1, 2**20)
    return hybrid_config(hf, ["moe"] * n, gated_shared_expert_moe(hf, normalize=True), projections="flat")
