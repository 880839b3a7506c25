"""Rounds of random widths, for tests that speculation is lossless whatever widths it verifies."""

import torch


def vary_widths(llm, seed=0):
    """Cut every proposal to a pseudo-random length, so rounds verify 0..k drafts."""
    rng = torch.Generator().manual_seed(seed)
    propose = llm.proposer.propose

    def cut(context, k, params, generator):
        draft = propose(context, k, params, generator)
        n = int(torch.randint(0, len(draft.tokens) + 1, (1,), generator=rng))
        return type(draft)(draft.tokens[:n], None if draft.q is None else draft.q[:n], draft.confidence[:n])

    llm.proposer.propose = cut
