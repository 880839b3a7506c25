"""Our tensor names and shapes, and where the usual Hugging Face checkpoints keep them.

Names are flat: `embed`, `norm`, `lm_head`, and `layers.{i}.{part}` with parts
  attn_norm, mlp_norm                      [H]
  wq [Hq*D, H], wk [KV*D, H], wv [KV*D, H], wo [H, Hq*D]  (+ bq, bk, bv with attention_bias,
                                           and bo unless attention_output_bias is off)
  q_norm, k_norm                           [D]            (qk_norm)
  wg [Hq, H] or [Hq*D, H]                  softplus output gate (attention_gate)
  wq [Hq*2D, H]                            with attention_gate "sigmoid": each head's D query rows
                                           then its D gate rows
  gdn_*                                    a Gated DeltaNet layer's own weights instead of the
                                           attention ones (`models/gated_deltanet.py`)
  kda_*                                    a KDA layer's own (`models/kimi_delta_attention.py`)
  wq or wq_a, q_a_norm, wq_b; wkv_a, kv_a_norm, wkv_b, wo
                                           a latent attention (MLA) layer's (`models/latent_attention.py`)
  w_gate_up [2I, H], w_down [H, I]         dense MLP, gate rows first
  router [E, H], router_bias [E]           MoE routing (bias: selection-only correction)
  experts_gate_up [E, 2I_e, H], experts_down [E, H, I_e]
  shared_gate_up [2S, H], shared_down [H, S], shared_gate [1, H] (a sigmoid-gated shared expert)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from lucebox.kernels.moe import routing_dtype
from lucebox.models.sources import AnyOf, Cat, Source, Stack

from lucebox.config import ModelConfig


def weight_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    H = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"embed": (cfg.vocab_size, H), "norm": (H,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (cfg.vocab_size, H)
    for i, layer in enumerate(cfg.layers):
        p, Hq = f"layers.{i}.", layer.num_heads
        shapes.update({p + "attn_norm": (H,), p + "mlp_norm": (H,)})
        if layer.attention == "kda":
            shapes.update(kda_shapes(cfg, p))
        elif layer.is_recurrent:
            shapes.update(gated_deltanet_shapes(cfg, p))
        elif cfg.latent_attention is not None:
            shapes.update(latent_attention_shapes(cfg, p, Hq))
        else:
            shapes.update(_attention_shapes(cfg, p, Hq))
        if layer.mlp == "dense":
            shapes.update({p + "w_gate_up": (2 * cfg.intermediate_size, H), p + "w_down": (H, cfg.intermediate_size)})
            continue
        moe = cfg.moe
        E, W = moe.num_experts, moe.expert_size
        shapes.update({p + "router": (E, H), p + "experts_gate_up": (E, 2 * W, H), p + "experts_down": (E, H, W)})
        if moe.correction_bias:
            shapes[p + "router_bias"] = (E,)
        if moe.shared_expert_size:
            S = moe.shared_expert_size
            shapes.update({p + "shared_gate_up": (2 * S, H), p + "shared_down": (H, S)})
            if moe.shared_expert_gate:
                shapes[p + "shared_gate"] = (1, H)
    return shapes


def _attention_shapes(cfg: ModelConfig, p: str, Hq: int) -> dict[str, tuple[int, ...]]:
    H, D, KV = cfg.hidden_size, cfg.head_dim, cfg.num_kv_heads
    q_rows = 2 * Hq * D if cfg.attention_gate == "sigmoid" else Hq * D
    shapes = {p + "wq": (q_rows, H), p + "wk": (KV * D, H), p + "wv": (KV * D, H), p + "wo": (H, Hq * D)}
    if cfg.attention_bias:
        shapes.update({p + "bq": (q_rows,), p + "bk": (KV * D,), p + "bv": (KV * D,)})
        if cfg.attention_output_bias:
            shapes[p + "bo"] = (H,)
    if cfg.qk_norm:
        shapes.update({p + "q_norm": (D,), p + "k_norm": (D,)})
    if cfg.attention_gate in ("head", "element"):
        shapes[p + "wg"] = (Hq if cfg.attention_gate == "head" else Hq * D, H)
    return shapes


def gated_deltanet_shapes(cfg: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """A Gated DeltaNet layer's weights (`models/gated_deltanet.py` describes their row orders; both
    have these shapes)."""
    s, H = cfg.linear_attention, cfg.hidden_size
    r = s.value_heads // s.key_heads
    return {
        p + "gdn_qkvz": (s.key_heads * (2 * s.key_dim + 2 * r * s.value_dim), H),
        p + "gdn_ba": (2 * s.value_heads, H),
        p + "gdn_conv": (s.conv_channels, 1, s.conv_kernel),
        p + "gdn_dt_bias": (s.value_heads,),
        p + "gdn_A_log": (s.value_heads,),
        p + "gdn_norm": (s.value_dim,),
        p + "gdn_out": (H, s.value_heads * s.value_dim),
    }


def kda_shapes(cfg: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """A KDA layer's weights: q, k, v projections, their short conv (one depthwise conv over q | k | v),
    the low-rank decay (f) and output-gate (g) projections, beta, A_log as stored, the gated norm."""
    s, H = cfg.linear_attention, cfg.hidden_size
    HD, D = s.key_heads * s.key_dim, s.key_dim
    return {
        p + "kda_q": (HD, H), p + "kda_k": (HD, H), p + "kda_v": (HD, H),
        p + "kda_conv": (s.conv_channels, 1, s.conv_kernel),
        p + "kda_f_a": (D, H), p + "kda_f_b": (HD, D), p + "kda_dt_bias": (HD,),
        p + "kda_A_log": (1, 1, s.key_heads, 1), p + "kda_b": (s.key_heads, H),
        p + "kda_g_a": (D, H), p + "kda_g_b": (HD, D), p + "kda_norm": (D,), p + "kda_out": (H, HD),
    }


def latent_attention_shapes(cfg: ModelConfig, p: str, Hq: int) -> dict[str, tuple[int, ...]]:
    mla, H = cfg.latent_attention, cfg.hidden_size
    shapes = {p + "wkv_a": (mla.kv_rank + mla.rope_dim, H), p + "kv_a_norm": (mla.kv_rank,),
              p + "wkv_b": (Hq * (mla.nope_dim + mla.value_dim), mla.kv_rank), p + "wo": (H, Hq * mla.value_dim)}
    if mla.q_rank:
        shapes.update({p + "wq_a": (mla.q_rank, H), p + "q_a_norm": (mla.q_rank,),
                       p + "wq_b": (Hq * mla.qk_dim, mla.q_rank)})
    else:
        shapes[p + "wq"] = (Hq * mla.qk_dim, H)
    return shapes


@dataclass(frozen=True)
class MoENames:
    """How an architecture names its MoE tensors under `model.layers.{i}.`."""

    block: str = "mlp"
    router: str = "gate.weight"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    shared: tuple[str, ...] = ("shared_expert", "shared_experts")
    router_bias: tuple[str, ...] = ("experts.e_score_correction_bias", "gate.e_score_correction_bias")


def _gate_up(prefix: str, gate: str, up: str, rows: int) -> Cat:
    return Cat((f"{prefix}{gate}.weight", f"{prefix}{up}.weight"), (rows, rows))


def hf_sources(cfg: ModelConfig, moe_names: MoENames = MoENames()) -> dict[str, Source]:
    """Sources for the Llama-style naming that every supported architecture uses for attention."""
    sources: dict[str, Source] = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight"}
    if not cfg.tie_word_embeddings:
        sources["lm_head"] = "lm_head.weight"
    for i, layer in enumerate(cfg.layers):
        p, hf = f"layers.{i}.", f"model.layers.{i}."
        sources[p + "attn_norm"] = hf + "input_layernorm.weight"
        sources[p + "mlp_norm"] = hf + "post_attention_layernorm.weight"
        if not layer.is_recurrent and cfg.latent_attention is None:  # (others: named by their adapter)
            sources.update(_attention_sources(cfg, p, hf))
        if layer.mlp == "dense":
            sources[p + "w_gate_up"] = _gate_up(hf + "mlp.", "gate_proj", "up_proj", cfg.intermediate_size)
            sources[p + "w_down"] = hf + "mlp.down_proj.weight"
            continue
        sources.update(_moe_sources(cfg, p, f"{hf}{moe_names.block}.", moe_names))
    return sources


def _attention_sources(cfg: ModelConfig, p: str, hf: str) -> dict[str, Source]:
    """An attention layer's weights (a recurrent layer's own are named by its architecture's adapter)."""
    sources: dict[str, Source] = {}
    for ours, theirs in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj"), ("o", "o_proj")):
        sources[p + "w" + ours] = f"{hf}self_attn.{theirs}.weight"
        if cfg.attention_bias and (ours != "o" or cfg.attention_output_bias):
            sources[p + "b" + ours] = f"{hf}self_attn.{theirs}.bias"
    if cfg.qk_norm:
        sources[p + "q_norm"] = hf + "self_attn.q_norm.weight"
        sources[p + "k_norm"] = hf + "self_attn.k_norm.weight"
    if cfg.attention_gate in ("head", "element"):
        sources[p + "wg"] = hf + "self_attn.g_proj.weight"
    return sources


def _moe_sources(cfg: ModelConfig, p: str, hf: str, names: MoENames) -> dict[str, Source]:
    moe = cfg.moe
    experts = range(moe.num_experts)
    per_expert_gate_up = Stack(
        tuple(_gate_up(f"{hf}experts.{e}.", names.gate, names.up, moe.expert_size) for e in experts)
    )
    per_expert_down = Stack(tuple(f"{hf}experts.{e}.{names.down}.weight" for e in experts))
    sources: dict[str, Source] = {
        p + "router": hf + names.router,
        # Per-expert tensors (the published layout) or one fused 3-D tensor (transformers v5 in memory).
        p + "experts_gate_up": AnyOf((per_expert_gate_up, hf + "experts.gate_up_proj")),
        p + "experts_down": AnyOf((per_expert_down, hf + "experts.down_proj")),
    }
    if moe.correction_bias:
        sources[p + "router_bias"] = AnyOf(tuple(hf + n for n in names.router_bias))
    if moe.shared_expert_size:
        S = moe.shared_expert_size
        sources[p + "shared_gate_up"] = AnyOf(
            tuple(_gate_up(f"{hf}{s}.", "gate_proj", "up_proj", S) for s in names.shared)
        )
        sources[p + "shared_down"] = AnyOf(tuple(f"{hf}{s}.down_proj.weight" for s in names.shared))
        if moe.shared_expert_gate:
            sources[p + "shared_gate"] = hf + "shared_expert_gate.weight"
    return sources


def parameter_counts(cfg: ModelConfig) -> tuple[int, int]:
    """(total, active per token). Active counts the weights one token's forward reads: all but the
    routed experts it does not use, and but the input embedding table, of which it reads one row
    (with tied embeddings the table is read whole as the LM head, so it counts)."""
    sizes = {name: math.prod(shape) for name, shape in weight_shapes(cfg).items()}
    total = sum(sizes.values())
    inactive = 0 if cfg.tie_word_embeddings else sizes["embed"]
    if cfg.moe is not None:
        per_expert = 3 * cfg.hidden_size * cfg.moe.expert_size
        moe_layers = sum(1 for layer in cfg.layers if layer.mlp == "moe")
        inactive += moe_layers * (cfg.moe.num_experts - cfg.moe.top_k) * per_expert
    return total, total - inactive


# Linear layers whose weights `quantization=` turns into int8/int4 codes. Embeddings, the output
# head, routers and norms stay in floats: they are small or decide which experts run.
_QUANTIZABLE = ("wq", "wk", "wv", "wo", "wg", "wqkv", "w_gate_up", "w_down", "shared_gate_up", "shared_down",
                "experts_gate_up", "experts_down")


def quantizable(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in _QUANTIZABLE


# Routers and their correction biases are kept in float32 (`routing_dtype`), not the model dtype: they
# are small (E x H) and choose the experts, which a bfloat16 router GEMM can swap (`kernels.moe.moe_route`).
_ROUTERS = ("router", "router_bias")


def stored_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype weight `name` is held in (before any quantization) when the model runs in `dtype`."""
    return routing_dtype(dtype) if name.rsplit(".", 1)[-1] in _ROUTERS else dtype
