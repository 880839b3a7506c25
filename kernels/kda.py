"""Torch references of Kimi Delta Attention's rule (KDA, Kimi Linear's linear-attention layers), for
one sequence.

KDA is the gated delta rule (`kernels/delta_rule.py`) with a decay per key channel instead of one
per head: per head a state S (Dk, Dv); row t decays each key row of S by its own factor, corrects
what S predicts for key k_t towards v_t by a step beta_t, and reads S with q_t:

    S_t = diag(exp(g_t)) S_{t-1} + k_t (beta_t * (v_t - k_t^T diag(exp(g_t)) S_{t-1}))^T
    o_t = S_t^T q_t                                  g_t (Dk,) log decays, <= 0

Row by row (decode, verify) it is `kernels/delta_rule.py`'s `recurrent_gated_delta_rule`, which
takes a decay per key channel (and has a Triton kernel); `chunked_kda` computes the same a chunk
of rows at a time with matrix products (prefill). With G_i the cumulative log decay from a chunk's start through
row i, the state after row i is diag(exp(G_i)) S_0 + sum_{j <= i} diag(exp(G_i - G_j)) k_j u_j^T,
where u_j = beta_j (v_j - k_j^T diag(exp(g_j)) S_{j-1}) are the delta corrections: inside a chunk
they solve one unit lower-triangular system. Both start from a state and return the one after
their last row, so a prefill split in chunks, and decoding after it, continue exactly. They compute
in float32 at least (float64 stays).
"""

from __future__ import annotations

import torch


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def chunked_kda(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """As `recurrent_gated_delta_rule` with g (T, H, Dk) (same arguments and results), `chunk` rows at a time."""
    dtype, dt = v.dtype, _compute_dtype(v.dtype)
    # (H, T, D) head-major, so each head's chunk is one matrix
    q, k, v, g = (t.to(dt).transpose(0, 1) for t in (q, k, v, g))
    beta = beta.to(dt).transpose(0, 1)
    S = state.to(dt)
    out = torch.empty_like(v)
    for start in range(0, q.shape[1], chunk):
        end = min(start + chunk, q.shape[1])
        qc, kc, vc, bc = q[:, start:end], k[:, start:end], v[:, start:end], beta[:, start:end]
        G = g[:, start:end].cumsum(1)  # (H, C, Dk): log decay of each channel from the chunk's start through row i
        C = end - start
        lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        # pair[i, j, d] = decay of channel d from row j to row i (j <= i; exponent <= 0, so never overflows)
        pair = (G[:, :, None] - G[:, None, :]).masked_fill(~lower[:, :, None], float("-inf")).exp()
        # (I + A) u = beta (v - (k * exp(G)) S0), A[i, j] = beta_i sum_d k_i[d] k_j[d] pair[i, j, d], j < i
        A = (bc[:, :, None] * torch.einsum("hid,hjd,hijd->hij", kc, kc, pair)).tril(-1)
        eye = torch.eye(C, dtype=dt, device=q.device).expand_as(A)
        rhs = bc[:, :, None] * (vc - (kc * G.exp()) @ S)
        u = torch.linalg.solve_triangular(eye + A, rhs, upper=False, unitriangular=True)
        # o_i = (q_i * exp(G_i))^T S0 + sum_{j <= i} (sum_d q_i[d] k_j[d] pair[i, j, d]) u_j
        scores = torch.einsum("hid,hjd,hijd->hij", qc, kc, pair)
        out[:, start:end] = (qc * G.exp()) @ S + scores @ u
        last = G[:, -1:]  # (H, 1, Dk)
        S = S * last.transpose(1, 2).exp() + (kc * (last - G).exp()).transpose(1, 2) @ u
    return out.transpose(0, 1).to(dtype), S
