"""RMSNorm, torch reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim. Statistics in float32 (like the reference implementations),
    the weight applied in the input dtype."""
    dtype = x.dtype
    wide = dtype == torch.float32  # no casts to dispatch (each a few microseconds on the CPU)
    if wide and x.device.type == "cpu":
        # torch's own op runs these very float32 ops (bit-equal, `tests/test_cpu_decode_ops.py`) in
        # one dispatch instead of six: a small model's decode step runs ~30 norms.
        return F.rms_norm(x, weight.shape, weight, eps)
    x32 = x if wide else x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (x32 if wide else x32.to(dtype))


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """(x + delta, rms_norm(x + delta)): the residual add and the next layer's norm."""
    total = x + delta
    return total, rms_norm(total, weight, eps)
