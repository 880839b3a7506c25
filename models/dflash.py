"""DFlash block drafters: z-lab's public format (`DFlashDraftModel`) and Laguna's
(`DFlashLagunaForCausalLM`), one implementation with a few switches.

One draft pass fills a block [last, MASK x (block_size - 1)] at once. In every drafter layer the
block's queries attend over [context ; block]: the context rows are the target's hidden states
of `target_layer_ids` for the committed tokens, concatenated and projected by `fc` (+ norms), and
kept as K/V in a ring (`context_rows` writes them once per committed token). The drafter has no
embedding or LM head of its own; it uses the target's. Target layer id i means the output of
decoder layer i (the residual stream after it, before the final norm): index i + 1 of a hidden
states tuple whose index 0 is the embeddings.

The Laguna variant (as its public config and ports describe it) adds an RMSNorm per captured
target layer before the concatenation, applies each layer's input norm to the context features
before their K/V projection, gates each head's output with softplus(g_proj(x)), and attends
causally with a sliding window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from lucebox.kernels.attention import merge_partials
from lucebox.kernels.backend import Kernels, kernels_for
from lucebox.kernels.moe import swiglu
from lucebox.kernels.rope import RotaryTables
from lucebox.models.dspark import DSparkConfig, DSparkHeads, head_shapes, head_sources, heads_config
from lucebox.models.hf_config import (
    architecture_name,
    check_values,
    integer,
    number,
    require,
    rope_parameters,
    rope_spec,
)
from lucebox.models.sources import AnyOf, Cat, Source
from lucebox.models.speculators_layout import ARCHITECTURES as SPECULATORS
from lucebox.models.speculators_layout import from_speculators, is_speculators

from lucebox.caches import SlidingRing, Step
from lucebox.config import RopeSpec
from lucebox.errors import ConfigError, DraftModelError

ARCHITECTURES = ("DFlashDraftModel", "DFlashLagunaForCausalLM", *SPECULATORS.values())


@dataclass(frozen=True)
class DFlashConfig:
    laguna: bool  # the Laguna variant's switches
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    windows: tuple[int | None, ...]  # per layer; None: full attention
    causal: bool  # causal inside the block (sliding layers always are)
    rope: RopeSpec
    rms_norm_eps: float
    target_layer_ids: tuple[int, ...]
    block_size: int
    mask_token_id: int
    vocab_size: int
    attention_bias: bool = False
    gate: str | None = None  # None | "head" | "element"
    output_multiplier: float = 1.0
    logit_softcap: float = 0.0
    embedding_scale: float = 1.0
    heads: DSparkConfig | None = None  # DSpark's Markov and confidence heads (models/dspark.py)

    @property
    def num_layers(self) -> int:
        return len(self.windows)


def _value(hf: dict, name: str, default=None):
    """dflash_config entries take precedence over top-level keys (both layouts exist)."""
    return (hf.get("dflash_config") or {}).get(name, hf.get(name, default))


def _check_values(hf: dict) -> None:
    """What `build_config` computes with, in type and range before it is used: the sizes every
    config.json is held to (a head count of 0 would divide), and the DFlash keys."""
    check_values(hf)
    for key, lowest, highest in (("block_size", 1, 4096), ("mask_token_id", 0, 2**31 - 1)):
        if _value(hf, key) is not None:
            integer(_value(hf, key), key, lowest, highest)
    ids = _value(hf, "target_layer_ids")
    if ids is not None and (not isinstance(ids, list) or len(ids) > 1024):
        raise ConfigError("config.json: target_layer_ids must be a list of at most 1024 layer indices")
    for i, layer in enumerate(ids or ()):
        integer(layer, f"target_layer_ids[{i}]", 0, 1023)


def build_config(hf: dict) -> DFlashConfig:
    """The drafter's config (z-lab, Laguna or Speculators layout); a malformed value becomes a
    DraftModelError naming it."""
    if is_speculators(hf):
        hf = from_speculators(hf)
    arch = architecture_name(hf)
    if arch not in ARCHITECTURES:
        raise DraftModelError(f"drafter architecture {arch!r} is not a DFlash drafter ({', '.join(ARCHITECTURES)})")
    try:
        _check_values(hf)
        return _build_config(hf, laguna=arch == "DFlashLagunaForCausalLM")
    except ConfigError as e:
        raise DraftModelError(f"drafter {e}") from None
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise DraftModelError(f"drafter config.json has a value of the wrong type or form ({type(e).__name__}: "
                              f"{e})") from None


def _build_config(hf: dict, laguna: bool) -> DFlashConfig:
    ids = _value(hf, "target_layer_ids")
    if not ids:
        raise DraftModelError("drafter config.json has no dflash_config.target_layer_ids: which target layers to read")
    mask = _value(hf, "mask_token_id")
    if mask is None:
        raise DraftModelError("drafter config.json has no dflash_config.mask_token_id")
    n = int(require(hf, "num_hidden_layers"))
    kinds = hf.get("layer_types") or ["full_attention"] * n
    if len(kinds) != n:
        raise DraftModelError(f"drafter config.json: layer_types has {len(kinds)} entries for {n} layers")
    windows = tuple(int(require(hf, "sliding_window")) if k == "sliding_attention" else None for k in kinds)
    heads = int(require(hf, "num_attention_heads"))
    head_dim = int(hf.get("head_dim") or require(hf, "hidden_size") // heads)
    params = rope_parameters(hf)
    if isinstance(params.get("full_attention"), dict):  # Laguna-style per-kind RoPE: the drafter's own kind
        params = rope_parameters(hf, params["sliding_attention" if windows[0] else "full_attention"])
    vocab_size = int(require(hf, "vocab_size"))
    if hf.get("draft_vocab_size") not in (None, vocab_size):
        raise DraftModelError("drafters with a reduced draft vocabulary (draft_vocab_size, d2t/t2d) are not supported")
    gating = hf.get("gating", True) if laguna else False
    causal = bool(_value(hf, "causal", _value(hf, "is_causal", False)))
    return DFlashConfig(
        laguna=laguna, hidden_size=int(require(hf, "hidden_size")), num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads), head_dim=head_dim,
        intermediate_size=int(require(hf, "intermediate_size")), windows=windows, causal=causal,
        rope=rope_spec(params, head_dim, int(hf.get("max_position_embeddings", 32768))),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)), target_layer_ids=tuple(int(i) for i in ids),
        block_size=int(_value(hf, "block_size", 16)), mask_token_id=int(mask), vocab_size=vocab_size,
        attention_bias=bool(hf.get("attention_bias", False)),
        gate={True: "head", "per-head": "head", "per-element": "element"}.get(gating),
        output_multiplier=number(_value(hf, "output_multiplier", 1.0) or 1.0, "output_multiplier"),
        logit_softcap=number(_value(hf, "final_logit_softcapping", 0.0) or 0.0, "final_logit_softcapping"),
        embedding_scale=number(_value(hf, "input_embedding_scale", 1.0) or 1.0, "input_embedding_scale"),
        heads=heads_config(hf["dspark_config"]) if isinstance(hf.get("dspark_config"), dict) else None,
    )


def weight_shapes(cfg: DFlashConfig) -> dict[str, tuple[int, ...]]:
    H, D, Hq, KV, F_ = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    n = len(cfg.target_layer_ids)
    shapes = {"fc": (H, n * H), "hidden_norm": (H,), "norm": (H,)}
    if cfg.laguna:
        shapes.update({f"aux_norms.{i}": (H,) for i in range(n)})
    for layer in range(cfg.num_layers):
        p = f"layers.{layer}."
        shapes.update({p + "attn_norm": (H,), p + "mlp_norm": (H,), p + "wqkv": ((Hq + 2 * KV) * D, H),
                       p + "wo": (H, Hq * D), p + "q_norm": (D,), p + "k_norm": (D,),
                       p + "w_gate_up": (2 * F_, H), p + "w_down": (H, F_)})
        if cfg.attention_bias:
            shapes[p + "bqkv"] = ((Hq + 2 * KV) * D,)
        if cfg.gate:
            shapes[p + "wg"] = (Hq if cfg.gate == "head" else Hq * D, H)
    return {**shapes, **(head_shapes(cfg.heads, H, cfg.vocab_size) if cfg.heads else {})}


def sources(cfg: DFlashConfig) -> dict[str, Source]:
    """Checkpoint names, with or without a `model.` prefix; q/k/v separate or fused in qkv_proj."""

    def named(name: str) -> Source:
        return AnyOf((name, "model." + name))

    def cat(names: tuple[str, ...], rows: tuple[int, ...]) -> Source:
        return AnyOf(tuple(Cat(tuple(prefix + n for n in names), rows) for prefix in ("", "model.")))

    D, Hq, KV, F_ = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size
    out: dict[str, Source] = {"fc": named("fc.weight"), "hidden_norm": named("hidden_norm.weight"),
                              "norm": named("norm.weight")}
    if cfg.laguna:
        out.update({f"aux_norms.{i}": named(f"aux_hidden_norms.{i}.weight") for i in range(len(cfg.target_layer_ids))})
    qkv_rows = (Hq * D, KV * D, KV * D)
    for layer in range(cfg.num_layers):
        p, a = f"layers.{layer}.", f"layers.{layer}.self_attn."
        out[p + "attn_norm"] = named(p + "input_layernorm.weight")
        out[p + "mlp_norm"] = named(p + "post_attention_layernorm.weight")
        split = cat((a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"), qkv_rows)
        out[p + "wqkv"] = AnyOf((split, named(a + "qkv_proj.weight")))
        if cfg.attention_bias:
            split_bias = cat((a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"), qkv_rows)
            out[p + "bqkv"] = AnyOf((split_bias, named(a + "qkv_proj.bias")))
        out[p + "wo"] = named(a + "o_proj.weight")
        out[p + "q_norm"] = named(a + "q_norm.weight")
        out[p + "k_norm"] = named(a + "k_norm.weight")
        if cfg.gate:
            out[p + "wg"] = named(a + "g_proj.weight")
        m = p + "mlp."
        gate_up = cat((m + "gate_proj.weight", m + "up_proj.weight"), (F_, F_))
        out[p + "w_gate_up"] = AnyOf((gate_up, named(m + "gate_up_proj.weight")))
        out[p + "w_down"] = named(m + "down_proj.weight")
    return {**out, **(head_sources(cfg.heads) if cfg.heads else {})}


class DFlashDrafter:
    """A DFlash drafter: `context_rows` writes the target's features of committed tokens into its rings,
    `draft` turns a block of embeddings into hidden states read through the target's LM head (`logits`)."""

    def __init__(self, cfg: DFlashConfig, weights: dict[str, torch.Tensor], kernels: Kernels | None = None):
        self.cfg, self.w = cfg, weights
        self.kernels = kernels or kernels_for("torch")
        self.dtype, self.device = weights["fc"].dtype, weights["fc"].device
        self.rope = RotaryTables(self.device)
        self.scale = cfg.head_dim**-0.5
        self.heads = DSparkHeads(cfg.heads, weights) if cfg.heads else None

    def logits(self, target, hidden: torch.Tensor) -> torch.Tensor:
        """Logits (float32) of drafted rows through the target's LM head (`target`: its `Decoder`),
        with the drafter's output scaling and soft cap."""
        cfg = self.cfg
        logits = target.logits(hidden).float() * cfg.output_multiplier
        if cfg.logit_softcap > 0:
            logits = torch.tanh(logits / cfg.logit_softcap) * cfg.logit_softcap
        return logits

    def norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """RMSNorm of x's last dimension with the weight `name` ("norm", "layers.{i}.attn_norm", ...)."""
        return self.kernels.rms_norm(x, self.w[name], self.cfg.rms_norm_eps)

    def split_qkv(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x (T, H) -> layer's q (T, heads, D) and k, v (T, kv_heads, D); q and k normed, not rotated."""
        cfg, p = self.cfg, f"layers.{layer}."
        qkv = F.linear(x, self.w[p + "wqkv"], self.w.get(p + "bqkv"))
        q, k, v = qkv.split([cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim,
                             cfg.num_kv_heads * cfg.head_dim], dim=-1)
        T = x.shape[0]
        q = self.norm(q.view(T, cfg.num_heads, cfg.head_dim), p + "q_norm")
        k = self.norm(k.reshape(T, cfg.num_kv_heads, cfg.head_dim), p + "k_norm")
        return q, k, v.reshape(T, cfg.num_kv_heads, cfg.head_dim)

    def project_features(self, features: torch.Tensor) -> torch.Tensor:
        """Target features (T, n*H) -> the context rows (T, H) every layer's keys and values come from."""
        cfg = self.cfg
        x = features.to(self.dtype)
        if cfg.laguna:  # one norm per captured target layer, before the concatenation
            parts = x.view(x.shape[0], len(cfg.target_layer_ids), cfg.hidden_size).unbind(1)
            x = torch.cat([self.norm(part, f"aux_norms.{i}") for i, part in enumerate(parts)], dim=-1)
        return self.norm(F.linear(x, self.w["fc"]), "hidden_norm")

    def context_kv(self, layer: int, ctx: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s keys (rotated) and values (T, kv_heads, D) of projected context rows (T, H)."""
        src = self.norm(ctx, f"layers.{layer}.attn_norm") if self.cfg.laguna else ctx
        _, k, v = self.split_qkv(layer, src)
        inv_freq, scaling = self.rope.frequencies(self.cfg.rope)
        return self.kernels.rotate((k,), positions, inv_freq, scaling)[0], v

    def context_rows(self, features: torch.Tensor, step: Step, rings: list[SlidingRing]) -> None:
        """Project committed tokens' target features (T, n*H) into every layer's context ring."""
        ctx = self.project_features(features)
        for layer, ring in enumerate(rings):
            ring.write(step, *self.context_kv(layer, ctx, step.positions))

    def run_layer(self, layer: int, x: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        """One layer over block rows x (R, H) at `positions` (R,), for the engine's draft and training's
        forward alike; `attend(layer, q, k, v)`: the attention output (R, heads, D) over what the
        rows see (a context ring, or the training sequences' context under a mask)."""
        cfg, kern, p = self.cfg, self.kernels, f"layers.{layer}."
        inv_freq, scaling = self.rope.frequencies(cfg.rope)
        h = self.norm(x, p + "attn_norm")
        q, k, v = self.split_qkv(layer, h)
        q, k = kern.rotate((q, k), positions, inv_freq, scaling)
        out = attend(layer, q, k, v)
        if cfg.gate:
            out = kern.softplus_gate(out, F.linear(h, self.w[p + "wg"]))
        x = x + F.linear(out.reshape(x.shape[0], -1), self.w[p + "wo"])
        return x + swiglu(self.norm(x, p + "mlp_norm"), self.w[p + "w_gate_up"], self.w[p + "w_down"], kern.linear)

    def draft(self, block_embeddings: torch.Tensor, positions: torch.Tensor, rings: list[SlidingRing],
              step: Step | None = None) -> torch.Tensor:
        """Hidden states (B, H) of the block at `positions` (B,), after the final norm. `step`: the
        block's step, eagerly (each ring read up to its highest row); None in a graph's body (each
        ring read whole, its empty slots masked: no host value read)."""
        cfg, kern, x = self.cfg, self.kernels, block_embeddings.to(self.dtype)
        # Inside a non-causal block every row sees every row: present the block keys as if all
        # queries sat at the block's last position.
        block_end = positions[-1:].expand_as(positions)

        def attend(layer: int, q, k, v):  # the layer's context ring, then the block itself
            window, ring = cfg.windows[layer], rings[layer]
            block_q_positions = positions if cfg.causal or window is not None else block_end
            ring_block = ring.static_block(q) if step is None else next(iter(ring.blocks(q, step)))
            return merge_partials([kern.attention_partial(q, ring_block.k, ring_block.v, positions,
                                                          ring_block.positions, self.scale, window),
                                   kern.attention_partial(q, k.transpose(0, 1), v.transpose(0, 1), block_q_positions,
                                                          positions, self.scale, window)])

        for layer in range(len(rings)):
            x = self.run_layer(layer, x, positions, attend)
        return self.norm(x, "norm")
