"""From the logits of one verifying forward to a Verdict, for any sampling settings."""

from __future__ import annotations

import torch

from lucebox.sampling import SamplingParams, distribution, penalize_repetition
from lucebox.speculative.proposer import Draft
from lucebox.speculative.verify import Verdict, block_outcomes, sample, tokenwise_outcomes, verify_greedy

VERIFY_RULES = ("tokenwise", "block")


def _seen_per_row(seen: torch.Tensor, drafts: list[int]) -> list[torch.Tensor]:
    """Row i's token history includes the drafts before it (repetition penalty counts them)."""
    rows = [seen]
    for d in drafts:
        nxt = rows[-1].clone()
        nxt[d] = True
        rows.append(nxt)
    return rows


def decide(
    logits: torch.Tensor,  # (k+1, V): target logits after last, d1, ..., dk
    draft: Draft,
    params: SamplingParams,
    seen: torch.Tensor,  # (V,) bool: tokens so far, `last` included
    rule: str,
    generator: torch.Generator | None,
) -> Verdict:
    drafts = draft.tokens
    histories = _seen_per_row(seen, drafts)
    if params.greedy:
        choices = [int(penalize_repetition(logits[i].float(), histories[i], params.repetition_penalty).argmax())
                   for i in range(len(drafts) + 1)]
        return verify_greedy(choices, drafts)
    p = torch.stack([distribution(logits[i], params, histories[i]) for i in range(len(drafts) + 1)]).double()
    if draft.q is not None:
        q = draft.q
    else:  # deterministic drafts: q is one-hot at the draft
        q = torch.zeros((len(drafts), p.shape[1]), dtype=torch.float64, device=p.device)
        if drafts:
            q[torch.arange(len(drafts)), torch.tensor(drafts, device=p.device)] = 1.0
    outcomes = (block_outcomes if rule == "block" else tokenwise_outcomes)(p, q, drafts)
    return sample(outcomes, generator)
