"""Mixture-of-experts routing and expert GEMMs, torch reference.

Routing runs in float32 whatever the model dtype (as the reference implementations do), so the
chosen experts are the same ones they choose: the router's GEMM too (`moe_route`), since a
bfloat16 GEMM rounds logits to 8 bits of mantissa, enough to swap two close experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lucebox.kernels.casts import as_dtype
from lucebox.kernels.quant import QuantizedTensor, Weight, kept_dense, linear

from lucebox.config import MoESpec
from lucebox.limits import DECODE_ROWS

# Steps of at most this many rows (a decode or verify step) route without reading the device: see
# `_routed_experts`. The engine's widest step (`DECODE_ROWS`) fits under it, which a test checks.
SMALL_STEP_ROWS = DECODE_ROWS
# On the CPU a step choosing at most this many (row, expert) pairs runs each pair through its
# expert in place, as a one-row step does; a wider one runs all its pairs as one batched one-row
# product against its experts' gathered weights (`_gathered_experts`), the same bits for ~10 ops a
# layer instead of ~10 a pair (the built-in model's layer, float32, 1 thread, CPU time on a busy
# host: 2 rows 98 us in place against 111 gathered, 4 rows 222 against 137, 8 rows 461 against
# 266, 16 rows 448 (then the expert loop, whose GEMMs round a row by its step) against 397).
IN_PLACE_PAIRS = 4


def routing_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype routers are kept in and their GEMM runs in: float32, or the model's own when it is
    wider (a float64 model's reference computes its router in float64)."""
    return torch.promote_types(dtype, torch.float32)


def moe_route(
    h: torch.Tensor,  # (T, H), model dtype
    router: torch.Tensor,  # (E, H), kept in `routing_dtype` at load
    spec: MoESpec,
    correction_bias: torch.Tensor | None = None,  # (E,)
) -> tuple[torch.Tensor, torch.Tensor]:
    """`route` of the router's logits computed in `routing_dtype` (h upcast): (weights (T, k) in
    the model dtype, or float32 with `spec.float32_weights`; expert ids (T, k))."""
    wide = routing_dtype(h.dtype)
    return route(F.linear(as_dtype(h, wide), as_dtype(router, wide)), spec, correction_bias, h.dtype)


def route(
    router_logits: torch.Tensor,  # (T, E)
    spec: MoESpec,
    correction_bias: torch.Tensor | None = None,  # (E,)
    dtype: torch.dtype | None = None,  # the model's (default: the logits')
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights (T, k) in `dtype`, or float32 with `spec.float32_weights`; expert ids (T, k), the
    k best in descending order)."""
    logits = as_dtype(router_logits, torch.float32)
    if spec.logit_softcap > 0:
        logits = torch.tanh(logits / spec.logit_softcap) * spec.logit_softcap
    if spec.router == "sigmoid":
        scores = torch.sigmoid(logits)
    else:
        scores = torch.softmax(logits, dim=-1)
    selection = scores if correction_bias is None else scores + as_dtype(correction_bias, torch.float32)
    _, ids = torch.topk(selection, spec.top_k, dim=-1)
    weights = scores.gather(-1, ids)  # the bias only chooses; it never weighs
    if spec.normalize_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if spec.float32_weights else as_dtype(weights, dtype or router_logits.dtype)), ids


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
    layout_of: tuple[int, int] | None = None,
) -> torch.Tensor:  # (T, H)
    """scaling * (sum over the k chosen experts of weight * expert(x)) + shared_expert(x).
    `layout_of` = (rows, experts) of the whole step when this call is one group of its rows (an
    expert cache's, `lucebox.memory.expert_cache`): the path is the whole step's, so each row's result
    is the one the whole step would give."""
    if x.device.type == "cpu" and layout_of is None:  # (an expert cache's slots change: never kept)
        gate_up, down = _kept_dense(gate_up), _kept_dense(down)  # quantized experts kept dequantized on the CPU
    out = _routed_experts(x, gate_up, down, weights, ids, layout_of or (ids.shape[0], gate_up.shape[0]))
    if scaling != 1.0:
        out = out * scaling
    if shared_gate_up is not None:
        out = out + swiglu(x, shared_gate_up, shared_down)
    return out


def _expert_loop(x: torch.Tensor, gate_up: Weight, down: Weight, weights: torch.Tensor,
                 ids: torch.Tensor) -> torch.Tensor:
    T, k = ids.shape
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=gate_up.shape[0]).tolist()
    tokens = order // k
    # Each (row, choice) pair's weighed output is kept apart and the k of a row are summed in
    # choice order, as the other paths and the Triton kernel do: the sum does not depend on
    # how experts are numbered (an expert cache renumbers them by slot).
    pairs = torch.empty(T * k, x.shape[1], dtype=torch.promote_types(x.dtype, weights.dtype), device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = order[start : start + count]
        tok = tokens[start : start + count]
        start += count
        y = swiglu(x[tok], gate_up[expert], down[expert])
        pairs[rows] = y * weights.reshape(-1)[rows, None]
    return pairs.view(T, k, -1).sum(1).to(x.dtype)


def reads_wait_for_nothing(device: torch.device) -> bool:
    """Whether the host reads a value on `device` without waiting for queued work (the CPU, where
    the host is the device): then a step may read its expert ids. A CUDA graph's body must not,
    so the CPU tests of the graphed step hold the CPU to the GPU's paths through this."""
    return device.type == "cpu"


def _routed_experts(x: torch.Tensor, gate_up: Weight, down: Weight, weights: torch.Tensor,
                    ids: torch.Tensor, layout_of: tuple[int, int]) -> torch.Tensor:
    """The weighted sum of the chosen experts' outputs, (T, H). Decode and verify steps (at most
    `SMALL_STEP_ROWS` rows) read no device value: on a GPU each read would wait for the queued work,
    and a few small batched ops cost less than a loop of ~10 ops per expert. A step that chooses
    at least one (row, expert) pair per expert touches most experts anyway and runs every expert
    densely; a sparser one gathers its chosen experts' weights. Prefill chunks loop over the
    experts they use: there each expert's GEMM has many rows. On the CPU a one-row step, or one of
    at most `IN_PLACE_PAIRS` pairs, runs each chosen expert where its weights lie; a wider decode or
    verify step gathers them, every row with its one-row bits either way."""
    rows, experts = layout_of
    small = rows <= SMALL_STEP_ROWS and isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
    if not small:
        return _expert_loop(x, gate_up, down, weights, ids)
    if reads_wait_for_nothing(x.device):  # no weights copied: each chosen expert where it lies
        # the whole step's pairs (a group takes the step's path); a one-row step's, however many
        few = rows == 1 or rows * ids.shape[1] <= IN_PLACE_PAIRS
        return (_chosen_experts_in_place if few else _pairs_by_expert)(x, gate_up, down, weights, ids)
    if rows * ids.shape[1] >= experts:
        return _all_experts(x, gate_up, down, weights, ids)
    return _gathered_experts(x, gate_up, down, weights, ids)


def _kept_dense(w: Weight) -> Weight:
    kept = kept_dense(w) if isinstance(w, QuantizedTensor) else None
    return w if kept is None else kept


def _all_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                 ids: torch.Tensor) -> torch.Tensor:
    """Every expert on every row, then each row's k chosen outputs weighed and summed in choice order."""
    gate, up = torch.matmul(x, gate_up.transpose(1, 2)).chunk(2, dim=-1)  # (E, T, I) each
    y = torch.matmul(F.silu(gate) * up, down.transpose(1, 2))  # (E, T, H)
    chosen = y[ids, torch.arange(x.shape[0], device=x.device)[:, None]]  # (T, k, H)
    return (chosen * weights[..., None]).sum(1).to(x.dtype)  # weighed in the wider dtype


def _gathered_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                      ids: torch.Tensor) -> torch.Tensor:
    """Each (row, choice) pair against a copy of its expert's weights, as batched one-row products
    (row times transposed weight, as `F.linear` of one row: on the CPU MKL's batched GEMM runs each
    as it runs that one row, so a pair has the in-place path's bits, `tests/test_cpu_rows.py`)."""
    T, k = ids.shape
    chosen = ids.reshape(-1)
    rows = x.repeat_interleave(k, dim=0)[:, None, :]  # (T*k, 1, H)
    gate, up = (rows @ gate_up.index_select(0, chosen).transpose(1, 2)).chunk(2, dim=-1)  # (T*k, 1, I) each
    y = (F.silu(gate) * up @ down.index_select(0, chosen).transpose(1, 2))[:, 0]  # (T*k, H)
    return (y * weights.reshape(-1, 1)).view(T, k, -1).sum(1).to(x.dtype)  # weighed in the wider dtype


def _pairs_by_expert(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                     ids: torch.Tensor) -> torch.Tensor:
    """`_gathered_experts` without the copies (the CPU's wider steps): the pairs of each chosen
    expert as batched one-row products against its weights broadcast over them (a view, so the
    weights are read where they lie), the very products `_gathered_experts` runs, so the same bits."""
    T, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    rows = x.repeat_interleave(k, dim=0)[order][:, None, :]  # (T*k, 1, H), grouped by expert
    outputs, start = [], 0
    for expert, count in enumerate(counts):
        if count:
            mine = rows[start : start + count]
            gate, up = torch.bmm(mine, gate_up[expert].t().expand(count, -1, -1)).chunk(2, dim=-1)
            outputs.append(torch.bmm(F.silu(gate) * up, down[expert].t().expand(count, -1, -1)))
            start += count
    pairs = torch.empty_like(rows[:, 0, :], dtype=outputs[0].dtype)
    pairs[order] = torch.cat(outputs)[:, 0]
    return (pairs * weights.reshape(-1, 1)).view(T, k, -1).sum(1).to(x.dtype)  # weighed in the wider dtype


def _chosen_experts_in_place(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                             ids: torch.Tensor) -> torch.Tensor:
    """Each (row, choice) pair through its expert's own weights (views, no copy), weighed in the
    wider dtype and summed in choice order: per row, the very ops the expert loop runs."""
    T, k = ids.shape
    if T == 1:  # a decode step: the same ops on the row itself (fewer views: each a dispatch)
        row = weights[0]
        pairs = [swiglu(x, gate_up[e], down[e]) * row[j : j + 1] for j, e in enumerate(ids.tolist()[0])]
        if k == 2:  # the stacked sum's value in one add, not two ops (it starts from +0: only an
            # exact zero's sign can differ, -0 + -0 against +0)
            return as_dtype(pairs[0] + pairs[1], x.dtype)
    else:
        pairs = [swiglu(x[t : t + 1], gate_up[e], down[e]) * weights[t, j : j + 1]  # (1, H) each
                 for t, chosen in enumerate(ids.tolist()) for j, e in enumerate(chosen)]
    return as_dtype(torch.cat(pairs).view(T, k, -1).sum(1), x.dtype)
