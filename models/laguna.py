"""Laguna (poolside): per-layer-type RoPE (YaRN on full layers, partial rotary), per-layer head
counts, QK RMSNorm, softplus output gate, sigmoid router with a selection-only correction bias,
routed scaling, optional router logit soft-capping, a shared expert, dense leading layers."""

from __future__ import annotations

from lucebox.models.hf_config import common_fields, head_dim, number, require, rope_parameters, rope_spec
from lucebox.models.layout import hf_sources

from lucebox.config import LayerSpec, ModelConfig, MoESpec
from lucebox.errors import ConfigError

ARCHITECTURES = ("LagunaForCausalLM",)
_KINDS = {"full_attention": "full", "sliding_attention": "sliding"}
_DEFAULT_ROPE = {
    "full_attention": {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
}


def _per_layer(hf: dict, key: str, n: int, default: list) -> list:
    values = hf.get(key) or default
    if len(values) != n:
        raise ConfigError(f"config.json: '{key}' has {len(values)} entries for {n} layers")
    return values


def _gate(hf: dict) -> str | None:
    gating = hf.get("gating", True)
    if gating is True or gating == "per-head":
        return "head"
    if gating == "per-element":
        return "element"
    if gating is False or gating is None:
        return None
    raise ConfigError(f"config.json: gating '{gating}' is not one of true, false, 'per-head', 'per-element'")


def build_config(hf: dict) -> ModelConfig:
    if hf.get("moe_apply_router_weight_on_input"):
        raise ConfigError("config.json: moe_apply_router_weight_on_input=true is not supported")
    n = int(require(hf, "num_hidden_layers"))
    kinds = _per_layer(hf, "layer_types", n, ["full_attention"] * n)
    heads = _per_layer(hf, "num_attention_heads_per_layer", n, [require(hf, "num_attention_heads")] * n)
    mlps = _per_layer(hf, "mlp_layer_types", n, ["dense"] + ["sparse"] * (n - 1))
    # rope_parameters is keyed by layer kind; without it transformers uses these defaults (and
    # ignores a top-level rope_theta), so do we.
    rope_by_kind = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else _DEFAULT_ROPE
    if not set(rope_by_kind) & set(_KINDS):
        rope_by_kind = {kind: rope_by_kind for kind in _KINDS}  # one RoPE for every layer kind
    dim, max_pos = head_dim(hf), hf.get("max_position_embeddings", 131072)
    layers = []
    for kind, h, mlp in zip(kinds, heads, mlps, strict=True):
        if kind not in _KINDS or mlp not in ("dense", "sparse"):
            raise ConfigError(f"config.json: unknown layer type '{kind}' or mlp layer type '{mlp}'")
        rope = rope_spec(rope_parameters(hf, rope_by_kind.get(kind) or _DEFAULT_ROPE[kind]), dim, max_pos)
        window = require(hf, "sliding_window") if kind == "sliding_attention" else None
        layers.append(LayerSpec(_KINDS[kind], int(h), rope, "moe" if mlp == "sparse" else "dense", window))
    moe = MoESpec(
        num_experts=int(require(hf, "num_experts")),
        top_k=int(require(hf, "num_experts_per_tok")),
        expert_size=int(require(hf, "moe_intermediate_size")),
        router="sigmoid",
        normalize_topk=True,
        routed_scaling=number(hf.get("moe_routed_scaling_factor", 1.0), "moe_routed_scaling_factor"),
        logit_softcap=number(hf.get("moe_router_logit_softcapping", 0.0) or 0.0, "moe_router_logit_softcapping"),
        correction_bias=True,
        shared_expert_size=int(hf.get("shared_expert_intermediate_size") or 0),
    )
    return ModelConfig(
        layers=tuple(layers), moe=moe, qk_norm=True, attention_gate=_gate(hf), **common_fields(hf)
    )


sources = hf_sources
