"""Mixture-of-experts routing and expert GEMMs, torch reference.

Routing runs in float32 whatever the model dtype (as the reference implementations do), so the
chosen experts are the same ones they choose.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lucebox.kernels.quant import Weight, linear

from lucebox.config import MoESpec


def route(
    router_logits: torch.Tensor,  # (T, E), model dtype
    spec: MoESpec,
    correction_bias: torch.Tensor | None = None,  # (E,)
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (T, k) in the model dtype, or float32 with `spec.float32_weights`; expert ids (T, k))."""
    logits = router_logits.to(torch.float32)
    if spec.logit_softcap > 0:
        logits = torch.tanh(logits / spec.logit_softcap) * spec.logit_softcap
    if spec.router == "sigmoid":
        scores = torch.sigmoid(logits)
    else:
        scores = torch.softmax(logits, dim=-1)
    selection = scores if correction_bias is None else scores + correction_bias.to(torch.float32)
    _, ids = torch.topk(selection, spec.top_k, dim=-1)
    weights = scores.gather(-1, ids)  # the bias only chooses; it never weighs
    if spec.normalize_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if spec.float32_weights else weights.to(router_logits.dtype)), ids


def swiglu(x: torch.Tensor, w_gate_up: Weight, w_down: Weight, linear=linear) -> torch.Tensor:
    """down(silu(gate x) * up x) with gate and up fused in one (2I, H) matrix, gate rows first;
    `linear` is the backend's (plain or quantized) matmul."""
    gate, up = linear(x, w_gate_up).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, w_down)


def moe_experts(
    x: torch.Tensor,  # (T, H)
    gate_up: Weight,  # (E, 2I, H)
    down: Weight,  # (E, H, I)
    weights: torch.Tensor,  # (T, k)
    ids: torch.Tensor,  # (T, k)
    scaling: float = 1.0,
    shared_gate_up: Weight | None = None,  # (2Is, H)
    shared_down: Weight | None = None,  # (H, Is)
) -> torch.Tensor:  # (T, H)
    """scaling * (sum over the k chosen experts of weight * expert(x)) + shared_expert(x)."""
    out = _routed(x, gate_up, down, weights, ids)
    if scaling != 1.0:
        out = out * scaling
    if shared_gate_up is not None:
        out = out + swiglu(x, shared_gate_up, shared_down)
    return out


def _routed(x: torch.Tensor, gate_up: Weight, down: Weight, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=gate_up.shape[0]).tolist()
    tokens = order // ids.shape[1]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = order[start : start + count]
        tok = tokens[start : start + count]
        start += count
        y = swiglu(x[tok], gate_up[expert], down[expert])
        out.index_add_(0, tok, (y * weights.reshape(-1)[rows, None]).to(out.dtype))
    return out
