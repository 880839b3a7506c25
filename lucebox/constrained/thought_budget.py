"""A thought with a budget (`reasoning_budget`): a grammar (llguidance's Lark) under which the model
thinks freely until it closes the thought itself or has written `budget` tokens of it, when the
close is forced; the answer after it is free. Only the `<think>` syntax (`text.reasoning`), whose
markers are text in the vocabularies that use them (Qwen3's `<think>` tokens are not special), so they
are written as text: the grammar engine forces a marker held as one token as that token."""

from __future__ import annotations

import json

from lucebox.constrained.spec import Constraint
from lucebox.text.reasoning import CLOSE, OPEN


def thought_budget_grammar(budget: int, inside: bool) -> str:
    """Lark text: the thought (opened by the model unless the prompt left it `inside` one) of at most
    `budget` tokens, its close, then any answer."""
    opening = "" if inside else f"{json.dumps(OPEN)} "
    if budget == 0:
        lark = f"start: {opening}{json.dumps(CLOSE)} answer\n"
    else:  # lazy: the thought ends at the model's own close, or at the budget, where the close is forced
        lark = (f"start: {opening}thought {json.dumps(CLOSE)} answer\n"
                f"thought[stop={json.dumps(CLOSE)}, max_tokens={budget}]: /(.|\\n)*/\n")
    lark += "answer: /(.|\\n)*/\n"
    Constraint.lark(lark, "reasoning_budget")
    return lark
