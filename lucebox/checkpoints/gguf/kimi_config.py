"""config.json fields of Kimi Linear (KimiLinearForCausalLM) from llama.cpp's `kimi-linear` GGUF metadata.

Keys as llama.cpp's converter writes them (convert_hf_to_gguf.py KimiLinearModel.set_gguf_parameters,
over TextModel's) and reads them (src/models/kimi-linear.cpp load_arch_hparams):
  attention.head_count_kv  one value per layer: 0 for a KDA layer, 1 for an MLA layer (the converter
                           sets num_key_value_heads = 1, MLA as MQA); it is how llama.cpp tells the kinds
  attention.head_count     the MLA heads, and the KDA heads too (llama.cpp has no other count for them)
  kda.head_dim, ssm.conv_kernel             linear_attn_config's head_dim, short_conv_kernel_size
  attention.q_lora_rank (absent: no q latent), attention.kv_lora_rank
  rope.dimension_count     qk_rope_head_dim (the key part all heads share; Kimi rotates nothing)
  attention.key_length_mla = qk_nope_head_dim + qk_rope_head_dim; attention.value_length_mla = v_head_dim
  (attention.key_length = kv_lora_rank + qk_rope_head_dim and value_length are the absorbed
  cache's sizes, not read here)
  expert_count, expert_used_count, expert_feed_forward_length, expert_shared_count,
  leading_dense_block_count (first_k_dense_replace), expert_weights_scale (routed_scaling_factor),
  expert_gating_func (2: sigmoid, from moe_router_activation_func), expert_group_count (only from
  an `n_group` field, which Kimi's config lacks) and expert_group_used_count (topk_group).
llama.cpp always renormalizes the chosen experts' weights for kimi-linear (moe_renormalize).
Newer converters also write Kimi K3's extras under this architecture: hidden_activation (other than
silu), moe_latent_size (> 0) and their tensors are refused, as lucebox does not implement them.
"""

from __future__ import annotations

from lucebox.checkpoints.gguf.hybrid_config import whole_number
from lucebox.errors import ConfigError

SIGMOID_GATING = 2  # llama.cpp's expert_gating_func value for a sigmoid router

# config.json fields the Kimi Linear adapter may refuse, and the GGUF key each comes from
FIELDS = {"kv_lora_rank": "attention.kv_lora_rank", "q_lora_rank": "attention.q_lora_rank",
          "qk_nope_head_dim": "attention.key_length_mla", "qk_rope_head_dim": "rope.dimension_count",
          "v_head_dim": "attention.value_length_mla", "linear_head_dim": "kda.head_dim",
          "linear_num_heads": "attention.head_count", "moe_intermediate_size": "expert_feed_forward_length",
          "num_experts": "expert_count", "num_experts_per_token": "expert_used_count",
          "num_shared_experts": "expert_shared_count", "first_k_dense_replace": "leading_dense_block_count",
          "routed_scaling_factor": "expert_weights_scale"}


def _layer_types(meta, n: int) -> list[str]:
    kv_heads = meta.require("attention.head_count_kv")
    if not isinstance(kv_heads, list) or len(kv_heads) != n or \
            not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in kv_heads):
        raise ConfigError(f"{meta.source.name}: '{meta.arch}.attention.head_count_kv' must list one count for each "
                          f"of the {n} layers (0 for a KDA layer), as llama.cpp's converter writes it")
    return ["full_attention" if h else "linear_attention" for h in kv_heads]


def _latent_attention(meta) -> dict:
    rope = whole_number(meta, "rope.dimension_count")
    qk = whole_number(meta, "attention.key_length_mla")
    if qk < rope:
        raise ConfigError(f"{meta.source.name}: '{meta.arch}.attention.key_length_mla' ({qk}) is smaller than "
                          f"'{meta.arch}.rope.dimension_count' ({rope}); it is qk_nope_head_dim + qk_rope_head_dim")
    q_rank = whole_number(meta, "attention.q_lora_rank", 0)
    return {"kv_lora_rank": whole_number(meta, "attention.kv_lora_rank"), "q_lora_rank": q_rank or None,
            "qk_rope_head_dim": rope, "qk_nope_head_dim": qk - rope,
            "v_head_dim": whole_number(meta, "attention.value_length_mla"), "mla_use_nope": True}


def sigmoid_experts(meta) -> dict:
    """DeepSeek-V3-style experts' fields (`models.hf_config.sigmoid_moe` reads them): Kimi Linear's, GLM-4.5's."""
    gating = whole_number(meta, "expert_gating_func")
    if gating != SIGMOID_GATING:
        raise ConfigError(f"{meta.source.name}: '{meta.arch}.expert_gating_func' is {gating}; lucebox routes "
                          f"{meta.arch} with a sigmoid ({SIGMOID_GATING})")
    groups = whole_number(meta, "expert_group_count", 1)
    chosen = whole_number(meta, "expert_group_used_count", groups)
    if chosen != groups:
        raise ConfigError(f"{meta.source.name}: '{meta.arch}.expert_group_used_count' ({chosen}) differs from "
                          f"'{meta.arch}.expert_group_count' ({groups}): grouped top-k routing is not implemented "
                          "(lucebox routes over all experts)")
    scale = meta.get("expert_weights_scale", 1.0)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise ConfigError(f"{meta.source.name}: '{meta.arch}.expert_weights_scale' is {str(scale)[:40]!r}; it must "
                          "be a number")
    return {"num_experts": whole_number(meta, "expert_count"),
            "num_experts_per_token": whole_number(meta, "expert_used_count"),
            "moe_intermediate_size": whole_number(meta, "expert_feed_forward_length"),
            "num_shared_experts": whole_number(meta, "expert_shared_count", 0),
            "first_k_dense_replace": whole_number(meta, "leading_dense_block_count", 0),
            "routed_scaling_factor": float(scale), "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
            "num_expert_group": groups, "topk_group": chosen}


def _refuse_k3_extras(meta) -> None:
    activation = meta.get("hidden_activation", "silu")
    if activation != "silu":
        raise ConfigError(f"{meta.source.name}: '{meta.arch}.hidden_activation' is {str(activation)[:40]!r}; "
                          "lucebox's Kimi Linear runs SiLU MLPs only")
    if whole_number(meta, "moe_latent_size", 0):
        raise ConfigError(f"{meta.source.name}: '{meta.arch}.moe_latent_size' is {meta.get('moe_latent_size')}; "
                          "lucebox does not implement latent MoE projections")


def kimi_linear(meta, hf: dict) -> dict:
    """`hf` (the sizes every architecture has) completed into Kimi Linear's config.json."""
    _refuse_k3_extras(meta)
    n, heads = hf["num_hidden_layers"], hf["num_attention_heads"]
    hf.update(architectures=["KimiLinearForCausalLM"], num_key_value_heads=heads,
              layer_types=_layer_types(meta, n), model_max_length=hf["max_position_embeddings"],
              linear_attn_config={"num_heads": heads, "head_dim": whole_number(meta, "kda.head_dim"),
                                  "short_conv_kernel_size": whole_number(meta, "ssm.conv_kernel")},
              **_latent_attention(meta), **sigmoid_experts(meta))
    return hf
