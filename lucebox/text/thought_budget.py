"""A thought with a budget (`RequestOptions.thought_budget`): the engine's text stage counts the tokens
an answer spends inside its thought (`text.reasoning`), and once it has spent the budget without
closing the thought the round ends there; the engine then forces the close (a grammar, so speculation
stays exact) and the model answers."""

from __future__ import annotations

from lucebox.text.incremental import IncrementalDecoder
from lucebox.text.reasoning import ReasoningSplit


class ThoughtBudget:
    def __init__(self, tokenizer, prompt_ids, fmt: str, inside: bool, budget: int):
        """`fmt`, `inside`: the answer's reasoning syntax and whether the prompt opened the thought."""
        self._decoder = IncrementalDecoder(tokenizer, prompt_ids, skip_special_tokens=False)
        self._split, self._budget = ReasoningSplit(fmt, inside), budget
        self.spent_tokens, self.spent = 0, False

    def push(self, token: int) -> bool:
        """Whether this token, in the thought, used up the budget (the close is due next)."""
        if self.spent:
            return False
        self._split.push(self._decoder.push([token]))
        if self._split.in_thought:
            self.spent_tokens += 1
            self.spent = self.spent_tokens >= self._budget
        return self.spent
