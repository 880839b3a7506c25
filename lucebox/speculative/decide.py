"""From the logits of one verifying forward to a Verdict, for any sampling settings.

Sampled rounds verify by one of three rules (`engine.config.VERIFY_RULES`), all of which keep the
target's distribution: "coupled" (the default) picks each row's token by the race against noise
keyed by the request's seed and the token's position (`sampling.RaceNoise`) and keeps drafts while
they equal those picks, as greedy verification does; "tokenwise" and "block" decide by drawn
outcomes from a generator (`speculative.verify`)."""

from __future__ import annotations

import torch

from lucebox.errors import NonFiniteLogitsError
from lucebox.sampling import RaceNoise, SamplingParams, distribution, greedy_choices, penalize
from lucebox.speculative.histories import chain_paths, row_histories
from lucebox.speculative.proposer import Draft
from lucebox.speculative.verify import Verdict, block_outcomes, sample, tokenwise_outcomes, verify_greedy


def decide(
    logits: torch.Tensor,  # (k+1, V): target logits after last, d1, ..., dk
    draft: Draft,
    params: SamplingParams,
    seen: torch.Tensor,  # (V,) bool: tokens so far, `last` included
    rule: str,
    generator: torch.Generator | RaceNoise | None,  # RaceNoise for the "coupled" rule
    choices: torch.Tensor | None = None,  # greedy_choices(logits), when the step computed them already
    position: int = 0,  # index in the sequence of the token row 0 chooses (the "coupled" rule's key)
    counts: torch.Tensor | None = None,  # (V,) float32: generated tokens' counts (presence/frequency penalties)
) -> Verdict:
    verdict = _decide(logits, draft, params, seen, counts, rule, generator, choices, position)
    check_finite(verdict.next_token)
    return verdict


def check_finite(next_token: int) -> None:
    """A verdict's next token is -1 when the logits were not finite: say what to check."""
    if next_token < 0:
        raise NonFiniteLogitsError(
            "the model's logits hold NaN or inf values, so no token can be chosen: a weight is corrupt (NaN/inf), "
            "or config.json has values the weights were not trained with (rope_theta, rms_norm_eps, scaling "
            "factors), or the dtype overflows (try dtype='float32'); check the checkpoint")


def _decide(logits, draft, params, seen, counts, rule, generator, choices, position) -> Verdict:
    drafts = draft.tokens
    # Row i's history includes the drafts before it, as plain decoding's would.
    if params.reads_history:
        seen, counts = row_histories(seen, counts, chain_paths(drafts), params)
    if params.greedy:
        if choices is None:
            choices = greedy_choices(penalize(logits.float(), params, seen, counts))
        return verify_greedy(choices.tolist(), drafts)
    # Logits that are not finite in any row make every probability nan: the verdict's token is -1 (`check_finite`).
    finite = torch.isfinite(logits).all()
    p = distribution(logits, params, seen, counts).double()
    p = torch.where(finite, p, torch.nan)
    if rule == "coupled":
        positions = torch.arange(position, position + len(drafts) + 1, device=p.device)
        return verify_greedy(generator.choose(p, positions).tolist(), drafts)
    if draft.q is not None:
        q = draft.q
    else:  # deterministic drafts: q is one-hot at the draft
        q = torch.zeros((len(drafts), p.shape[1]), dtype=torch.float64, device=p.device)
        if drafts:
            q[torch.arange(len(drafts)), torch.tensor(drafts, device=p.device)] = 1.0
    outcomes = (block_outcomes if rule == "block" else tokenwise_outcomes)(p, q, drafts)
    return sample(outcomes, generator)
