"""Tiny Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) written as llama.cpp's converter
writes them, each with its float64 transformers twin holding the very weights the file decodes to.

Independent of lucebox's reader: names come from gguf-py's own tensor map (`gguf.get_tensor_name_map`)
and keys from its `GGUFWriter.add_*`; the transforms follow convert_hf_to_gguf.py (Qwen3NextModel,
_LinearAttentionVReorderBase): A_log -> -exp(A_log), dt_bias -> dt_proj.bias, conv1d squeezed,
every "*norm.weight" but linear_attn.norm + 1, Qwen3-Next's in_proj_qkvz split into attn_qkv and
attn_gate (or kept whole as ssm_in by older converters), and for Qwen3.5 the value heads moved
from grouped to tiled order. Each tensor's layout moves are replayed on an index tensor, so the
twin takes back exactly what each stored element decodes to.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch
from gguf_models import _BASE, _encode

# 256-wide rows (K-quant blocks); value heads of 64 columns hold whole quantization groups.
_LINEAR = dict(num_hidden_layers=4, full_attention_interval=2, linear_num_key_heads=2, linear_num_value_heads=4,
               linear_key_head_dim=32, linear_value_head_dim=64, linear_conv_kernel_dim=4)
_EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256, shared_expert_intermediate_size=256)
_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
ARCHES = {"qwen3next": gguf.MODEL_ARCH.QWEN3NEXT, "qwen35": gguf.MODEL_ARCH.QWEN35,
          "qwen35moe": gguf.MODEL_ARCH.QWEN35MOE}


def _transformers_model(arch: str):
    import transformers as tf

    base = {**_BASE, **_LINEAR}
    if arch == "qwen3next":
        return tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**base, **_EXPERTS, partial_rotary_factor=0.25,
                                                          norm_topk_prob=True))
    mrope = {**_ROPE, "mrope_section": [3, 3, 2], "mrope_interleaved": True}  # 8 rotary frequencies
    if arch == "qwen35":
        return tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**base, rope_parameters=mrope))
    base.pop("intermediate_size")
    return tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**base, **_EXPERTS, rope_parameters=mrope))


def _metadata(writer: gguf.GGUFWriter, config) -> None:
    """What TextModel, Qwen2MoeModel and Qwen3NextModel.set_gguf_parameters write."""
    w, rope = writer, config.rope_parameters
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    if getattr(config, "intermediate_size", None):
        w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_attention_heads)
    w.add_head_count_kv(config.num_key_value_heads)
    if "mrope_section" in rope:
        w.add_rope_dimension_sections([*rope["mrope_section"], 0])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    if getattr(config, "num_experts", None):
        w.add_expert_count(config.num_experts)
        w.add_expert_used_count(config.num_experts_per_tok)
        w.add_expert_feed_forward_length(config.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_ssm_conv_kernel(config.linear_conv_kernel_dim)
    w.add_ssm_state_size(config.linear_key_head_dim)
    w.add_ssm_group_count(config.linear_num_key_heads)
    w.add_ssm_time_step_rank(config.linear_num_value_heads)
    w.add_ssm_inner_size(config.linear_value_head_dim * config.linear_num_value_heads)
    w.add_full_attention_interval(config.layer_types.index("full_attention") + 1)
    w.add_rope_dimension_count(int(config.head_dim * rope.get("partial_rotary_factor", 0.25)))


def _tiled(t: torch.Tensor, dim: int, config, head_dim: int) -> torch.Tensor:
    """The converter's _reorder_v_heads: value heads from grouped (g*r + i) to tiled (i*Hk + g) order."""
    k, r = config.linear_num_key_heads, config.linear_num_value_heads // config.linear_num_key_heads
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], k, r, head_dim, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape)


def _layout(name: str, t: torch.Tensor, config, arch: str, legacy: bool) -> list[tuple[str, torch.Tensor]]:
    """(HF-style name, tensor) pairs the converter maps for HF tensor `name`: splits, reorders, squeeze."""
    if name.endswith("experts.gate_up_proj"):  # Qwen2MoeModel splits transformers' fused experts
        half = t.shape[1] // 2
        return [(name.replace("gate_up_proj", "gate_proj.weight"), t[:, :half]),
                (name.replace("gate_up_proj", "up_proj.weight"), t[:, half:])]
    if name.endswith("experts.down_proj"):
        return [(name + ".weight", t)]
    if "linear_attn." in name and arch != "qwen3next" and config.linear_num_key_heads != config.linear_num_value_heads:
        qk, Dv = 2 * config.linear_num_key_heads * config.linear_key_head_dim, config.linear_value_head_dim
        if ".in_proj_qkv." in name:
            t = torch.cat([t[:qk], _tiled(t[qk:], 0, config, Dv)])
        elif ".in_proj_z." in name:
            t = _tiled(t, 0, config, Dv)
        elif ".in_proj_b." in name or ".in_proj_a." in name or name.endswith((".A_log", ".dt_bias")):
            t = _tiled(t, 0, config, 1)
        elif ".conv1d." in name:
            t = torch.cat([t[:qk], _tiled(t[qk:], 0, config, Dv)])
        elif ".out_proj." in name:
            t = _tiled(t, 1, config, Dv)
    if name.endswith(".dt_bias"):
        name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
    if "conv1d" in name:
        t = t.squeeze()
    if "in_proj_qkvz" in name and not legacy:
        k, Dk, Dv = config.linear_num_key_heads, config.linear_key_head_dim, config.linear_value_head_dim
        vz = config.linear_num_value_heads // k * Dv
        q, key, v, z = t.reshape(k, -1, t.shape[-1]).split([Dk, Dk, vz, vz], dim=1)
        flat = [x.reshape(-1, t.shape[-1]) for x in (q, key, v, z)]
        return [(name.replace("in_proj_qkvz", "in_proj_qkv"), torch.cat(flat[:3])),
                (name.replace("in_proj_qkvz", "in_proj_z"), flat[3])]
    return [(name, t)]


def _value_change(name: str):
    """(forward, inverse) of the converter's value change of `name`, or None."""
    if name.endswith(".A_log"):
        return lambda x: -np.exp(x), lambda x: np.log(-x)
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return lambda x: x + 1, lambda x: x - 1
    return None


def _gguf_name(names: gguf.TensorNameMap, name: str) -> str:
    mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
    if mapped is None:
        raise KeyError(f"gguf-py maps no tensor for {name}")
    return mapped


def write_hybrid_gguf(arch: str, qtype: str, path: Path, seed: int = 0, legacy: bool = False):
    """A tiny random `arch` hybrid in `path` (linear weights in `qtype`; `legacy`: Qwen3-Next's
    in_proj_qkvz whole, as ssm_in), and its float64 twin holding what the file decodes to."""
    torch.manual_seed(seed)
    model = _transformers_model(arch).to(torch.float64).eval()
    with torch.no_grad():
        for name, t in model.state_dict().items():  # make every norm and bias count
            if name.endswith(("norm.weight", "dt_bias")):
                t.add_(torch.randn_like(t) * 0.1)
    return write_converted(model, path, ARCHES[arch], _metadata, lambda name, t: _layout(name, t, model.config, arch,
                                                                                        legacy),
                           _value_change, qtype, seed)


def write_converted(model, path: Path, arch: gguf.MODEL_ARCH, metadata, layout, value_change, qtype: str, seed: int):
    """Write `model` (float64) as the converter would: `metadata(writer, config)` its keys,
    `layout(name, t)` the (HF-style or GGUF name, tensor) pairs it makes of each tensor, and
    `value_change(name)` its (forward, inverse) value change; every stored element's decoded value
    goes back into the model, through the same layout replayed on an index tensor."""
    rng = np.random.default_rng(seed)
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation("eager")
    config, tensor_names = model.config, gguf.get_tensor_name_map(arch, model.config.num_hidden_layers)
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    metadata(writer, config)
    for hf_name, t in model.state_dict().items():
        index = torch.arange(t.numel(), dtype=torch.float64).reshape(t.shape)
        change = value_change(hf_name)
        for (name, part), (_, where) in zip(layout(hf_name, t), layout(hf_name, index), strict=True):
            gname = name if name.startswith("blk.") else _gguf_name(tensor_names, name)
            values = part.numpy() if change is None else change[0](part.numpy())
            # F32, as the converter keeps them: vectors, the conv kernels, the router
            small = part.dim() < 2 or "conv1d" in name or name.endswith(("mlp.gate.weight", "A_log"))
            stored, decoded = _encode(values, "F32" if small else qtype, rng)
            writer.add_tensor(gname, stored, raw_dtype=None if small or qtype in ("F32", "F16") else
                              gguf.GGMLQuantizationType[qtype])
            decoded = decoded.astype(np.float64) if change is None else change[1](decoded.astype(np.float64))
            t.view(-1)[where.reshape(-1).long()] = torch.from_numpy(decoded.reshape(-1))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model
