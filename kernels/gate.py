"""Softplus output gate of an attention block (Laguna), torch reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def softplus_gate(out: torch.Tensor, gate_logits: torch.Tensor) -> torch.Tensor:
    """out (T, Hq, D) * softplus(gate_logits): one gate per head (T, Hq) or per element (T, Hq*D).
    softplus runs in float32, as the reference does."""
    T, Hq, D = out.shape
    wide = gate_logits if gate_logits.dtype == torch.float32 else gate_logits.float()  # (no-op casts: dispatches)
    gate = F.softplus(wide)
    gate = gate if gate.dtype == out.dtype else gate.to(out.dtype)
    return out * (gate[:, :, None] if gate.shape[1] == Hq else gate.view(T, Hq, D))
