"""Qwen3-Next: a hybrid of Gated DeltaNet layers ("linear_attention") and full attention layers
(every `full_attention_interval`-th, or as `layer_types` lists them). Its attention has a
per-element sigmoid output gate fused into q_proj, QK norm and partial rotary (0.25 by default);
its RMSNorms scale by (1 + weight); its MoE layers have a softmax router and a shared expert
whose output a sigmoid gate scales; dense layers come from mlp_only_layers / decoder_sparse_step."""

from __future__ import annotations

from dataclasses import replace

from lucebox.models.hf_config import (
    common_fields,
    head_dim,
    integer,
    require,
    rope_parameters,
    rope_spec,
    softmax_moe,
)
from lucebox.models.layout import hf_sources
from lucebox.models.sources import Source

from lucebox.config import LayerSpec, LinearAttentionSpec, ModelConfig
from lucebox.errors import ConfigError

ARCHITECTURES = ("Qwen3NextForCausalLM",)
_KINDS = {"linear_attention": "gdn", "full_attention": "full"}


def layer_kinds(hf: dict, n: int) -> list[str]:
    """Each layer's kind ("gdn" | "full"): `layer_types`, else every `full_attention_interval`-th
    layer (default 4) is full attention, as transformers derives it."""
    kinds = hf.get("layer_types")
    if kinds is None:
        interval = integer(hf.get("full_attention_interval", 4), "full_attention_interval", 1, 1024)
        return ["full" if (i + 1) % interval == 0 else "gdn" for i in range(n)]
    if not isinstance(kinds, list) or len(kinds) != n:
        raise ConfigError(f"config.json: layer_types must list one entry for each of the {n} layers")
    unknown = sorted({str(k) for k in kinds if k not in _KINDS})
    if unknown:
        raise ConfigError(f"config.json: layer_types has unknown entries {unknown[:3]} (known: {', '.join(_KINDS)})")
    return [_KINDS[k] for k in kinds]


def mlp_kinds(hf: dict, n: int) -> list[str]:
    """MoE on every `decoder_sparse_step`-th layer not in `mlp_only_layers` (with experts), else dense."""
    step = integer(hf.get("decoder_sparse_step", 1), "decoder_sparse_step", 1, 1024)
    dense_only = set(hf.get("mlp_only_layers") or [])
    experts = int(hf.get("num_experts") or 0)
    return ["moe" if experts > 0 and i not in dense_only and (i + 1) % step == 0 else "dense" for i in range(n)]


def linear_attention(hf: dict) -> LinearAttentionSpec:
    def size(key: str, lowest: int, highest: int) -> int:
        return integer(require(hf, key), key, lowest, highest)

    return LinearAttentionSpec(
        key_heads=size("linear_num_key_heads", 1, 4096),
        value_heads=size("linear_num_value_heads", 1, 4096),
        key_dim=size("linear_key_head_dim", 1, 4096),
        value_dim=size("linear_value_head_dim", 1, 4096),
        conv_kernel=size("linear_conv_kernel_dim", 1, 64),
    )


def build_config(hf: dict) -> ModelConfig:
    n = int(require(hf, "num_hidden_layers"))
    kinds, mlps = layer_kinds(hf, n), mlp_kinds(hf, n)
    params = rope_parameters(hf)
    params.setdefault("partial_rotary_factor", 0.25)  # transformers' default for Qwen3-Next
    rope = rope_spec(params, head_dim(hf), hf.get("max_position_embeddings", 32768))
    heads = int(require(hf, "num_attention_heads"))
    layers = tuple(LayerSpec(kind, heads, rope, mlp) for kind, mlp in zip(kinds, mlps, strict=True))
    moe = None
    if "moe" in mlps:
        base = softmax_moe(hf, ("num_experts",), normalize=bool(hf.get("norm_topk_prob", True)))
        shared = integer(hf.get("shared_expert_intermediate_size", 0) or 0, "shared_expert_intermediate_size", 0, 2**20)
        moe = replace(base, shared_expert_size=shared, shared_expert_gate=shared > 0)
    return ModelConfig(layers=layers, moe=moe, qk_norm=True, attention_gate="sigmoid",
                       linear_attention=linear_attention(hf), norm_offset=1.0, **common_fields(hf))


def sources(cfg: ModelConfig) -> dict[str, Source]:
    """The Llama-style names of the attention and MLP weights, and each linear_attn module's own."""
    out = hf_sources(cfg)
    for i, layer in enumerate(cfg.layers):
        if not layer.is_recurrent:
            continue
        p, hf = f"layers.{i}.gdn_", f"model.layers.{i}.linear_attn."
        out.update({p + "qkvz": hf + "in_proj_qkvz.weight", p + "ba": hf + "in_proj_ba.weight",
                    p + "conv": hf + "conv1d.weight", p + "dt_bias": hf + "dt_bias", p + "A_log": hf + "A_log",
                    p + "norm": hf + "norm.weight", p + "out": hf + "out_proj.weight"})
    return out
