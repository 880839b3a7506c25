"""Qwen3-Next: a hybrid of Gated DeltaNet layers ("linear_attention") and full attention layers
(every `full_attention_interval`-th, or as `layer_types` lists them). Its attention has a
per-element sigmoid output gate fused into q_proj, QK norm and partial rotary (0.25 by default);
its RMSNorms scale by (1 + weight); its MoE layers have a softmax router and a shared expert
whose output a sigmoid gate scales; dense layers come from mlp_only_layers / decoder_sparse_step.
Its checkpoints also hold a multi-token-prediction head (mtp.*, `mtp_num_hidden_layers` in
config.json): not part of the model (transformers skips it on load too, `MTP_HEAD`), but the
drafter lucebox runs by default (`models/mtp.py`, `speculative/mtp.py`)."""

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
from lucebox.models.sources import Source, Unloaded, renamed

from lucebox.config import LayerSpec, LinearAttentionSpec, ModelConfig, MoESpec
from lucebox.errors import ConfigError

ARCHITECTURES = ("Qwen3NextForCausalLM",)
# The MTP head predicts a further token from the last hidden state: the drafter's weights, read by
# the drafter's own load (draft='auto' or 'mtp'), so the model's load passes over them without a word.
MTP_HEAD = Unloaded("mtp.", "the multi-token-prediction (MTP) head, which the drafter loads", quiet=True)
UNLOADED = (MTP_HEAD,)
_KINDS = {"linear_attention": "gdn", "full_attention": "full"}


def layer_kinds(hf: dict, n: int) -> list[str]:
    """Each layer's kind ("gdn" | "full"): `layer_types`, else every `full_attention_interval`-th
    layer (default 4) is full attention, as transformers derives it."""
    kinds = hf.get("layer_types")
    if kinds is None:
        interval = integer(hf.get("full_attention_interval", 4), "full_attention_interval", 1, 1024)
        return ["full" if (i + 1) % interval == 0 else "gdn" for i in range(n)]
    return named_kinds(kinds, n, _KINDS)


def named_kinds(kinds, n: int, known: dict[str, str]) -> list[str]:
    """`layer_types` (one of `known`'s names per layer) as lucebox's layer kinds."""
    if not isinstance(kinds, list) or len(kinds) != n:
        raise ConfigError(f"config.json: layer_types must list one entry for each of the {n} layers")
    unknown = sorted({str(k) for k in kinds if k not in known})
    if unknown:
        raise ConfigError(f"config.json: layer_types has unknown entries {unknown[:3]} (known: {', '.join(known)})")
    return [known[k] for k in kinds]


def mlp_kinds(hf: dict, n: int) -> list[str]:
    """MoE on every `decoder_sparse_step`-th layer not in `mlp_only_layers` (with experts), else dense."""
    step = integer(hf.get("decoder_sparse_step", 1), "decoder_sparse_step", 1, 1024)
    dense_only = set(hf.get("mlp_only_layers") or [])
    experts = int(hf.get("num_experts") or 0)
    return ["moe" if experts > 0 and i not in dense_only and (i + 1) % step == 0 else "dense" for i in range(n)]


def linear_attention(hf: dict, projections: str) -> LinearAttentionSpec:
    def size(key: str, lowest: int, highest: int) -> int:
        return integer(require(hf, key), key, lowest, highest)

    return LinearAttentionSpec(
        key_heads=size("linear_num_key_heads", 1, 4096),
        value_heads=size("linear_num_value_heads", 1, 4096),
        key_dim=size("linear_key_head_dim", 1, 4096),
        value_dim=size("linear_value_head_dim", 1, 4096),
        conv_kernel=size("linear_conv_kernel_dim", 1, 64),
        projections=projections,
    )


def hybrid_config(hf: dict, mlps: list[str], moe: MoESpec | None, projections: str) -> ModelConfig:
    """What Qwen3-Next and Qwen3.5 share: layer kinds, gated attention with QK norm and partial
    rotary (0.25 unless stated, transformers' default for both), (1 + w) norms, the GDN shapes."""
    kinds = layer_kinds(hf, len(mlps))
    params = rope_parameters(hf)
    params.setdefault("partial_rotary_factor", 0.25)
    rope = rope_spec(params, head_dim(hf), hf.get("max_position_embeddings", 32768))
    heads = int(require(hf, "num_attention_heads"))
    layers = tuple(LayerSpec(kind, heads, rope, mlp) for kind, mlp in zip(kinds, mlps, strict=True))
    return ModelConfig(layers=layers, moe=moe, qk_norm=True, attention_gate="sigmoid",
                       linear_attention=linear_attention(hf, projections), norm_offset=1.0, **common_fields(hf))


def gated_shared_expert_moe(hf: dict, normalize: bool) -> MoESpec:
    """Softmax top-k routing, and a shared expert scaled by a sigmoid gate when it has a width."""
    base = softmax_moe(hf, ("num_experts",), normalize=normalize)
    shared = integer(hf.get("shared_expert_intermediate_size", 0) or 0, "shared_expert_intermediate_size", 0, 2**20)
    return replace(base, shared_expert_size=shared, shared_expert_gate=shared > 0)


def build_config(hf: dict) -> ModelConfig:
    n = int(require(hf, "num_hidden_layers"))
    mlps = mlp_kinds(hf, n)
    moe = gated_shared_expert_moe(hf, bool(hf.get("norm_topk_prob", True))) if "moe" in mlps else None
    return hybrid_config(hf, mlps, moe, projections="grouped")


def gdn_sources(cfg: ModelConfig, projections: dict[str, Source]) -> dict[str, Source]:
    """Each linear_attn module's weights: `projections` gives the sources of `qkvz` and `ba`, named
    relative to the module; the rest are named alike in Qwen3-Next and Qwen3.5."""
    out: dict[str, Source] = {}
    for i, layer in enumerate(cfg.layers):
        if not layer.is_recurrent:
            continue
        p, hf = f"layers.{i}.gdn_", f"model.layers.{i}.linear_attn."
        out.update({p + part: renamed(source, lambda name, hf=hf: hf + name) for part, source in projections.items()})
        out.update({p + "conv": hf + "conv1d.weight", p + "dt_bias": hf + "dt_bias", p + "A_log": hf + "A_log",
                    p + "norm": hf + "norm.weight", p + "out": hf + "out_proj.weight"})
    return out


def sources(cfg: ModelConfig) -> dict[str, Source]:
    """The Llama-style names of the attention and MLP weights, and each linear_attn module's own."""
    return {**hf_sources(cfg), **gdn_sources(cfg, {"qkvz": "in_proj_qkvz.weight", "ba": "in_proj_ba.weight"})}
