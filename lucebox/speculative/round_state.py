"""What one request's rounds carry from each round to the next (`rounds.Speculation.state`)."""

from __future__ import annotations

import torch

from lucebox.sampling import SamplingParams


class RoundState:
    """`tokens`: the ids whose rows the cache holds (the prompt, then every committed token);
    `last`: the newest token, chosen but not yet forwarded (so not in `tokens`); `seen` (V,) bool:
    every token so far, for the repetition penalty; `counts` (V,) float32: how often each was
    generated, for the presence and frequency penalties (None when neither is on). `seen` and
    `counts` are kept up to date only when a penalty reads them."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, vocab_size: int, device: torch.device):
        self.tokens = list(prompt_ids)
        self.last: int | None = None
        self.reads_history = params.reads_history
        self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
        self.counts = (torch.zeros(vocab_size, dtype=torch.float32, device=device)
                       if params.counts_generated else None)
        self._mark_seen(prompt_ids, generated=False)

    def commit(self, rows: list[int]) -> None:
        """The rows of these ids ([last, d1, ...]) are now committed in the cache."""
        self.tokens.extend(rows)

    def advance(self, new: list[int]) -> None:
        """`new` tokens were chosen (the first token, or a round's): the newest becomes `last`, and
        every one joins the penalties' history."""
        self.last = new[-1]
        self._mark_seen(new)

    def _mark_seen(self, ids: list[int], generated: bool = True) -> None:
        if not self.reads_history:
            return
        index = torch.tensor(ids, dtype=torch.long, device=self.seen.device)
        self.seen[index] = True
        if generated and self.counts is not None:
            self.counts.index_put_((index,), torch.ones(len(ids), device=self.counts.device), accumulate=True)
