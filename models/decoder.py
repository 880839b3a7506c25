"""The one decoder every architecture runs on: a `ModelConfig` plus a flat dict of tensors.

One sequence at a time (the runtime serves one user): activations are (T, H) for the T rows of
one forward, whether those are a prefill chunk, one decode token or a verify block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lucebox.kernels.attention import attention_over_blocks
from lucebox.kernels.backend import Kernels, kernels_for
from lucebox.kernels.moe import route, swiglu
from lucebox.kernels.rope import RotaryTables

from lucebox.caches import SequenceCache, Step
from lucebox.config import LayerSpec, ModelConfig


class Decoder:
    """`weights` maps internal names to tensors, or to `QuantizedTensor`s for quantized linear
    layers; `kernels` is the backend's operator table (the torch references by default)."""

    def __init__(self, cfg: ModelConfig, weights: dict, kernels: Kernels | None = None):
        self.cfg = cfg
        self.w = weights
        self.kernels = kernels or kernels_for("torch")
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
        x, h = self.embed(token_ids)
        captured: dict[int, torch.Tensor] = {}
        for i in range(len(self.cfg.layers)):
            q, key, value = self.pre_attention(i, h, step.positions)
            x, h = self.post_attention(i, x, h, self.attend(i, q, key, value, step, cache))
            if i in layers:
                captured[i] = x
        features = torch.cat([captured[i] for i in layers], dim=-1) if layers else None
        return h, features

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # (T, V)
        head = self.w["embed"] if self.cfg.tie_word_embeddings else self.w["lm_head"]
        return F.linear(hidden, head)

    # -- the pieces of one forward (`lucebox.engine.runner` composes them into a graphed step) ------------

    def embed(self, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual stream x, first layer's normed input h), both (T, H)."""
        x = F.embedding(token_ids, self.w["embed"])
        return x, self.kernels.rms_norm(x, self.w["layers.0.attn_norm"], self.cfg.rms_norm_eps)

    def pre_attention(self, i: int, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q (T, Hq, D), k and v (T, KV, D) of layer i, QK-normed and rotated."""
        cfg, w, k, p = self.cfg, self.w, self.kernels, f"layers.{i}."
        layer = cfg.layers[i]
        T, D = h.shape[0], cfg.head_dim
        bias = cfg.attention_bias
        q = k.linear(h, w[p + "wq"], w[p + "bq"] if bias else None).view(T, layer.num_heads, D)
        key = k.linear(h, w[p + "wk"], w[p + "bk"] if bias else None).view(T, cfg.num_kv_heads, D)
        value = k.linear(h, w[p + "wv"], w[p + "bv"] if bias else None).view(T, cfg.num_kv_heads, D)
        if cfg.qk_norm:
            q = k.rms_norm(q, w[p + "q_norm"], cfg.rms_norm_eps)
            key = k.rms_norm(key, w[p + "k_norm"], cfg.rms_norm_eps)
        inv_freq, scaling = self.rope.frequencies(layer.rope)
        return (*k.rotate((q, key), positions, inv_freq, scaling), value)

    def attend(self, i: int, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, step: Step,
               cache: SequenceCache) -> torch.Tensor:
        """Write this step's rows into layer i's cache and attend over the blocks it hands out:
        (T, Hq, D). The eager path: the cache may stream blocks from the host."""
        layer_cache = cache.layers[i]
        layer_cache.write(step, key, value)
        return attention_over_blocks(q, step.positions, layer_cache.blocks(q, step), self.scale,
                                     self.cfg.layers[i].window, self.kernels.attention_partial)

    def attend_static(self, i: int, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      positions: torch.Tensor, cache: SequenceCache) -> torch.Tensor:
        """`attend` for a graphed step, after the cache's `reserve`: store the rows and attend over
        the cache's static block, by device work that is the same at every position."""
        layer_cache = cache.layers[i]
        layer_cache.store(positions, key, value)
        block = layer_cache.static_block(q)
        return self.kernels.attention_partial(q, block.k, block.v, positions, block.positions, self.scale,
                                              self.cfg.layers[i].window, block.pinned, block.recent,
                                              k_scale=block.k_scale, v_scale=block.v_scale)[0]

    def post_attention(self, i: int, x: torch.Tensor, h: torch.Tensor, out: torch.Tensor):
        """Gate, output projection, residual + norm, MLP, residual + the next norm: (x, h)."""
        cfg, w, k, p = self.cfg, self.w, self.kernels, f"layers.{i}."
        layer, eps = cfg.layers[i], cfg.rms_norm_eps
        if cfg.attention_gate:
            out = k.softplus_gate(out, k.linear(h, w[p + "wg"]))
        T = out.shape[0]
        bias = w[p + "bo"] if cfg.attention_bias else None
        attn = k.linear(out.reshape(T, layer.num_heads * cfg.head_dim), w[p + "wo"], bias)
        # Each residual add is fused with the norm that reads its result.
        x, h = k.add_rms_norm(x, attn, w[p + "mlp_norm"], eps)
        next_norm = f"layers.{i + 1}.attn_norm" if i + 1 < len(cfg.layers) else "norm"
        return k.add_rms_norm(x, self._mlp(i, layer, h), w[next_norm], eps)

    def _mlp(self, i: int, layer: LayerSpec, h: torch.Tensor) -> torch.Tensor:
        w, k, p = self.w, self.kernels, f"layers.{i}."
        if layer.mlp == "dense":
            return swiglu(h, w[p + "w_gate_up"], w[p + "w_down"], k.linear)
        moe = self.cfg.moe
        weights, ids = route(F.linear(h, w[p + "router"]), moe, w.get(p + "router_bias"))
        shared = (w[p + "shared_gate_up"], w[p + "shared_down"]) if moe.shared_expert_size else ()
        if p + "experts" in w:  # experts in host memory, a device cache of them (lucebox.memory.expert_cache)
            return w[p + "experts"].moe(k.moe_experts, h, weights, ids, moe.routed_scaling, *shared)
        return k.moe_experts(h, w[p + "experts_gate_up"], w[p + "experts_down"], weights, ids, moe.routed_scaling,
                             *shared)
