"""The Kimi Delta Attention token mixer (KDA, Kimi Linear's "linear_attention" layers): q, k, v
projections, a causal depthwise conv over them, the KDA rule (`kernels/kda.py`: the gated delta
rule with a decay per key channel) over the layer's recurrent state, an RMSNorm gated by a
low-rank projection, and the output projection. H heads of D channels, each its own key and value
head. Like Gated DeltaNet (`models/gated_deltanet.py`) it keeps its state in the forward's context:
a decode/verify step runs the rule row by row and keeps each row's state, a prefill the chunked
rule and its final state.

Weights of layer i (`models/layout.py`): kda_q, kda_k, kda_v [H*D, hidden]; kda_conv [3*H*D, 1, K]
over q | k | v (the checkpoint's q_conv1d, k_conv1d, v_conv1d stacked); the decay's kda_f_a [D, hidden],
kda_f_b [H*D, D], kda_dt_bias [H*D], kda_A_log [1, 1, H, 1]; kda_b [H, hidden] (beta); the output
gate's kda_g_a [D, hidden], kda_g_b [H*D, D]; kda_norm [D]; kda_out [hidden, H*D].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lucebox.kernels.backend import Kernels
from lucebox.kernels.rope import RotaryTables
from lucebox.models.gated_deltanet import (
    PREFILL_CHUNK_ROWS,
    back_to_rows,
    convolved_side_by_side,
    l2_normalized,
    side_by_side,
)

from lucebox.config import ModelConfig

_PARTS = ("q", "k", "v", "conv", "f_a", "f_b", "dt_bias", "A_log", "b", "g_a", "g_b", "norm", "out")


class KimiDeltaAttentionMixer:
    keeps_state = True  # one sequence's state: a forward over several sequences runs it per sequence

    def __init__(self, cfg: ModelConfig, i: int, weights: dict, kernels: Kernels, rope: RotaryTables):
        spec, p = cfg.linear_attention, f"layers.{i}."
        self.layer, self.w, self.kernels, self.eps = i, weights, kernels, cfg.rms_norm_eps
        self.heads, self.dim, self.channels = spec.key_heads, spec.key_dim, spec.conv_channels
        self.names = {n: p + "kda_" + n for n in _PARTS}

    def mix(self, h: torch.Tensor, context) -> torch.Tensor:
        w, n, k = self.w, self.names, self.kernels
        T, H, D = h.shape[0], self.heads, self.dim
        mixed = torch.cat([k.linear(h, w[n["q"]]), k.linear(h, w[n["k"]]), k.linear(h, w[n["v"]])], dim=-1)

        state = context.recurrent_state(self.layer)
        every_row = state.every_row  # a decode/verify step keeps each row's state; a prefill its last
        conv = w[n["conv"]].view(self.channels, -1)
        B, mixed, conv_after, recurrent_state = convolved_side_by_side(k, mixed, conv, state, H)  # B: batch rows
        L = T // B  # rows per sequence
        q, key, v = (part.reshape(L, B * H, D) for part in mixed.split(H * D, dim=-1))
        dt = recurrent_state.dtype  # float32 at least, as the rule computes
        q = l2_normalized(q.to(dt)) * D**-0.5
        key = l2_normalized(key.to(dt))
        beta = side_by_side(k.linear(h, w[n["b"]]).to(dt).sigmoid(), B)
        g = side_by_side(self._log_decay(h, dt), B).view(L, B * H, D)
        if every_row or L == 1:
            out, recurrent_after = k.recurrent_gated_delta_rule(q, key, v.to(dt), g, beta, recurrent_state, every_row)
        else:
            out, recurrent_after = k.chunked_gated_delta_rule(q, key, v.to(dt), g, beta, recurrent_state,
                                                              PREFILL_CHUNK_ROWS)
        state.update(conv_after, recurrent_after)

        gate = k.linear(k.linear(h, w[n["g_a"]]), w[n["g_b"]]).view(T, H, D)
        out = self._gated_norm(back_to_rows(out, B).view(T, H, D), gate).to(h.dtype)
        return k.linear(out.reshape(T, H * D), w[n["out"]])

    def _log_decay(self, h: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
        """g (T, H, D) = -exp(A_log[head]) * softplus(f_b(f_a(h)) + dt_bias): each key channel's own decay."""
        w, n, k, T = self.w, self.names, self.kernels, h.shape[0]
        f = k.linear(k.linear(h, w[n["f_a"]]), w[n["f_b"]]).to(dt) + w[n["dt_bias"]].to(dt)
        rate = w[n["A_log"]].to(dt).exp().view(self.heads, 1)
        return -rate * F.softplus(f.view(T, self.heads, self.dim))

    def _gated_norm(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """RMSNorm over each head's D (weight as stored), times sigmoid(gate), in the rule's dtype."""
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.w[self.names["norm"]].to(x.dtype) * x * torch.sigmoid(gate.to(x.dtype))
