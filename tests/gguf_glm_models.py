"""A tiny GLM-4.5 written as llama.cpp's converter writes it (`glm4moe`), with its float64
transformers twin holding the very weights the file decodes to (`gguf_hybrid_models.write_converted`).

Independent of lucebox's reader: names come from gguf-py's tensor map, keys from its
`GGUFWriter.add_*`, and the transforms follow convert_hf_to_gguf.py Glm4MoeModel: the experts
stacked (ffn_gate_exps, ffn_up_exps, ffn_down_exps), e_score_correction_bias -> exp_probs_b.bias,
block_count counting the multi-token-prediction layer after the model's (`nextn_predict_layers`),
whose block the file holds too (here a few of its tensors: `NEXTN`).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import torch
from gguf_hybrid_models import write_converted
from gguf_models import _BASE

# Every matrix input 32 wide or a multiple (Q8_0 blocks)
_GLM = dict(num_hidden_layers=3, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
            n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.0, attention_bias=True,
            use_qk_norm=True, num_nextn_predict_layers=1)
NEXTN = ("nextn.enorm.weight", "nextn.hnorm.weight", "nextn.shared_head_norm.weight")


def _transformers_model():
    import transformers as tf

    return tf.Glm4MoeForCausalLM(tf.Glm4MoeConfig(**_BASE | _GLM))


def _metadata(w: gguf.GGUFWriter, c) -> None:
    """What TextModel and Glm4MoeModel.set_gguf_parameters write."""
    w.add_block_count(c.num_hidden_layers + c.num_nextn_predict_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_rope_dimension_count(int(c.head_dim * c.rope_parameters["partial_rotary_factor"]))
    w.add_expert_count(c.n_routed_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_shared_count(c.n_shared_experts)
    w.add_leading_dense_block_count(c.first_k_dense_replace)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(c.routed_scaling_factor)
    w.add_expert_weights_norm(c.norm_topk_prob)
    w.add_nextn_predict_layers(c.num_nextn_predict_layers)
    w.add_vocab_size(c.vocab_size)


def _layout(name: str, t: torch.Tensor, c) -> list[tuple[str, torch.Tensor]]:
    """(HF-style or GGUF name, tensor) pairs the converter writes for transformers' tensor `name`."""
    block = "blk." + name.split(".")[2] + "." if name.startswith("model.layers.") else ""
    if name.endswith("experts.gate_up_proj"):
        half = t.shape[1] // 2
        return [(block + "ffn_gate_exps.weight", t[:, :half]), (block + "ffn_up_exps.weight", t[:, half:])]
    if name.endswith("experts.down_proj"):
        return [(block + "ffn_down_exps.weight", t)]
    if name.endswith("e_score_correction_bias"):
        return [(block + "exp_probs_b.bias", t)]
    if name == "model.norm.weight":  # and the MTP block's norms (the model's own values: only their presence counts)
        head = f"blk.{c.num_hidden_layers}."
        return [(name, t)] + [(head + part, t) for part in NEXTN]
    return [(name, t)]


def write_glm_gguf(qtype: str, path: Path, seed: int = 0):
    """A tiny random GLM-4.5 in `path` (projections in `qtype`), and its float64 twin holding what
    the file decodes to."""
    torch.manual_seed(seed)
    model = _transformers_model().to(torch.float64).eval()
    with torch.no_grad():
        for name, t in model.state_dict().items():  # make every norm and the router's correction count
            if name.endswith("norm.weight"):
                t.add_(torch.randn_like(t) * 0.1)
            elif name.endswith("e_score_correction_bias"):
                t.copy_(torch.rand_like(t) * 0.2)
    return write_converted(model, path, gguf.MODEL_ARCH.GLM4_MOE, _metadata, lambda name, t: _layout(name, t,
                           model.config), lambda name: None, qtype, seed)
