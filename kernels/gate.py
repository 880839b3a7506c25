"""Softplus output gate of an attention block (Laguna), torch reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lucebox.kernels.casts import as_dtype


def softplus_gate(out: torch.Tensor, gate_logits: torch.Tensor) -> torch.Tensor:
    """out (T, Hq, D) * softplus(gate_logits): one gate per head (T, Hq) or per element (T, Hq*D).
    softplus runs in float32, as the reference does."""
    T, Hq, D = out.shape
    gate = as_dtype(F.softplus(as_dtype(gate_logits, torch.float32)), out.dtype)
    return out * (gate[:, :, None] if gate.shape[1] == Hq else gate.view(T, Hq, D))
