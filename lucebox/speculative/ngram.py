"""Prompt lookup: find the latest earlier occurrence of the last n tokens (n = 4 down to 1) and
propose what followed it. No weights; drafts are deterministic.

An index from every n-gram of the committed tokens to where it last ended is kept up to date
as tokens commit, so a proposal costs the same at any context length."""

from __future__ import annotations

import torch

from lucebox.limits import DRAFT_WIDTH
from lucebox.sampling import SamplingParams
from lucebox.speculative.proposer import Draft, Noise, Proposer


class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, max_n: int = 4, min_n: int = 1, max_width: int = DRAFT_WIDTH):
        self.max_n, self.min_n, self.max_width = max_n, min_n, max_width
        self.tokens: list[int] = []
        self.last_end: dict[tuple[int, ...], int] = {}

    def fork(self) -> NgramProposer:
        return NgramProposer(self.max_n, self.min_n, self.max_width)

    def start(self, prompt: list[int], features: torch.Tensor | None) -> None:
        self.tokens, self.last_end = [], {}
        self._extend(prompt)

    def resume(self, position: int) -> bool:
        if position > len(self.tokens):
            return False
        self.start(self.tokens[:position], None)  # the index rebuilt: a rewind may drop any n-gram's last end
        return True

    def commit(self, committed: list[int], new: int, features: torch.Tensor | None) -> None:
        self._extend(committed[len(self.tokens):])

    def _extend(self, tokens: list[int]) -> None:
        for t in tokens:
            self.tokens.append(t)
            end = len(self.tokens)
            for n in range(self.min_n, min(self.max_n, end) + 1):
                self.last_end[tuple(self.tokens[end - n : end])] = end

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: Noise) -> Draft:
        # context = committed + [last]: the tail ends with `last`, so every indexed match is earlier.
        for n in range(min(self.max_n, len(context)), self.min_n - 1, -1):
            end = self.last_end.get(tuple(context[-n:]))
            if end is not None and end < len(context):
                # Copy what followed the match; a match close to the end overlaps the copy itself
                # (as in LZ77), which continues a repeating pattern instead of stopping short.
                follow: list[int] = []
                for i in range(k):
                    j = end + i
                    follow.append(context[j] if j < len(context) else follow[j - len(context)])
                return Draft(follow, None, [])  # no confidence of its own: the engine measures it
        return Draft([], None, [])
