"""config.json fields of GLM-4.5 / 4.6 (Glm4MoeForCausalLM) from llama.cpp's `glm4moe` GGUF metadata.

Keys as llama.cpp's converter writes them (convert_hf_to_gguf.py Glm4MoeModel.set_gguf_parameters):
the experts' as Kimi Linear's (`kimi_config.sigmoid_experts`: expert_count, expert_used_count,
expert_feed_forward_length, expert_shared_count, leading_dense_block_count, expert_weights_scale,
expert_gating_func 2 for the sigmoid router), with expert_weights_norm (norm_topk_prob);
rope.dimension_count is the rotated part of the head (partial_rotary_factor); block_count counts the
multi-token-prediction layers after the model's (nextn_predict_layers), which the model loads
without. The tensors tell the rest: attn_q.bias (q/k/v biases) and attn_q_norm (QK norms).
"""

from __future__ import annotations

from lucebox.checkpoints.gguf.hybrid_config import whole_number
from lucebox.checkpoints.gguf.kimi_config import sigmoid_experts
from lucebox.errors import ConfigError


def glm4moe(meta, hf: dict, has, shape) -> dict:
    """`hf` (the sizes every architecture has, with the attention's) completed into GLM-4.5's config.json."""
    nextn = whole_number(meta, "nextn_predict_layers", 0)
    if not 0 <= nextn < hf["num_hidden_layers"]:
        raise ConfigError(f"{meta.source.name}: '{meta.arch}.nextn_predict_layers' is {nextn}, not fewer than "
                          f"'{meta.arch}.block_count' ({hf['num_hidden_layers']}), which counts them")
    norm = meta.get("expert_weights_norm", True)
    if not isinstance(norm, bool):
        raise ConfigError(f"{meta.source.name}: '{meta.arch}.expert_weights_norm' is {str(norm)[:40]!r}; it must be "
                          "true or false")
    experts = sigmoid_experts(meta)
    rope = {**hf["rope_parameters"], "partial_rotary_factor":  # stated even when whole (GLM's default is half)
            whole_number(meta, "rope.dimension_count", hf["head_dim"]) / hf["head_dim"]}
    hf.update(architectures=["Glm4MoeForCausalLM"], num_hidden_layers=hf["num_hidden_layers"] - nextn,
              num_nextn_predict_layers=nextn, rope_parameters=rope, attention_bias=has("blk.0.attn_q.bias"),
              use_qk_norm=has("blk.0.attn_q_norm.weight"), **{**experts, "moe_renormalize": norm})
    return hf
