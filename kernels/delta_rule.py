"""Torch references of the Gated DeltaNet token mixer's kernels, for one sequence.

The gated delta rule keeps, per value head, a state S (Dk, Dv). Row t decays it, corrects what
it predicts for key k_t towards v_t by a step beta_t, and reads it with q_t:

    S_t = exp(g_t) * S_{t-1} + k_t (beta_t * (v_t - k_t^T exp(g_t) S_{t-1}))^T
    o_t = S_t^T q_t

`recurrent_gated_delta_rule` runs that row by row (decode, verify) and, for a verify step, keeps
the state after every row (so a commit can keep the accepted row's); `chunked_gated_delta_rule`
computes the same in chunks of rows with matrix products (prefill): inside a chunk the delta
corrections are a unit lower-triangular system, solved once (the WY/UT form of DeltaNet).
Both start from a state and return the one after their last row, so a prefill split in chunks,
and decoding after it, continue exactly. They compute in float32 at least (float64 stays).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def causal_conv1d(
    x: torch.Tensor,  # (T, C): this step's conv inputs
    weight: torch.Tensor,  # (C, K): one depthwise filter per channel
    state: torch.Tensor,  # (K - 1, C): the conv inputs of the K - 1 rows before this step (zeros at the start)
    every_row: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(silu(depthwise causal conv) (T, C), the next state (K - 1, C), or with `every_row` the
    state after each row (T, K - 1, C)): each row sees itself and the K - 1 rows before it,
    across the step boundary through `state`."""
    K = weight.shape[1]
    full = torch.cat([state.to(x.dtype), x], dim=0)  # (K - 1 + T, C)
    windows = full.unfold(0, K, 1)  # (T, C, K): row t's window, oldest first
    out = (windows * weight).sum(-1)
    if every_row:  # after row t the state is rows t + 1 .. t + K - 1 of `full`
        return F.silu(out), full.unfold(0, K - 1, 1)[1:].transpose(1, 2)
    return F.silu(out), full[full.shape[0] - (K - 1):]


def recurrent_gated_delta_rule(
    q: torch.Tensor,  # (T, Hv, Dk), l2-normed and scaled
    k: torch.Tensor,  # (T, Hv, Dk), l2-normed
    v: torch.Tensor,  # (T, Hv, Dv)
    g: torch.Tensor,  # (T, Hv) log decay, <= 0, per head, or (T, Hv, Dk) per key channel (KDA)
    beta: torch.Tensor,  # (T, Hv) in (0, 1)
    state: torch.Tensor,  # (Hv, Dk, Dv)
    every_row: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(outputs (T, Hv, Dv) in v's dtype, state after the last row (Hv, Dk, Dv), or with
    `every_row` the state after each row (T, Hv, Dk, Dv)), row by row."""
    dtype, dt = v.dtype, _compute_dtype(v.dtype)
    q, k, v, g, beta = (t.to(dt) for t in (q, k, v, g, beta))
    S = state.to(dt)
    out = torch.empty_like(v)
    states = []
    for t in range(q.shape[0]):
        decay = g[t].exp()
        S = S * (decay[:, :, None] if g.dim() == 3 else decay[:, None, None])
        predicted = torch.einsum("hk,hkv->hv", k[t], S)
        delta = (v[t] - predicted) * beta[t][:, None]
        S = S + k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hk,hkv->hv", q[t], S)
        if every_row:
            states.append(S)
    return out.to(dtype), torch.stack(states) if every_row else S


def chunked_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As `recurrent_gated_delta_rule` (same arguments and results), `chunk` rows at a time. A decay
    per key channel (Kimi Delta Attention) takes `kernels/kda.py`'s form of the chunks."""
    if g.dim() == 3:
        from lucebox.kernels.kda import chunked_kda

        return chunked_kda(q, k, v, g, beta, state, chunk)
    dtype, dt = v.dtype, _compute_dtype(v.dtype)
    T = q.shape[0]
    # (Hv, T, D) head-major, so each head's chunk is one matrix
    q, k, v = (t.to(dt).transpose(0, 1) for t in (q, k, v))
    g, beta = (t.to(dt).transpose(0, 1) for t in (g, beta))
    S = state.to(dt)
    out = torch.empty_like(v)
    for start in range(0, T, chunk):
        end = min(start + chunk, T)
        qc, kc, vc, bc = q[:, start:end], k[:, start:end], v[:, start:end], beta[:, start:end]
        decay = g[:, start:end].cumsum(-1)  # (Hv, C): log decay from the chunk's start through row i
        C = end - start
        lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        # pair[i, j] = decay from row j to row i (j <= i), zero above the diagonal
        pair = (decay[:, :, None] - decay[:, None, :]).masked_fill(~lower, float("-inf")).exp()
        # Delta corrections u_i = beta_i (v_i - k_i^T S_{i-1}) within the chunk: S_{i-1} is the decayed
        # start state plus the earlier rows' corrections, which gives (I + A) u = beta (v - decayed k S0)
        # with A strictly lower triangular.
        A = (bc[:, :, None] * (kc @ kc.transpose(1, 2)) * pair).tril(-1)
        eye = torch.eye(C, dtype=dt, device=q.device).expand_as(A)
        rhs = bc[:, :, None] * (vc - (kc * decay.exp()[:, :, None]) @ S)
        u = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        # o_i = (decayed S0)^T q_i + sum_{j <= i} pair[i, j] (q_i . k_j) u_j
        out[:, start:end] = (qc * decay.exp()[:, :, None]) @ S + ((qc @ kc.transpose(1, 2)) * pair) @ u
        last = decay[:, -1:]  # (Hv, 1)
        S = S * last.exp()[:, :, None] + (kc * (last - decay).exp()[:, :, None]).transpose(1, 2) @ u
    return out.transpose(0, 1).to(dtype), S
