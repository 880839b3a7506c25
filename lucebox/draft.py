"""The drafts one verify step checks: the one type the drafters, the grammar that cuts and masks
them and the acceptance rule share (`speculative.proposer` makes them, `constrained.state` cuts
them, `speculative.decide` judges them)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Draft:
    tokens: list[int]
    # (k, V) float64: what each draft was drawn from; None for deterministic drafts (one-hot).
    q: torch.Tensor | None = None
    # The drafter's own probability of each draft (top-1 mass); feeds the adaptive width. Empty
    # when the drafter has no such notion (the engine then uses measured keep rates).
    confidence: list[float] = field(default_factory=list)
    # Copied from the context (prompt lookup): judged into keep rates of its own, which cut it, so the
    # drafter's stay its own (a copy of repeating text is kept far more often than a drafted block).
    copied: bool = False

    def first(self, n: int) -> Draft:
        """The first `n` drafts (all of them when there are no more)."""
        if n >= len(self.tokens):
            return self
        return Draft(self.tokens[:n], None if self.q is None else self.q[:n], self.confidence[:n], self.copied)
