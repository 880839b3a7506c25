"""Deciding which drafts to keep, from one target forward over [last, d1..dk].

Vocabulary (used across lucebox.speculative):
- a *round* drafts k tokens d1..dk after `last`, the newest token not yet forwarded;
- p_i: the target's processed distribution for the token after `last, d1..d_i` (i = 0..k);
- q_i: the distribution d_{i+1} was drawn from (one-hot for deterministic drafts);
- the *accepted* drafts are a prefix d1..dn; then one more token comes from the target: the
  *correction* (drawn from a residual distribution, when a draft was rejected) or the *bonus*
  (drawn from p_k, when all k were accepted). A round therefore commits n + 1 tokens.

Each sampling rule is written as its exact outcome distribution (`Outcomes`: how likely each
n is, and what the next token is drawn from after it), then sampled. That makes the guarantee
checkable: `tests/test_verify.py` enumerates every outcome and compares the committed sequences'
probabilities with the target's own, to 1e-9.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lucebox.sampling import draw


@dataclass(frozen=True)
class Verdict:
    accepted: int  # drafts kept: d1..d_accepted
    next_token: int  # the correction or the bonus


@dataclass
class Outcomes:
    accept: torch.Tensor  # (k+1,) float64: probability that exactly n drafts are kept
    next_dists: list[torch.Tensor]  # next_dists[n]: what the next token is drawn from after n


def _residual(p: torch.Tensor, q: torch.Tensor, weight: float = 1.0) -> torch.Tensor:
    """normalize(max(weight * p - q, 0)), or p when that is all zero (a rejection then had
    probability zero, and only rounding can bring us here)."""
    r = (weight * p - q).clamp_min(0)
    total = r.sum()
    return r / total if total > 0 else p


def verify_greedy(target_choice: list[int], drafts: list[int]) -> Verdict:
    """Keep drafts while each equals the target's choice after its prefix."""
    n = 0
    while n < len(drafts) and drafts[n] == target_choice[n]:
        n += 1
    return Verdict(n, target_choice[n])


def tokenwise_outcomes(p: torch.Tensor, q: torch.Tensor, drafts: list[int]) -> Outcomes:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): d_i survives with
    probability min(1, p(d_i)/q(d_i)); the first rejection draws from normalize(max(p - q, 0)).
    p (k+1, V) and q (k, V) in float64."""
    k = len(drafts)
    keep = [min(1.0, float(p[i, d] / q[i, d])) if q[i, d] > 0 else 1.0 for i, d in enumerate(drafts)]
    accept, reach = [], 1.0
    for i in range(k):
        accept.append(reach * (1.0 - keep[i]))
        reach *= keep[i]
    accept.append(reach)
    dists = [_residual(p[i], q[i]) for i in range(k)] + [p[k]]
    return Outcomes(torch.tensor(accept, dtype=torch.float64, device=p.device), dists)


def block_outcomes(p: torch.Tensor, q: torch.Tensor, drafts: list[int]) -> Outcomes:
    """Block verification (Sun et al., "Block Verification Accelerates Speculative Decoding",
    2024): decides on the whole block at once, never keeping fewer drafts on average than
    speculative sampling, with the same output distribution.

    w_i = min(1, w_{i-1} p_{i-1}(d_i) / q_{i-1}(d_i)) (w_0 = 1) is how much of the prefix d1..d_i
    the target still owes. Stopping after d_i passes with probability h_i: the mass of the
    residual max(w_i p_i - q_i, 0) against that mass plus 1 - w_i (h_k = w_k). The longest prefix
    whose test passes is kept (tests are independent), and the next token is drawn from its
    residual (from p_k after all k).
    """
    k = len(drafts)
    w = [1.0]
    for i, d in enumerate(drafts):
        w.append(min(1.0, w[-1] * float(p[i, d] / q[i, d])) if q[i, d] > 0 else w[-1])
    h = [1.0]  # h_0: keeping nothing is always allowed
    for i in range(1, k + 1):
        if i == k:
            h.append(w[k])
            continue
        mass = float((w[i] * p[i] - q[i]).clamp_min(0).sum())
        h.append(mass / (mass + 1.0 - w[i]) if mass + 1.0 - w[i] > 0 else 1.0)
    accept, none_later = [0.0] * (k + 1), 1.0
    for i in range(k, -1, -1):  # P(n = i) = h_i * prod_{j > i} (1 - h_j)
        accept[i] = h[i] * none_later
        none_later *= 1.0 - h[i]
    dists = [_residual(p[i], q[i], w[i]) for i in range(k)] + [p[k]]
    return Outcomes(torch.tensor(accept, dtype=torch.float64, device=p.device), dists)


def sample(outcomes: Outcomes, generator: torch.Generator | None) -> Verdict:
    """Draw how many drafts are kept, then the next token; the token is -1 (no token has that id)
    when its distribution is not finite, decided on the device and read with the token itself."""
    n = int(draw(outcomes.accept.to(torch.float32), generator))
    dist = outcomes.next_dists[n]
    token = torch.where(torch.isfinite(dist).all(), draw(dist, generator), -1)
    return Verdict(n, int(token))
