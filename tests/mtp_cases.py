"""What the MTP head tests share: the target's final hidden states over a prompt, and the head's
outputs over rows of (next token, state), each computed alone on a fresh cache."""

from __future__ import annotations

import torch
from lucebox.models.mtp import MTPHead

from lucebox.caches import SequenceCache, Step
from lucebox.speculative.draft_model import draft_cache_settings


def target_hidden(llm, ids: list[int]) -> torch.Tensor:
    """The target's final hidden states (after its final norm) of a plain forward over ids."""
    decoder = llm.engine.decoder
    cache = llm.engine.new_cache()
    return decoder.forward(torch.tensor(ids), Step.span(0, len(ids), torch.device("cpu"), prefill=True), cache)


def head_over(head: MTPHead, tokens: list[int], hidden: torch.Tensor) -> torch.Tensor:
    """The head's outputs over rows 0.. of (tokens[t], hidden[t]), in one forward on a fresh cache."""
    cache = SequenceCache(head.cfg, draft_cache_settings(256, 64, 256, 8), torch.float64, torch.device("cpu"))
    return head.forward(torch.tensor(tokens), hidden, Step.span(0, len(tokens), torch.device("cpu"), prefill=True),
                        cache)
