"""The Gated DeltaNet token mixer's kernels in Triton, with the signatures and results of their
torch references in `delta_rule.py`: the causal conv1d + silu, and the gated delta rule.

The delta rule runs one program per (value head, block of value columns): that head's state block
(Dk, BLOCK_V) stays in registers in float32 while the program walks the rows, so a step reads
and writes each state once. Every input is upcast to float32 as it is loaded. A prefill runs the
same row loop (`chunked_gated_delta_rule` is the recurrent kernel, not a chunked one): exact and
simple, but its rows are sequential, so a long prefill is slower than a chunked (WY) kernel would be.

fla-core (0.6.0) was tried first and not used: its chunked gated delta rule fails under
TRITON_INTERPRET=1 (its autotuner asks for a GPU driver: "0 active drivers"), and its fused
recurrent kernel, which does run there, returns only the final state, not the state after every
verify row that speculation commits from.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from lucebox.errors import InvalidArgumentError


@triton.jit
def _sequence_rows(x_ptr, state_ptr, rows, cols, col_mask, T, C, PAST: tl.constexpr):
    """Rows `rows` of cat(state, x) ((PAST + T, C): the PAST rows before the step, then the
    step's), in float32, the state's rounded to x's dtype as the reference's `state.to(x.dtype)`."""
    in_state = rows < PAST
    in_x = (rows >= PAST) & (rows < PAST + T)
    state_rows = tl.where(in_state, rows, 0).to(tl.int64)
    x_rows = tl.where(in_x, rows - PAST, 0).to(tl.int64)
    past = tl.load(state_ptr + state_rows[:, None] * C + cols[None, :], mask=in_state[:, None] & col_mask[None, :],
                   other=0.0)
    new = tl.load(x_ptr + x_rows[:, None] * C + cols[None, :], mask=in_x[:, None] & col_mask[None, :], other=0.0)
    return past.to(x_ptr.dtype.element_ty).to(tl.float32) + new.to(tl.float32)


@triton.jit
def _conv_kernel(x_ptr, w_ptr, state_ptr, out_ptr, after_ptr, T, C,
                 K: tl.constexpr, EVERY_ROW: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)  # this step's rows t
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_mask, col_mask = rows < T, cols < C
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(K):  # row t's window: rows t .. t + K - 1 of cat(state, x), oldest first
        w = tl.load(w_ptr + cols * K + j, mask=col_mask, other=0.0).to(tl.float32)
        acc += _sequence_rows(x_ptr, state_ptr, rows + j, cols, col_mask, T, C, K - 1) * w[None, :]
    out = acc * tl.sigmoid(acc)
    mask = row_mask[:, None] & col_mask[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * C + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)
    # The state after row t is rows t + 1 .. t + K - 1 of cat(state, x): every row's, or the last's.
    keep = row_mask if EVERY_ROW else rows == T - 1
    slot = rows.to(tl.int64) if EVERY_ROW else tl.zeros_like(rows).to(tl.int64)
    for i in tl.static_range(K - 1):
        past = _sequence_rows(x_ptr, state_ptr, rows + 1 + i, cols, col_mask, T, C, K - 1)
        tl.store(after_ptr + (slot[:, None] * (K - 1) + i) * C + cols[None, :],
                 past.to(after_ptr.dtype.element_ty), mask=keep[:, None] & col_mask[None, :])


def causal_conv1d(
    x: torch.Tensor,  # (T, C)
    weight: torch.Tensor,  # (C, K)
    state: torch.Tensor,  # (K - 1, C)
    every_row: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As `delta_rule.causal_conv1d`: (silu(conv) (T, C), the state after the last row (K - 1, C),
    or with `every_row` after each row (T, K - 1, C)), both in x's dtype."""
    (T, C), K = x.shape, weight.shape[-1]
    if weight.shape != (C, K) or state.shape != (K - 1, C) or K < 2:
        raise InvalidArgumentError(f"causal_conv1d takes x (T, C), weight (C, K >= 2) and state (K - 1, C); got "
                                   f"{tuple(x.shape)}, {tuple(weight.shape)} and {tuple(state.shape)}")
    x, weight, state = x.contiguous(), weight.contiguous(), state.contiguous()
    out = torch.empty_like(x)
    after = torch.empty((T, K - 1, C) if every_row else (K - 1, C), dtype=x.dtype, device=x.device)
    block_t, block_c = min(16, triton.next_power_of_2(T)), min(128, triton.next_power_of_2(C))
    grid = (triton.cdiv(C, block_c), triton.cdiv(T, block_t))
    _conv_kernel[grid](x, weight, state, out, after, T, C, K=K, EVERY_ROW=every_row, BLOCK_T=block_t,
                       BLOCK_C=block_c)
    return out, after


@triton.jit
def _delta_rule_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, after_ptr, T, H, Dk, Dv,
                       KEY_DECAY: tl.constexpr, EVERY_ROW: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    head = tl.program_id(0)
    ks = tl.arange(0, BLOCK_K)
    vs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_mask, v_mask = ks < Dk, vs < Dv
    tile_mask = k_mask[:, None] & v_mask[None, :]
    tile = (head * Dk + ks[:, None]).to(tl.int64) * Dv + vs[None, :]  # this program's block of one head's state
    S = tl.load(state_ptr + tile, mask=tile_mask, other=0.0).to(tl.float32)  # (BLOCK_K, BLOCK_V)
    for t in range(T):
        row = (t * H + head).to(tl.int64)  # (t, head) of the (T, H, ...) inputs
        q = tl.load(q_ptr + row * Dk + ks, mask=k_mask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + row * Dk + ks, mask=k_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + row * Dv + vs, mask=v_mask, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + row).to(tl.float32)
        if KEY_DECAY:  # one log decay per key channel (a row of S)
            S = S * tl.exp(tl.load(g_ptr + row * Dk + ks, mask=k_mask, other=0.0).to(tl.float32))[:, None]
        else:
            S = S * tl.exp(tl.load(g_ptr + row).to(tl.float32))
        delta = (v - tl.sum(S * k[:, None], axis=0)) * beta  # (BLOCK_V,): v_t minus what S predicts for k_t
        S += k[:, None] * delta[None, :]
        out = tl.sum(S * q[:, None], axis=0)
        tl.store(out_ptr + row * Dv + vs, out.to(out_ptr.dtype.element_ty), mask=v_mask)
        if EVERY_ROW:  # into (t, head) of (T, H, Dk, Dv)
            tl.store(after_ptr + (row - head) * Dk * Dv + tile, S, mask=tile_mask)
    if not EVERY_ROW:
        tl.store(after_ptr + tile, S, mask=tile_mask)


def recurrent_gated_delta_rule(
    q: torch.Tensor,  # (T, Hv, Dk)
    k: torch.Tensor,  # (T, Hv, Dk)
    v: torch.Tensor,  # (T, Hv, Dv)
    g: torch.Tensor,  # (T, Hv) log decay per head, or (T, Hv, Dk) per key channel
    beta: torch.Tensor,  # (T, Hv)
    state: torch.Tensor,  # (Hv, Dk, Dv)
    every_row: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As `delta_rule.recurrent_gated_delta_rule`: (outputs (T, Hv, Dv) in v's dtype, the float32
    state after the last row (Hv, Dk, Dv), or with `every_row` after each row (T, Hv, Dk, Dv))."""
    _check_delta_rule_shapes(q, k, v, g, beta, state)
    (T, H, Dk), Dv = q.shape, v.shape[-1]
    q, k, v, g, beta, state = (t.contiguous() for t in (q, k, v, g, beta, state))
    out = torch.empty_like(v)
    after = torch.empty((T, H, Dk, Dv) if every_row else (H, Dk, Dv), dtype=torch.float32, device=v.device)
    # The whole key dim in one block (the rule contracts over it); value columns split across programs.
    block_k, block_v = triton.next_power_of_2(Dk), min(16, triton.next_power_of_2(Dv))
    _delta_rule_kernel[(H, triton.cdiv(Dv, block_v))](q, k, v, g, beta, state, out, after, T, H, Dk, Dv,
                                                      KEY_DECAY=g.dim() == 3, EVERY_ROW=every_row,
                                                      BLOCK_K=block_k, BLOCK_V=block_v, num_warps=2)
    return out, after


def chunked_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As `delta_rule.chunked_gated_delta_rule`, by the recurrent kernel over every row: its result
    does not depend on `chunk` (nor does the reference's, beyond rounding), which is still checked."""
    if chunk < 1:
        raise InvalidArgumentError(f"chunk must be at least 1 row, got {chunk}")
    return recurrent_gated_delta_rule(q, k, v, g, beta, state)


def _check_delta_rule_shapes(q, k, v, g, beta, state) -> None:
    T, H, Dk = q.shape
    Dv = v.shape[-1]
    wanted = {"k": (k, (T, H, Dk)), "v": (v, (T, H, Dv)), "beta": (beta, (T, H)), "state": (state, (H, Dk, Dv))}
    for name, (tensor, shape) in wanted.items():
        if tuple(tensor.shape) != shape:
            raise InvalidArgumentError(f"gated delta rule: {name} has shape {tuple(tensor.shape)}, expected {shape} "
                                       f"for q {tuple(q.shape)} and v {tuple(v.shape)}")
    if tuple(g.shape) not in ((T, H), (T, H, Dk)):
        raise InvalidArgumentError(f"gated delta rule: g has shape {tuple(g.shape)}, expected {(T, H)} (per head) "
                                   f"or {(T, H, Dk)} (per key channel)")
