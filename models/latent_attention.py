"""Multi-head latent attention (MLA) as plain attention over the engine's K/V caches (Kimi Linear's
full layers; `LatentAttentionSpec`).

MLA compresses K and V into one latent per token: kv_a projects the hidden state to a kv_rank
latent (RMS-normed) and a rope_dim key part all heads share; kv_b expands the latent into each
head's nope_dim key part and value_dim value. The query comes from wq, or through its own q_rank
latent (wq_a, RMSNorm, wq_b). The simplest exact route is taken: the expanded per-head K (nope |
shared part) and V are what the cache stores, so every cache kind, speculation and KVFlash work
unchanged. The caches hold one head size, head_dim = max(qk_dim, value_dim): the narrower of K and
V is zero-padded (zeros add nothing to a dot product nor to a weighted sum of values), and the
output keeps the first value_dim features. Kimi Linear rotates nothing ("NoPE"; transformers has
no rotary embedding in this model), so no RoPE is applied here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lucebox.kernels.backend import Kernels
from lucebox.kernels.rope import RotaryTables

from lucebox.config import ModelConfig

# transformers builds MLA's two latent RMSNorms with their class's default epsilon, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def padded(x: torch.Tensor, size: int) -> torch.Tensor:
    """x (..., d) with zeros appended to `size` features (x itself when d == size)."""
    return x if x.shape[-1] == size else F.pad(x, (0, size - x.shape[-1]))


class LatentAttentionMixer:
    def __init__(self, cfg: ModelConfig, i: int, weights: dict, kernels: Kernels, rope: RotaryTables):
        mla, p = cfg.latent_attention, f"layers.{i}."
        self.layer, self.w, self.kernels, self.eps = i, weights, kernels, LATENT_NORM_EPS
        self.mla, self.heads, self.head_dim = mla, cfg.layers[i].num_heads, cfg.head_dim
        self.names = {n: p + n for n in ("wq", "wq_a", "q_a_norm", "wq_b", "wkv_a", "kv_a_norm", "wkv_b", "wo")}
        # The context scales scores by head_dim ** -0.5; MLA's scale is qk_dim ** -0.5 (they differ
        # only when value_dim > qk_dim pads q and k).
        self.q_scale = (self.head_dim / mla.qk_dim) ** 0.5

    def mix(self, h: torch.Tensor, context) -> torch.Tensor:
        w, n, k, mla = self.w, self.names, self.kernels, self.mla
        T, Hq, D = h.shape[0], self.heads, self.head_dim
        q = self._query(h).view(T, Hq, mla.qk_dim)
        latent, shared = k.linear(h, w[n["wkv_a"]]).split([mla.kv_rank, mla.rope_dim], dim=-1)
        kv = k.linear(k.rms_norm(latent, w[n["kv_a_norm"]], self.eps), w[n["wkv_b"]]).view(T, Hq, -1)
        key_nope, value = kv.split([mla.nope_dim, mla.value_dim], dim=-1)
        key = torch.cat([key_nope, shared[:, None, :].expand(T, Hq, mla.rope_dim)], dim=-1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        out = context.attend(self.layer, padded(q, D), padded(key, D), padded(value, D), None)  # (T, Hq, D)
        return k.linear(out[..., :mla.value_dim].reshape(T, Hq * mla.value_dim), w[n["wo"]])

    def _query(self, h: torch.Tensor) -> torch.Tensor:
        w, n, k = self.w, self.names, self.kernels
        if not self.mla.q_rank:
            return k.linear(h, w[n["wq"]])
        return k.linear(k.rms_norm(k.linear(h, w[n["wq_a"]]), w[n["q_a_norm"]], self.eps), w[n["wq_b"]])
