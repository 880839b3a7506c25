"""A tiny Kimi Linear written as llama.cpp's converter writes it (`kimi-linear`), with its float64
transformers twin holding the very weights the file decodes to (`write_converted`).

Independent of lucebox's reader: names come from gguf-py's tensor map, keys from its
`GGUFWriter.add_*`, and the transforms follow convert_hf_to_gguf.py KimiLinearModel: the KDA convs
q/k/v_conv1d each reshaped to (1, H*D, 1, K), A_log -> -exp(A_log), dt_bias -> dt_proj.bias, the
experts stacked (ffn_gate_exps, ffn_up_exps, ffn_down_exps), e_score_correction_bias ->
exp_probs_b.bias, and kv_b_proj split per head into k_b (its nope rows, transposed) and v_b (or
kept whole as attn_kv_b, `legacy`). transformers holds the convs fused and the experts' gate and
up fused; the layout below starts from that.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from gguf_hybrid_models import write_converted
from gguf_models import _BASE

# Every matrix input 32 wide or a multiple (Q8_0 blocks); KDA heads as many as MLA heads (llama.cpp's
# kimi-linear has one head count for both).
_KIMI = dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64,
             qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, num_experts=4, num_experts_per_token=2,
             moe_intermediate_size=64, num_shared_experts=1, routed_scaling_factor=2.0, first_k_dense_replace=1,
             linear_attn_config={"head_dim": 32, "num_heads": 4, "short_conv_kernel_size": 4,
                                 "kda_layers": [1, 3], "full_attn_layers": [2, 4]})


def _transformers_model(q_lora_rank: int | None):
    import transformers as tf

    base = {k: v for k, v in _BASE.items() if k not in ("head_dim", *_KIMI)}
    return tf.KimiLinearForCausalLM(tf.KimiLinearConfig(**base, **_KIMI, q_lora_rank=q_lora_rank))


def _metadata(w: gguf.GGUFWriter, c) -> None:
    """What TextModel and KimiLinearModel.set_gguf_parameters write (a repeated key written once, last value)."""
    lin = c.linear_attn_config
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(getattr(c, "max_position_embeddings", None) or c.model_max_length)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv([1 if i + 1 in lin["full_attn_layers"] else 0 for i in range(c.num_hidden_layers)])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_expert_count(c.num_experts)
    w.add_expert_used_count(c.num_experts_per_token)
    w.add_expert_group_used_count(c.topk_group)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_value_length(c.head_dim)
    w.add_vocab_size(c.vocab_size)
    w.add_ssm_conv_kernel(lin["short_conv_kernel_size"])
    w.add_kda_head_dim(lin["head_dim"])
    if c.q_lora_rank is not None:
        w.add_q_lora_rank(c.q_lora_rank)
    w.add_kv_lora_rank(c.kv_lora_rank)
    w.add_rope_dimension_count(c.qk_rope_head_dim)
    w.add_key_length(c.kv_lora_rank + c.qk_rope_head_dim)
    w.add_key_length_mla(c.qk_nope_head_dim + c.qk_rope_head_dim)
    w.add_value_length_mla(c.v_head_dim)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_shared_count(c.num_shared_experts)
    w.add_leading_dense_block_count(c.first_k_dense_replace)
    w.add_expert_weights_scale(c.routed_scaling_factor)


def _layout(name: str, t: torch.Tensor, c, legacy: bool) -> list[tuple[str, torch.Tensor]]:
    """(HF-style or GGUF name, tensor) pairs the converter writes for transformers' tensor `name`."""
    block = "blk." + name.split(".")[2] + "." if name.startswith("model.layers.") else ""
    if name.endswith("self_attn.conv1d.weight"):  # q | k | v, each (H*D, 1, K) -> (1, H*D, 1, K)
        return [(name.replace("conv1d", f"{x}_conv1d"), part.reshape(1, part.shape[0], 1, part.shape[-1]))
                for x, part in zip("qkv", t.chunk(3), strict=True)]
    if ".forget_gate." in name:  # transformers' module; the checkpoint has them under self_attn
        name = name.replace(".forget_gate.", ".").replace(".dt_bias", ".dt_proj.bias")
    if name.endswith("experts.gate_up_proj"):
        half = t.shape[1] // 2
        return [(block + "ffn_gate_exps.weight", t[:, :half]), (block + "ffn_up_exps.weight", t[:, half:])]
    if name.endswith("experts.down_proj"):
        return [(block + "ffn_down_exps.weight", t)]
    if name.endswith("e_score_correction_bias"):
        return [(block + "exp_probs_b.bias", t)]
    if name.endswith("kv_b_proj.weight") and not legacy:
        kv_b = t.reshape(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, -1)
        k_b, v_b = kv_b.split([c.qk_nope_head_dim, c.v_head_dim], dim=1)
        return [(name.replace("kv_b_proj", "k_b_proj"), k_b.transpose(1, 2).contiguous()),
                (name.replace("kv_b_proj", "v_b_proj"), v_b.contiguous())]
    return [(name, t)]


def _value_change(name: str):
    if name.endswith(".A_log"):
        return lambda x: -np.exp(x), lambda x: np.log(-x)
    return None


def write_kimi_gguf(qtype: str, path: Path, seed: int = 0, q_lora_rank: int | None = 32, legacy: bool = False):
    """A tiny random Kimi Linear in `path` (projections in `qtype`; `legacy`: kv_b whole, as
    attn_kv_b), and its float64 twin holding what the file decodes to."""
    torch.manual_seed(seed)
    model = _transformers_model(q_lora_rank).to(torch.float64).eval()
    with torch.no_grad():
        for name, t in model.state_dict().items():  # make every norm, bias and the router's correction count
            if name.endswith(("norm.weight", "layernorm.weight", "dt_bias")):
                t.add_(torch.randn_like(t) * 0.1)
            elif name.endswith("e_score_correction_bias"):
                t.copy_(torch.rand_like(t) * 0.2)
    return write_converted(model, path, gguf.MODEL_ARCH.KIMI_LINEAR, _metadata,
                           lambda name, t: _layout(name, t, model.config, legacy), _value_change, qtype, seed)
