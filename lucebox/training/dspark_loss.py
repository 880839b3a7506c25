"""The confidence head's part of `distill`'s loss with DSpark heads."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lucebox.models.dspark import DSparkHeads


def keep_rate(p: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """sum_v min(p_v, q_v) over the last dimension: the probability that speculative sampling keeps a
    draft drawn from q when the target's distribution is p (1 - their total variation distance)."""
    return torch.minimum(p, logq.exp()).sum(-1)


def confidence_loss(heads: DSparkHeads, hidden: torch.Tensor, prev: torch.Tensor, p: torch.Tensor,
                    logq: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Position-weighted binary cross-entropy of the confidence head (hidden (B, M, J, H), previous
    tokens (B, M, J)) against each row's keep rate (p, logq: (B, M, J, V), the drafter's
    Markov-biased log-distribution), weights (J,) as the soft-label loss has them. The keep rate is
    detached: it is the head's target, so no gradient moves q toward what the head predicts."""
    with torch.no_grad():
        target = keep_rate(p, logq).clamp(0.0, 1.0)
    logit = heads.confidence_logit(hidden, prev)  # (B, M, J)
    bce = F.binary_cross_entropy_with_logits(logit, target, reduction="none")
    return (bce * weights).sum(-1).mean() / weights.sum()
