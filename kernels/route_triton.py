"""MoE routing in Triton for decode and verify steps (at most `SMALL_STEP_ROWS` rows), in two
launches where the torch reference (`lucebox.kernels.moe.moe_route`) makes about ten.

1. `_router_logits_kernel`: the router GEMV in float32, (T, H) x (E, H) -> (T, E). Each program
   owns a few experts for every row, so the (E, H) router is read once and spread over ~128
   programs: one program per row would read it alone, far below the card's bandwidth.
2. `_select_kernel`: one program per row: softcap, sigmoid or softmax, the correction bias (it
   chooses, never weighs), top-k, normalization, the weights' dtype.

Top-k takes the largest selection score k times, so ids come out in descending order of score as
the reference's do. Of exactly equal scores it takes the lowest expert id first; torch.topk leaves
that order unspecified (on the CPU it can take a higher id), so only exact ties, such as sigmoid
scores saturated at 1.0 by logits above ~17, may choose differently from the reference. Prefill
chunks and float64 models use the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from lucebox.kernels import moe

from lucebox.config import MoESpec

# Elements of one program's product tile per step of the GEMV: (rows, experts, hidden slice).
_TILE = 4096
# Programs the GEMV aims for: about one per streaming multiprocessor of a large card.
_PROGRAMS = 128


@triton.jit
def _router_logits_kernel(h_ptr, w_ptr, out_ptr, M, E, H, stride_h, stride_w,
                          BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.arange(0, BLOCK_M)
    experts = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    acc = tl.zeros((BLOCK_M, BLOCK_E), dtype=tl.float32)
    for start in range(0, H, BLOCK_H):
        cols = start + tl.arange(0, BLOCK_H)
        x = tl.load(h_ptr + rows[:, None] * stride_h + cols[None, :],
                    mask=(rows[:, None] < M) & (cols[None, :] < H), other=0.0).to(tl.float32)  # (M, BH)
        w = tl.load(w_ptr + experts[:, None].to(tl.int64) * stride_w + cols[None, :],
                    mask=(experts[:, None] < E) & (cols[None, :] < H), other=0.0).to(tl.float32)  # (BE, BH)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    tl.store(out_ptr + rows[:, None] * E + experts[None, :], acc, mask=(rows[:, None] < M) & (experts[None, :] < E))


@triton.jit
def _select_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, E, softcap,
                   K: tl.constexpr, SOFTCAP: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr,
                   NORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < E
    logits = tl.load(logits_ptr + row * E + experts, mask=valid, other=0.0)
    if SOFTCAP:
        # cap * tanh(logits / cap), tanh from one exp of a non-positive argument (no overflow)
        t = tl.exp(-2.0 * tl.abs(logits / softcap))
        logits = tl.where(logits < 0, -1.0, 1.0) * (1.0 - t) / (1.0 + t) * softcap
    if SIGMOID:
        scores = 1.0 / (1.0 + tl.exp(-logits))
    else:
        shifted = tl.exp(tl.where(valid, logits, -float("inf")) - tl.max(tl.where(valid, logits, -float("inf")), 0))
        scores = shifted / tl.sum(shifted, 0)
    selection = scores
    if HAS_BIAS:
        selection += tl.load(bias_ptr + experts, mask=valid, other=0.0).to(tl.float32)
    selection = tl.where(valid, selection, -float("inf"))
    slots = tl.arange(0, BLOCK_K)
    chosen_ids = tl.zeros((BLOCK_K,), dtype=tl.int64)
    chosen_weights = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for j in tl.static_range(K):
        best = tl.max(selection, 0)
        pick = tl.min(tl.where(selection == best, experts, BLOCK_E), 0)  # the lowest id among equals
        weight = tl.sum(tl.where(experts == pick, scores, 0.0), 0)
        # A NaN row equals nothing: a real expert id (the MoE kernels index weights with it) and a NaN
        # weight, so the row stays non-finite and ends as the engine's typed error.
        found = pick < E
        pick = tl.where(found, pick, 0)
        weight = tl.where(found, weight, float("nan"))
        chosen_ids = tl.where(slots == j, pick.to(tl.int64), chosen_ids)
        chosen_weights = tl.where(slots == j, weight, chosen_weights)
        selection = tl.where(experts == pick, -float("inf"), selection)
    if NORMALIZE:
        chosen_weights = chosen_weights / tl.sum(chosen_weights, 0)
    tl.store(ids_ptr + row * K + slots, chosen_ids, mask=slots < K)
    tl.store(weights_ptr + row * K + slots, chosen_weights.to(weights_ptr.dtype.element_ty), mask=slots < K)


def moe_route(
    h: torch.Tensor,  # (T, H), model dtype
    router: torch.Tensor,  # (E, H), float32 as loaded (any float dtype is read as float32)
    spec: MoESpec,
    correction_bias: torch.Tensor | None = None,  # (E,)
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's (weights (T, k), ids (T, k)), in two launches for at most `SMALL_STEP_ROWS` rows."""
    T, H = h.shape
    if T > moe.SMALL_STEP_ROWS or T == 0 or h.dtype == torch.float64:
        return moe.moe_route(h, router, spec, correction_bias)
    h, router = h.contiguous(), router.contiguous()
    E, k = router.shape[0], spec.top_k
    logits = torch.empty(T, E, dtype=torch.float32, device=h.device)
    block_m = triton.next_power_of_2(T)
    block_e = min(16, triton.next_power_of_2(triton.cdiv(E, _PROGRAMS)))
    block_h = max(16, min(triton.next_power_of_2(H), _TILE // (block_m * block_e)))
    _router_logits_kernel[(triton.cdiv(E, block_e),)](h, router, logits, T, E, H, h.stride(0), router.stride(0),
                                                      BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_H=block_h)
    weights = torch.empty(T, k, dtype=torch.float32 if spec.float32_weights else h.dtype, device=h.device)
    ids = torch.empty(T, k, dtype=torch.int64, device=h.device)
    bias = correction_bias if correction_bias is not None else logits  # never read without HAS_BIAS
    _select_kernel[(T,)](logits, bias, weights, ids, E, float(spec.logit_softcap), K=k,
                         SOFTCAP=spec.logit_softcap > 0, SIGMOID=spec.router == "sigmoid",
                         HAS_BIAS=correction_bias is not None, NORMALIZE=spec.normalize_topk,
                         BLOCK_E=triton.next_power_of_2(E), BLOCK_K=triton.next_power_of_2(k))
    return weights, ids
