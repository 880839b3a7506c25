"""A layer's token mixer (the part of a decoder layer that lets rows see other rows), and the
per-forward context it reaches those other rows through.

Two interfaces keep each extension in one place:
- `TokenMixer`, chosen per layer from `cfg.layers[i]` by `token_mixer`: today attention (full or
  sliding, `AttentionMixer`; latent attention, `models/latent_attention.py`) or a recurrent mixer
  (Gated DeltaNet, `models/gated_deltanet.py`; KDA, `models/kimi_delta_attention.py`) with its own
  projections, reading its layer's state cache through the context.
- `ForwardContext`, one per kind of forward (`models/cache_contexts.py`: eager and graphed decoding
  over a `SequenceCache`; `lucebox/training/forward.py`: a batch of whole sequences, or batched
  generation over a growing `BatchCache`): how this forward's rows reach what they attend to. A
  tree-verify mask is one more context; every mixer and the layer loop stay as they are.
"""

from __future__ import annotations

from typing import Protocol

import torch
from lucebox.kernels.backend import Kernels
from lucebox.kernels.rope import RotaryTables, norm_rotate_on_cpu
from lucebox.models.fused_projections import FUSED_BIAS, FUSED_WEIGHT
from lucebox.models.gated_deltanet import GatedDeltaNetMixer
from lucebox.models.kimi_delta_attention import KimiDeltaAttentionMixer
from lucebox.models.latent_attention import LatentAttentionMixer

from lucebox.caches.base import RowTable
from lucebox.config import ModelConfig
from lucebox.errors import ConfigError


class ForwardContext(Protocol):
    """How the rows of one forward reach their context, for every layer of that forward.

    `positions` (N,) int64: each row's absolute position (RoPE). `attend(layer, q, key, value,
    window)` takes layer `layer`'s rotated q (N, Hq, D) and this forward's own k, v (N, KV, D),
    makes k, v visible to this and later forwards where the forward keeps them (a cache write),
    and returns attention (N, Hq, D) of each row over the keys at positions <= its own (and within
    `window` when given) among those already kept and its own. Called once per attention layer,
    in layer order."""

    positions: torch.Tensor

    def attend(self, layer: int, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               window: int | None) -> torch.Tensor: ...

    def row_table(self, layer: int) -> RowTable | None:
        """Where layer `layer`'s cache keeps this forward's rows when the mixer may store them
        itself: norm, RoPE and the store in one operator (`kernels.rope_store`), k and v at the
        positions `slots` (N,), then `attend_stored(layer, q, window, gate)` in place of `attend`
        (with `gate`, softplus gate logits applied to the attention output). None: `attend` stores them."""
        ...

    def recurrent_state(self, layer: int):
        """Recurrent layer `layer`'s state as this forward sees it (a `StateCache.step_state`:
        `current()`, `every_row`, `update(conv, recurrent)`), positioned where this forward's rows start; the
        mixer reads it and stores the state after each row (or after the last, in a prefill). A
        forward over B sequences (rows sequence-major) hands B states side by side, conv
        (K - 1, B*C) and recurrent (B*Hv, Dk, Dv) (`lucebox.training.forward.SideBySideState`).
        Contexts that cannot keep a state refuse with a clear error."""
        ...


class TokenMixer(Protocol):
    """One layer's token mixing: `mix(h, context)` takes the layer's normed input h (N, H) and
    returns what the layer adds to the residual stream (N, H), reaching earlier rows only through
    `context`. It holds no per-forward state: one mixer serves every forward."""

    def mix(self, h: torch.Tensor, context: ForwardContext) -> torch.Tensor: ...


class AttentionMixer:
    """Full or sliding attention of layer i: q/k/v projections (one linear when the loader fused
    them, `models/fused_projections.py`), QK norm, RoPE, attention through the forward's context,
    the optional output gate and the output projection. Where the context names the rows its
    cache stores (`row_table`: a graphed step), norm, RoPE and the store are one operator."""

    def __init__(self, cfg: ModelConfig, i: int, weights: dict, kernels: Kernels, rope: RotaryTables):
        layer, p = cfg.layers[i], f"layers.{i}."
        self.layer, self.window, self.w, self.kernels = i, layer.window, weights, kernels
        self.heads, self.kv_heads, self.head_dim = layer.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qk_norm, self.gate, self.eps = cfg.qk_norm, cfg.attention_gate, cfg.rms_norm_eps
        # Weight names are resolved once; the tensors are looked up per call, so a weight the
        # engine swaps in the dict later (an expert cache, a quantized copy) is the one used.
        bias = cfg.attention_bias
        self.wq, self.wk, self.wv, self.wo, self.wg = (p + n for n in ("wq", "wk", "wv", "wo", "wg"))
        self.bq, self.bk, self.bv = ((p + n) if bias else None for n in ("bq", "bk", "bv"))
        self.bo = p + "bo" if bias and cfg.attention_output_bias else None
        self.fused = (p + FUSED_WEIGHT) if p + FUSED_WEIGHT in weights else None
        self.fused_bias = (p + FUSED_BIAS) if p + FUSED_BIAS in weights else None
        self.q_norm, self.k_norm = p + "q_norm", p + "k_norm"
        self.inv_freq, self.rope_scaling = rope.frequencies(layer.rope)
        self._head_norms: tuple = ()  # (q_norm, k_norm, heads, kv_heads, their weights per head side by side)

    def mix(self, h: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        w, k, T, D = self.w, self.kernels, h.shape[0], self.head_dim
        q, key, value, sigmoid_gate, gate_logits = self.project(h)
        rows = context.row_table(self.layer)
        if rows is not None:
            norms = (w[self.q_norm], w[self.k_norm]) if self.qk_norm else None
            q = k.norm_rope_store(q, key, value, context.positions, self.inv_freq, self.rope_scaling, norms,
                                  self.eps, rows, context.slots)
            out = context.attend_stored(self.layer, q, self.window, gate_logits)  # gated there
            gate_logits = None
        else:
            q, key = self.norm_rope(q, key, context.positions)
            out = context.attend(self.layer, q, key, value, self.window)  # (T, Hq, D)
        if sigmoid_gate is not None:
            out = out * torch.sigmoid(sigmoid_gate)
        elif gate_logits is not None:
            out = k.softplus_gate(out, gate_logits)
        bias = w[self.bo] if self.bo else None
        return k.linear(out.reshape(T, self.heads * D), w[self.wo], bias)

    def qkv(self, h: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q (T, Hq, D), k and v (T, KV, D), QK-normed and rotated, and the sigmoid gate (T, Hq, D)
        whose rows wq holds beside each head's query (attention_gate "sigmoid"), else None."""
        q, key, value, gate, _ = self.project(h)
        return (*self.norm_rope(q, key, positions), value, gate)

    def project(self, h: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """q (T, Hq, D), k and v (T, KV, D) as projected (views of one output when fused), the
        sigmoid gate (T, Hq, D) or None, and the softplus gate's logits (T, Hq or Hq*D) or None."""
        w, k, T, D = self.w, self.kernels, h.shape[0], self.head_dim
        q_rows, kv_rows = self.heads * D * (2 if self.gate == "sigmoid" else 1), self.kv_heads * D
        softplus = self.gate in ("head", "element")
        if self.fused is not None:
            out = k.linear(h, w[self.fused], w[self.fused_bias] if self.fused_bias else None)
            widths = [q_rows, kv_rows, kv_rows] + ([out.shape[1] - q_rows - 2 * kv_rows] if softplus else [])
            q, key, value, *gate = out.split_with_sizes(widths, 1)  # (Tensor.split: a Python wrapper)
            gate_logits = gate[0] if softplus else None
        else:
            q = k.linear(h, w[self.wq], w[self.bq] if self.bq else None)
            key = k.linear(h, w[self.wk], w[self.bk] if self.bk else None)
            value = k.linear(h, w[self.wv], w[self.bv] if self.bv else None)
            gate_logits = k.linear(h, w[self.wg]) if softplus else None
        sigmoid_gate = None
        if self.gate == "sigmoid":
            q, sigmoid_gate = q.view(T, self.heads, 2 * D).split([D, D], dim=-1)
        return (q.view(T, self.heads, D) if sigmoid_gate is None else q, key.view(T, self.kv_heads, D),
                value.view(T, self.kv_heads, D), sigmoid_gate, gate_logits)

    def norm_rope(self, q: torch.Tensor, key: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q and k QK-normed (with qk_norm) and rotated at `positions`."""
        w, k = self.w, self.kernels
        if self.qk_norm and k.name == "torch" and q.device.type == "cpu" and q.dtype == torch.float32 \
                and not q.requires_grad:  # the same bits in fewer dispatches (`rope.norm_rotate_on_cpu`)
            return norm_rotate_on_cpu(q, key, self._head_weights(q.shape[1], key.shape[1]), self.eps, positions,
                                      self.inv_freq, self.rope_scaling)
        if self.qk_norm:
            q, key = k.rms_norm(q, w[self.q_norm], self.eps), k.rms_norm(key, w[self.k_norm], self.eps)
        return k.rotate((q, key), positions, self.inv_freq, self.rope_scaling)


    def _head_weights(self, heads: int, kv_heads: int) -> torch.Tensor:
        """q_norm's weight for each of `heads` heads, then k_norm's for each of `kv_heads`: (heads +
        kv_heads, D), made again only when the norm weights in the dict are other tensors."""
        q_norm, k_norm = self.w[self.q_norm], self.w[self.k_norm]
        made = self._head_norms
        if not made or made[0] is not q_norm or made[1] is not k_norm or made[2:4] != (heads, kv_heads):
            weights = torch.cat((q_norm.expand(heads, -1), k_norm.expand(kv_heads, -1)))
            self._head_norms = made = (q_norm, k_norm, heads, kv_heads, weights)
        return made[4]


# The token mixer of each attention kind a `LayerSpec` names (a sliding layer is attention with a window).
MIXERS: dict[str, type] = {"full": AttentionMixer, "sliding": AttentionMixer, "gdn": GatedDeltaNetMixer,
                           "kda": KimiDeltaAttentionMixer}


def token_mixer(cfg: ModelConfig, i: int, weights: dict, kernels: Kernels, rope: RotaryTables) -> TokenMixer:
    """Layer i's token mixer, by the kind its `LayerSpec.attention` names."""
    kind = cfg.layers[i].attention
    if kind not in MIXERS:
        raise ConfigError(f"layer {i}: no token mixer for attention kind '{kind}' (known: {', '.join(MIXERS)})")
    if kind == "full" and cfg.latent_attention is not None:  # the same cache, K and V made from a latent
        return LatentAttentionMixer(cfg, i, weights, kernels, rope)
    return MIXERS[kind](cfg, i, weights, kernels, rope)
