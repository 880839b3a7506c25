"""The Gated DeltaNet token mixer (Qwen3-Next's "linear_attention" layers): projections, a causal
depthwise conv over q, k and v, the gated delta rule over the layer's recurrent state, a gated
RMSNorm and the output projection. The state lives in the forward's context
(`ForwardContext.recurrent_state`), which also says where this step starts. A decode/verify step
runs the recurrent rule row by row and keeps the state after every row (speculation commits the
accepted row's); a prefill runs the chunked rule and keeps its final state.

Weights of layer i (`models/layout.py`):
  gdn_qkvz [2*Hk*Dk + 2*Hv*Dv, H], gdn_ba [2*Hv, H],
  gdn_conv [C, 1, K] over the channels q (Hk*Dk) | k (Hk*Dk) | v (Hv*Dv),
  gdn_dt_bias [Hv], gdn_A_log [Hv], gdn_norm [Dv], gdn_out [H, Hv*Dv].
The rows of gdn_qkvz and gdn_ba come in one of two orders (`LinearAttentionSpec.projections`):
  "grouped" (Qwen3-Next's in_proj_qkvz / in_proj_ba): for each key head, its q (Dk), k (Dk), then
      the v (r*Dv) and z (r*Dv) of the r = Hv/Hk value heads it serves; gdn_ba: each key head's
      r b's then r a's;
  "flat" (Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a one after the other): q | k | v | z
      and b | a, each whole, so q | k | v are already the conv's channels.
Either way value head j belongs to key head j // r.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lucebox.kernels.backend import Kernels
from lucebox.kernels.rope import RotaryTables

from lucebox.config import ModelConfig

PREFILL_CHUNK_ROWS = 64  # rows per chunk of the chunked delta rule


def l2_normalized(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, as flash-linear-attention normalizes q and k."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def side_by_side(x: torch.Tensor, B: int) -> torch.Tensor:
    """Rows (B*L, ...) of B sequences, sequence-major -> (L, B * ...): row l of every sequence together."""
    return x.view(B, x.shape[0] // B, -1).transpose(0, 1).reshape(x.shape[0] // B, -1)


def back_to_rows(x: torch.Tensor, B: int) -> torch.Tensor:
    """The inverse of `side_by_side`: (L, B * ...) -> rows (B*L, ...) flattened per row."""
    return x.reshape(x.shape[0], B, -1).transpose(0, 1).reshape(B * x.shape[0], -1)


def convolved_side_by_side(kernels: Kernels, mixed: torch.Tensor, weight: torch.Tensor, state, heads: int):
    """The step's conv over `mixed` (T, C) from `state` (a `StepState`, or a training batch's).

    A state of B sequences (a training batch, rows sequence-major) holds them side by side: B*C conv
    channels, B*heads recurrent heads. The conv is depthwise and the delta rule runs per head, so the
    batch runs as one sequence of T / B rows, and no sequence sees another's rows (B = 1 for the
    engine: a no-op). Returns (B, conv output (T / B, B, C), the conv state(s) after, the recurrent
    state the rule starts from)."""
    conv_state, recurrent_state = state.current()
    B = recurrent_state.shape[0] // heads
    out, conv_after = kernels.causal_conv1d(side_by_side(mixed, B), weight.repeat(B, 1), conv_state, state.every_row)
    return B, out.reshape(out.shape[0], B, -1), conv_after, recurrent_state


class GatedDeltaNetMixer:
    keeps_state = True  # one sequence's state: a forward over several sequences runs it per sequence

    def __init__(self, cfg: ModelConfig, i: int, weights: dict, kernels: Kernels, rope: RotaryTables):
        spec, p = cfg.linear_attention, f"layers.{i}."
        self.layer, self.w, self.kernels, self.eps = i, weights, kernels, cfg.rms_norm_eps
        self.key_heads, self.value_heads = spec.key_heads, spec.value_heads
        self.key_dim, self.value_dim = spec.key_dim, spec.value_dim
        self.group = spec.value_heads // spec.key_heads  # value heads per key head
        self.channels = spec.conv_channels
        self.grouped = spec.projections == "grouped"
        self.names = {n: p + "gdn_" + n for n in ("qkvz", "ba", "conv", "dt_bias", "A_log", "norm", "out")}

    def mix(self, h: torch.Tensor, context) -> torch.Tensor:
        w, n, k = self.w, self.names, self.kernels
        T, Hk, Hv, Dk, Dv, r = h.shape[0], self.key_heads, self.value_heads, self.key_dim, self.value_dim, self.group
        qkvz, ba = k.linear(h, w[n["qkvz"]]), k.linear(h, w[n["ba"]])
        mixed, z, b, a = self._grouped(qkvz, ba) if self.grouped else self._flat(qkvz, ba)

        state = context.recurrent_state(self.layer)
        every_row = state.every_row  # a decode/verify step keeps each row's state; a prefill its last
        conv = w[n["conv"]].view(self.channels, -1)
        B, mixed, conv_after, recurrent_state = convolved_side_by_side(k, mixed, conv, state, Hv)
        L = T // B  # rows per sequence
        q, key, v = mixed.split([Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
        # Each key head serves `r` consecutive value heads.
        q = q.reshape(L, B * Hk, Dk).repeat_interleave(r, dim=1)
        key = key.reshape(L, B * Hk, Dk).repeat_interleave(r, dim=1)
        dt = recurrent_state.dtype  # float32 at least, as the delta rule computes
        q = l2_normalized(q.to(dt)) * Dk**-0.5
        key = l2_normalized(key.to(dt))
        beta = side_by_side(b.reshape(T, Hv).to(dt).sigmoid(), B)
        g = -w[n["A_log"]].to(dt).exp() * F.softplus(a.reshape(T, Hv).to(dt) + w[n["dt_bias"]].to(dt))  # log decay
        g = side_by_side(g, B)
        v = v.reshape(L, B * Hv, Dv).to(dt)
        if every_row or L == 1:
            out, recurrent_after = k.recurrent_gated_delta_rule(q, key, v, g, beta, recurrent_state, every_row)
        else:
            out, recurrent_after = k.chunked_gated_delta_rule(q, key, v, g, beta, recurrent_state, PREFILL_CHUNK_ROWS)
        state.update(conv_after, recurrent_after)

        out = self._gated_norm(back_to_rows(out, B).reshape(T, Hv, Dv), z.reshape(T, Hv, Dv)).to(h.dtype)
        return k.linear(out.reshape(T, Hv * Dv), w[n["out"]])

    def _grouped(self, qkvz: torch.Tensor, ba: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per key head rows -> conv input [T, C] (q | k | v), z [T, Hv*Dv], b [T, Hv], a [T, Hv]."""
        T, Hk, Dk, Dv, r = qkvz.shape[0], self.key_heads, self.key_dim, self.value_dim, self.group
        q, key, v, z = qkvz.view(T, Hk, 2 * Dk + 2 * r * Dv).split([Dk, Dk, r * Dv, r * Dv], dim=-1)
        b, a = ba.view(T, Hk, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(T, Hk * Dk), key.reshape(T, Hk * Dk), v.reshape(T, -1)], dim=-1)
        return mixed, z.reshape(T, -1), b.reshape(T, -1), a.reshape(T, -1)

    def _flat(self, qkvz: torch.Tensor, ba: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """q | k | v | z and b | a rows -> the same four tensors as `_grouped`."""
        mixed, z = qkvz.split([self.channels, self.value_heads * self.value_dim], dim=-1)
        b, a = ba.split([self.value_heads, self.value_heads], dim=-1)
        return mixed, z, b, a

    def _gated_norm(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm over each value head's Dv (weight as stored, no offset), times silu(z)."""
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.w[self.names["norm"]] * x * F.silu(z.to(x.dtype))
