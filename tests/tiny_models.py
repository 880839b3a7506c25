"""Tiny random Hugging Face checkpoints of every supported architecture, built with transformers
(the reference) and saved to a folder, so tests compare lucebox against the real implementation."""

from __future__ import annotations

from pathlib import Path

import torch

WINDOW = 8  # sliding window of the tiny models: prompts + 64 generated tokens cross it many times
VOCAB = 128
_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.05,
             bos_token_id=None, eos_token_id=None, pad_token_id=None)


def laguna_settings(base: dict, window: int, experts: int, top_k: int, expert_width: int, shared_width: int,
                    original_context: int) -> dict:
    """A 4-layer Laguna (one full layer with YaRN and partial rotary, three sliding ones, a dense
    MLP then MoE with a shared expert, per-element gate, soft-capped router) for LagunaConfig."""
    return {
        **base, "num_hidden_layers": 4,
        "layer_types": ["full_attention", "sliding_attention", "sliding_attention", "sliding_attention"],
        "num_attention_heads_per_layer": [4, 8, 8, 8], "sliding_window": window, "gating": "per-element",
        "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"], "num_experts": experts,
        "num_experts_per_tok": top_k, "moe_intermediate_size": expert_width,
        "shared_expert_intermediate_size": shared_width, "moe_routed_scaling_factor": 2.5,
        "moe_router_logit_softcapping": 2.0,
        "rope_parameters": {
            "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0,
                               "original_max_position_embeddings": original_context, "partial_rotary_factor": 0.5},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
        },
    }


def _laguna():
    from transformers import LagunaConfig, LagunaForCausalLM

    return LagunaForCausalLM(LagunaConfig(**laguna_settings(_BASE, WINDOW, 8, 3, 32, 24, 32)))


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    return LlamaForCausalLM(LlamaConfig(**_BASE, attention_bias=True, rope_parameters=rope))


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(**_BASE, sliding_window=WINDOW))


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**{**_BASE, "num_hidden_layers": 3}, use_sliding_window=True, sliding_window=WINDOW,
                         max_window_layers=1, tie_word_embeddings=True)
    return Qwen3ForCausalLM(config)


def _qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(**{**_BASE, "num_hidden_layers": 3}, num_experts=8, num_experts_per_tok=2,
                            moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[0])
    return Qwen3MoeForCausalLM(config)


def _glm4_moe():
    """A dense first layer then MoE with a shared expert and a correction-biased sigmoid router, q/k/v
    biases (o has none), QK norms, half the head rotated (transformers' default)."""
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    config = Glm4MoeConfig(**{**_BASE, "num_hidden_layers": 3}, n_routed_experts=8, num_experts_per_tok=2,
                           moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                           routed_scaling_factor=2.5, attention_bias=True, use_qk_norm=True)
    return Glm4MoeForCausalLM(config)


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(**{**_BASE, "intermediate_size": 48}, num_local_experts=4, num_experts_per_tok=2,
                           sliding_window=WINDOW)
    return MixtralForCausalLM(config)


def qwen3_next_settings(base: dict) -> dict:
    """A 4-layer Qwen3-Next: Gated DeltaNet, full attention, twice (full_attention_interval=2),
    two value heads per key head, a dense first layer then MoE with a gated shared expert."""
    return {**base, "num_hidden_layers": 4, "full_attention_interval": 2, "linear_num_key_heads": 2,
            "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 12,
            "linear_conv_kernel_dim": 4, "partial_rotary_factor": 0.25, "num_experts": 4,
            "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 24,
            "mlp_only_layers": [0], "norm_topk_prob": True}


def _with_perturbed_norms(model):
    """Hybrid norms start at 0 (scaled by 1 + w) or 1 (the gated norm): make each one count."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(torch.randn_like(param) * 0.1)
    return model


def _qwen3_next():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    return _with_perturbed_norms(Qwen3NextForCausalLM(Qwen3NextConfig(**qwen3_next_settings(_BASE))))


def qwen3_5_settings(base: dict) -> dict:
    """A 4-layer Qwen3.5 text model: Gated DeltaNet, full attention, twice (by layer_types), two value
    heads per key head, half-rotary mrope whose sections split the 4 frequencies over t, h, w."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "mrope_section": [2, 1, 1], "mrope_interleaved": True}
    return {**base, "num_hidden_layers": 4, "layer_types": ["linear_attention", "full_attention"] * 2,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
            "linear_value_head_dim": 12, "linear_conv_kernel_dim": 4, "rope_parameters": rope}


def qwen3_5_moe_settings(base: dict) -> dict:
    """qwen3_5_settings with 4 experts (top 2) and a gated shared expert in every layer."""
    settings = {k: v for k, v in qwen3_5_settings(base).items() if k != "intermediate_size"}
    return {**settings, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 24}


def _qwen3_5():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    return _with_perturbed_norms(Qwen3_5ForCausalLM(Qwen3_5TextConfig(**qwen3_5_settings(_BASE))))


def _qwen3_5_moe():
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    return _with_perturbed_norms(Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**qwen3_5_moe_settings(_BASE))))


def kimi_linear_settings(base: dict, q_lora_rank: int | None = 24, v_head_dim: int = 10) -> dict:
    """A 4-layer Kimi Linear: KDA, MLA (no RoPE), twice (by linear_attn_config's 1-based lists), 3
    KDA heads of 8 channels, MLA through a q latent with qk 12 + 8 > v 10 (v is padded in the cache),
    a dense first layer then 4 experts (top 2, sigmoid with correction bias) and a shared expert."""
    settings = {k: v for k, v in base.items() if k != "head_dim"}
    return {**settings, "num_hidden_layers": 4, "num_key_value_heads": base["num_attention_heads"],
            "kv_lora_rank": 16, "q_lora_rank": q_lora_rank, "qk_nope_head_dim": 12, "qk_rope_head_dim": 8,
            "v_head_dim": v_head_dim, "num_local_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "n_shared_experts": 1, "routed_scaling_factor": 2.0, "first_k_dense_replace": 1,
            "linear_attn_config": {"head_dim": 8, "num_heads": 3, "short_conv_kernel_size": 4,
                                   "kda_layers": [1, 3], "full_attn_layers": [2, 4]}}


def _kimi_linear(**options):
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    return _with_perturbed_norms(KimiLinearForCausalLM(KimiLinearConfig(**kimi_linear_settings(_BASE, **options))))


# The smallest vision tower Qwen3.5's image-text models construct; its output feeds the text model.
_TINY_VISION = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 64}


def build_image_text(name: str, seed: int = 0):
    """A random image-text (ForConditionalGeneration) Qwen3.5 or Qwen3.5-MoE in float64, eager
    experts: the tiny text model of `name` with the tiny vision tower, as the published checkpoints are."""
    from transformers import (
        Qwen3_5Config,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeConfig,
        Qwen3_5MoeForConditionalGeneration,
    )

    torch.manual_seed(seed)
    if name == "qwen3_5_moe":
        config = Qwen3_5MoeConfig(text_config=qwen3_5_moe_settings(_BASE), vision_config=_TINY_VISION)
        model = Qwen3_5MoeForConditionalGeneration(config)
        model.set_experts_implementation("eager")  # grouped_mm refuses float64
    else:
        model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=qwen3_5_settings(_BASE),
                                                              vision_config=_TINY_VISION))
    return _with_perturbed_norms(model).to(torch.float64).eval()


BUILDERS = {"laguna": _laguna, "llama": _llama, "mistral": _mistral, "qwen3": _qwen3,
            "qwen3_moe": _qwen3_moe, "qwen3_next": _qwen3_next, "qwen3_5": _qwen3_5, "qwen3_5_moe": _qwen3_5_moe,
            "mixtral": _mixtral, "kimi_linear": _kimi_linear, "glm4_moe": _glm4_moe,
            # no q latent, and v wider than q and k (q and k are padded in the cache)
            "kimi_linear_wide_v": lambda: _kimi_linear(q_lora_rank=None, v_head_dim=24)}
VARIANTS = {"kimi_linear_wide_v"}  # a second shape of one architecture: not in the every-architecture tests
SHARDED = {"qwen3_moe"}  # saved as several shards with model.safetensors.index.json


def build_reference(name: str, seed: int = 0):
    """A random transformers model in float64, eager experts (grouped_mm refuses float64)."""
    torch.manual_seed(seed)
    model = BUILDERS[name]().to(torch.float64).eval()
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if pname.endswith("e_score_correction_bias"):
                param.copy_(torch.rand_like(param) * 0.2)  # non-zero: it must steer selection only
    for buffer_name, buffer in model.named_buffers():
        if buffer_name.endswith("e_score_correction_bias"):
            buffer.copy_(torch.rand_like(buffer) * 0.2)
    return model


def save_reference(name: str, folder: Path, seed: int = 0):
    model = build_reference(name, seed)
    shard = "40KB" if name in SHARDED else "1GB"
    model.to(torch.float32).save_pretrained(folder, max_shard_size=shard)
    return model.to(torch.float64)
