"""A tiny GLM-4.5 written as llama.cpp's converter writes it (`glm4moe`), with its float64
transformers twin holding the very weights the file decodes to (`gguf_hybrid_models.write_converted`).

Independent of lucebox's reader: names come from gguf-py's tensor map, keys from its
`GGUFWriter.add_*`, and the transforms follow convert_hf_to_gguf.py Glm4MoeModel: the experts
stacked (ffn_gate_exps, ffn_up_exps, ffn_down_exps), e_score_correction_bias -> exp_probs_b.bias,
and block_count counting the multi-token-prediction layer after the model's (`nextn_predict_layers`),
whose block the file holds too (`with_nextn_block`: a Hugging Face folder's head, as F32).
"""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf_bytes import TensorRecord, read_layout, write_layout
from gguf_hybrid_models import write_converted
from gguf_models import _BASE
from safetensors.torch import load_file

# Every matrix input 32 wide or a multiple (Q8_0 blocks)
_GLM = dict(num_hidden_layers=3, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
            n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.0, attention_bias=True,
            use_qk_norm=True, num_nextn_predict_layers=0)


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


def with_nextn_block(path: Path, folder: Path) -> Path:
    """The GGUF file at `path` with the MTP layer of the Hugging Face `folder` (`model.layers.{n}.*`,
    n the file's block count) appended as its block n, in F32, named as the converter names them,
    and the metadata counting it (block_count n + 1, nextn_predict_layers 1)."""
    layout = read_layout(path)
    n = int(layout.get("glm4moe.block_count").value)
    config = _transformers_model().config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GLM4_MOE, n + 1)
    head = {name: t.float() for name, t in load_file(folder / "model.safetensors").items()
            if name.startswith(f"model.layers.{n}.")}
    expert = re.compile(rf"model\.layers\.{n}\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
    pairs = [pair for name, t in head.items() if not expert.fullmatch(name) for pair in _layout(name, t, config)]
    for kind in ("gate", "up", "down"):  # the published per-expert tensors, stacked as the converter does
        parts = sorted((int(m[1]), t) for name, t in head.items() if (m := expert.fullmatch(name)) and m[2] == kind)
        pairs.append((f"blk.{n}.ffn_{kind}_exps.weight", torch.stack([t for _, t in parts])))
    data = bytearray(layout.data)
    for name, part in pairs:
        gname = name if name.startswith("blk.") else names.get_name(name, try_suffixes=(".weight", ".bias"))
        data += bytes(-len(data) % layout.alignment)
        layout.tensors.append(TensorRecord(gname, list(reversed(part.shape)), 0, len(data)))
        data += part.numpy().astype(np.float32).tobytes()
    layout.data = bytes(data)
    layout.get("glm4moe.block_count").value = n + 1
    layout.get("glm4moe.nextn_predict_layers").value = 1
    return write_layout(layout, path)
