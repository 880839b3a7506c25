"""Kimi Linear (Moonshot): a hybrid of Kimi Delta Attention layers ("linear_attention",
`models/kimi_delta_attention.py`) and multi-head latent attention layers ("full_attention",
`models/latent_attention.py`, no RoPE), with DeepSeek-V3-style MoE: a sigmoid router whose
correction bias steers selection only, renormalized top-k weights times routed_scaling_factor,
ungated shared experts; the first `first_k_dense_replace` layers are dense. Plain RMSNorms.

Which layers are KDA: `layer_types`, else `linear_attn_config`'s 1-based kda_layers and
full_attn_layers, else every 4th layer from layer 4 is full attention, as transformers reads them.
Several fields have two names (transformers' attribute and the name config.json stores); either
is read. Not implemented, and refused: grouped top-k routing (topk_group < num_expert_group),
attention biases, MLA with RoPE, key/value head counts that differ from the query heads.

Checkpoint names (the published ones, which transformers also saves): self_attn.* for both layer
kinds, the KDA convs as q_conv1d, k_conv1d, v_conv1d; MoE under block_sparse_moe with experts
w1 (gate), w3 (up), w2 (down); dense MLPs under mlp (or block_sparse_moe, as transformers saves them)."""

from __future__ import annotations

from lucebox.models.hf_config import common_fields, field, integer, require, shown, sigmoid_moe
from lucebox.models.layout import MoENames, hf_sources
from lucebox.models.qwen3_next import named_kinds
from lucebox.models.sources import AnyOf, Cat, Source, renamed

from lucebox.config import LatentAttentionSpec, LayerSpec, LinearAttentionSpec, ModelConfig, RopeSpec
from lucebox.errors import ConfigError

ARCHITECTURES = ("KimiLinearForCausalLM",)
_KINDS = {"linear_attention": "kda", "full_attention": "full"}
_NO_ROPE = RopeSpec(theta=10000.0, rotary_dim=0)  # MLA layers rotate nothing
_MOE_NAMES = MoENames(block="block_sparse_moe", gate="w1", up="w3", down="w2")


def linear_attn_config(hf: dict) -> dict:
    value = hf.get("linear_attn_config") or {}
    if not isinstance(value, dict):
        raise ConfigError("config.json: linear_attn_config must be an object")
    return value


def layer_kinds(hf: dict, n: int) -> list[str]:
    kinds, lin = hf.get("layer_types"), linear_attn_config(hf)
    if kinds is None and "kda_layers" in lin and "full_attn_layers" in lin:
        kinds = [None] * n
        for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
            if not isinstance(lin[key], list):
                raise ConfigError(f"config.json: linear_attn_config.{key} must list layer numbers (1-based)")
            for number_ in lin[key]:
                kinds[integer(number_, f"linear_attn_config.{key}", 1, n) - 1] = kind
        if None in kinds:
            raise ConfigError(f"config.json: linear_attn_config names no kind for layer {kinds.index(None) + 1} "
                              "(1-based): every layer must be in kda_layers or full_attn_layers")
    elif kinds is None:
        kinds = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    return named_kinds(kinds, n, _KINDS)


def mlp_kinds(hf: dict, n: int) -> list[str]:
    kinds = hf.get("mlp_layer_types")
    if kinds is None:
        dense = integer(hf.get("first_k_dense_replace", 1), "first_k_dense_replace", 0, 1024)
        return ["dense" if i < dense else "moe" for i in range(n)]
    if not isinstance(kinds, list) or len(kinds) != n or any(k not in ("dense", "sparse") for k in kinds):
        raise ConfigError(f"config.json: mlp_layer_types must list 'dense' or 'sparse' for each of the {n} layers")
    return ["moe" if k == "sparse" else "dense" for k in kinds]


def kda_shapes(hf: dict) -> LinearAttentionSpec:
    """linear_attn_config's head_dim, num_heads, short_conv_kernel_size over the top-level fields."""
    lin = linear_attn_config(hf)
    heads = integer(lin.get("num_heads", hf.get("linear_num_heads", 32)), "linear_num_heads", 1, 4096)
    dim = integer(lin.get("head_dim", hf.get("linear_head_dim", 128)), "linear_head_dim", 1, 4096)
    kernel = integer(lin.get("short_conv_kernel_size", hf.get("linear_conv_kernel_dim", 4)),
                     "linear_conv_kernel_dim", 2, 64)
    return LinearAttentionSpec(key_heads=heads, value_heads=heads, key_dim=dim, value_dim=dim, conv_kernel=kernel,
                               projections="flat")


def latent_shapes(hf: dict) -> LatentAttentionSpec:
    if hf.get("mla_use_nope") is False:
        raise ConfigError("config.json: mla_use_nope=false (latent attention with RoPE) is not supported: "
                          "lucebox runs Kimi Linear's MLA as transformers does, without RoPE")
    q_rank = hf.get("q_lora_rank")
    spec = LatentAttentionSpec(
        kv_rank=integer(hf.get("kv_lora_rank", 512), "kv_lora_rank", 1, 2**16),
        q_rank=0 if q_rank is None else integer(q_rank, "q_lora_rank", 1, 2**16),
        nope_dim=integer(hf.get("qk_nope_head_dim", 128), "qk_nope_head_dim", 0, 4096),
        rope_dim=integer(hf.get("qk_rope_head_dim", 64), "qk_rope_head_dim", 0, 4096),
        value_dim=integer(hf.get("v_head_dim", 128), "v_head_dim", 1, 4096),
    )
    if spec.qk_dim == 0:
        raise ConfigError("config.json: qk_nope_head_dim + qk_rope_head_dim must be at least 1")
    return spec


def build_config(hf: dict) -> ModelConfig:
    if hf.get("attention_bias"):
        raise ConfigError("config.json: attention_bias=true is not supported for Kimi Linear (its MLA biases are "
                          "not implemented)")
    n = integer(require(hf, "num_hidden_layers"), "num_hidden_layers", 1, 1024)
    heads = integer(require(hf, "num_attention_heads"), "num_attention_heads", 1, 4096)
    if hf.get("num_key_value_heads", heads) != heads:
        raise ConfigError(f"config.json: num_key_value_heads {shown(hf['num_key_value_heads'])} differs from "
                          f"num_attention_heads {heads}: latent attention expands K and V for every query head")
    kinds, mlps = layer_kinds(hf, n), mlp_kinds(hf, n)
    mla = latent_shapes(hf)
    layers = tuple(LayerSpec(kind, heads, _NO_ROPE, mlp) for kind, mlp in zip(kinds, mlps, strict=True))
    fields = {**common_fields(hf), "num_kv_heads": heads, "head_dim": max(mla.qk_dim, mla.value_dim),
              "max_position_embeddings": integer(field(hf, ("model_max_length", "max_position_embeddings"), 2**20),
                                                 "model_max_length", 1, 2**26)}
    return ModelConfig(layers=layers, moe=sigmoid_moe(hf) if "moe" in mlps else None,
                       linear_attention=kda_shapes(hf), latent_attention=mla, **fields)


def _kda_sources(cfg: ModelConfig, hf: str) -> dict[str, Source]:
    HD = cfg.linear_attention.key_heads * cfg.linear_attention.key_dim
    convs = Cat(tuple(f"{hf}{x}_conv1d.weight" for x in "qkv"), (HD, HD, HD))
    parts = {"q": "q_proj.weight", "k": "k_proj.weight", "v": "v_proj.weight", "f_a": "f_a_proj.weight",
             "f_b": "f_b_proj.weight", "dt_bias": "dt_bias", "A_log": "A_log", "b": "b_proj.weight",
             "g_a": "g_a_proj.weight", "g_b": "g_b_proj.weight", "norm": "o_norm.weight", "out": "o_proj.weight"}
    return {"kda_conv": AnyOf((convs, hf + "conv1d.weight")), **{"kda_" + k: hf + v for k, v in parts.items()}}


def _latent_sources(cfg: ModelConfig, hf: str) -> dict[str, Source]:
    parts = {"wkv_a": "kv_a_proj_with_mqa", "kv_a_norm": "kv_a_layernorm", "wkv_b": "kv_b_proj", "wo": "o_proj"}
    parts |= {"wq_a": "q_a_proj", "q_a_norm": "q_a_layernorm", "wq_b": "q_b_proj"} if cfg.latent_attention.q_rank \
        else {"wq": "q_proj"}
    return {ours: f"{hf}{theirs}.weight" for ours, theirs in parts.items()}


def sources(cfg: ModelConfig) -> dict[str, Source]:
    out = hf_sources(cfg, _MOE_NAMES)
    for i, layer in enumerate(cfg.layers):
        p, hf = f"layers.{i}.", f"model.layers.{i}."
        own = _kda_sources(cfg, hf + "self_attn.") if layer.is_recurrent else _latent_sources(cfg, hf + "self_attn.")
        out.update({p + name: source for name, source in own.items()})
        if layer.mlp == "dense":  # under mlp (published checkpoints) or block_sparse_moe (as transformers saves)
            for name in ("w_gate_up", "w_down"):
                out[p + name] = AnyOf((out[p + name], renamed(out[p + name], _in_moe_block)))
    return out


def _in_moe_block(name: str) -> str:
    return name.replace(".mlp.", ".block_sparse_moe.")
