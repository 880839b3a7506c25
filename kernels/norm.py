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
        return normed_on_cpu(x, weight, eps)
    x32 = x if wide else x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (x32 if wide else x32.to(dtype))


# (features, eps) -> the two scalars of a float32 RMSNorm on the CPU, as float32 tensors
_cpu_scalars: dict[tuple[int, float], tuple[torch.Tensor, torch.Tensor]] = {}


def normed_on_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x * x) + eps) * weight for float32 x on the CPU (weight broadcast: (D,), or
    one row per head). The reference's ops bit for bit (a mean is a sum divided by the count, the
    scalars converted to float32 first, as torch's own op does; `tests/test_cpu_decode_ops.py`) in
    7 dispatches, where torch's op takes ~14 (it wraps and converts each Python scalar): a small
    model's decode step runs ~25 norms, each ~1.5 us cheaper so."""
    n = x.shape[-1]
    if x.requires_grad and torch.is_grad_enabled():  # training: torch's differentiable op
        return F.rms_norm(x, (n,), None, eps) * weight
    scalars = _cpu_scalars.get((n, eps))
    if scalars is None:
        with torch.inference_mode(False):  # usable in and out of inference mode
            scalars = (torch.tensor(n, dtype=torch.float32), torch.tensor(eps, dtype=torch.float32))
        _cpu_scalars[(n, eps)] = scalars
    squares = torch.sum(x * x, -1, keepdim=True)
    return x * squares.div_(scalars[0]).add_(scalars[1]).rsqrt_() * weight


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """(x + delta, rms_norm(x + delta)): the residual add and the next layer's norm."""
    total = x + delta
    return total, rms_norm(total, weight, eps)
