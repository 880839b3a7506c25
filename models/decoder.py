"""The one decoder every architecture runs on: a `ModelConfig` plus a flat dict of tensors.

One sequence at a time (the runtime serves one user): activations are (T, H) for the T rows of
one forward, whether those are a prefill chunk, one decode token or a verify block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lucebox.kernels.attention import attention_over_blocks
from lucebox.kernels.moe import moe_experts, route, swiglu
from lucebox.kernels.norm import rms_norm
from lucebox.kernels.rope import RotaryTables, apply_rope

from lucebox.caches import SequenceCache, Step
from lucebox.config import LayerSpec, ModelConfig


class Decoder:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor]):
        self.cfg = cfg
        self.w = weights
        first = weights["embed"]
        self.dtype, self.device = first.dtype, first.device
        self.rope = RotaryTables(self.device)
        self.scale = cfg.head_dim**-0.5

    def forward(
        self,
        token_ids: torch.Tensor,  # (T,) int64
        step: Step,
        cache: SequenceCache,
    ) -> torch.Tensor:  # (T, H), after the final norm
        return self.forward_capturing(token_ids, step, cache, ())[0]

    def forward_capturing(
        self, token_ids: torch.Tensor, step: Step, cache: SequenceCache, layers: tuple[int, ...]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden (T, H) after the final norm, the outputs of decoder `layers` side by side
        (T, len(layers) * H), or None) from one forward: what a DFlash drafter reads."""
        x = F.embedding(token_ids, self.w["embed"])
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.cfg.layers):
            h = rms_norm(x, self.w[f"layers.{i}.attn_norm"], self.cfg.rms_norm_eps)
            x = x + self._attention(i, layer, h, step, cache)
            x = x + self._mlp(i, layer, rms_norm(x, self.w[f"layers.{i}.mlp_norm"], self.cfg.rms_norm_eps))
            if i in layers:
                captured[i] = x
        features = torch.cat([captured[i] for i in layers], dim=-1) if layers else None
        return rms_norm(x, self.w["norm"], self.cfg.rms_norm_eps), features

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # (T, V)
        head = self.w["embed"] if self.cfg.tie_word_embeddings else self.w["lm_head"]
        return F.linear(hidden, head)

    def _attention(
        self, i: int, layer: LayerSpec, h: torch.Tensor, step: Step, cache: SequenceCache
    ) -> torch.Tensor:
        cfg, w, p = self.cfg, self.w, f"layers.{i}."
        T, D = h.shape[0], cfg.head_dim
        bias = cfg.attention_bias
        q = F.linear(h, w[p + "wq"], w[p + "bq"] if bias else None).view(T, layer.num_heads, D)
        k = F.linear(h, w[p + "wk"], w[p + "bk"] if bias else None).view(T, cfg.num_kv_heads, D)
        v = F.linear(h, w[p + "wv"], w[p + "bv"] if bias else None).view(T, cfg.num_kv_heads, D)
        if cfg.qk_norm:
            q = rms_norm(q, w[p + "q_norm"], cfg.rms_norm_eps)
            k = rms_norm(k, w[p + "k_norm"], cfg.rms_norm_eps)
        cos, sin = self.rope.cos_sin(layer.rope, step.positions, self.dtype)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        layer_cache = cache.layers[i]
        layer_cache.write(step, k, v)
        blocks = layer_cache.blocks(q, step)
        out = attention_over_blocks(q, step.positions, blocks, self.scale, layer.window)  # (T, Hq, D)
        if cfg.attention_gate:
            # softplus in float32, as the reference does; one gate per head or per element.
            gate = F.softplus(F.linear(h, w[p + "wg"]).float()).to(out.dtype)
            out = out * (gate[:, :, None] if cfg.attention_gate == "head" else gate.view(T, layer.num_heads, D))
        return F.linear(out.reshape(T, layer.num_heads * D), w[p + "wo"], w[p + "bo"] if bias else None)

    def _mlp(self, i: int, layer: LayerSpec, h: torch.Tensor) -> torch.Tensor:
        w, p = self.w, f"layers.{i}."
        if layer.mlp == "dense":
            return swiglu(h, w[p + "w_gate_up"], w[p + "w_down"])
        moe = self.cfg.moe
        weights, ids = route(F.linear(h, w[p + "router"]), moe, w.get(p + "router_bias"))
        out = moe_experts(h, w[p + "experts_gate_up"], w[p + "experts_down"], weights, ids)
        if moe.routed_scaling != 1.0:
            out = out * moe.routed_scaling
        if moe.shared_expert_size:
            out = out + swiglu(h, w[p + "shared_gate_up"], w[p + "shared_down"])
        return out
