"""A chat request's reasoning fields, checked into the chat template's variables and a thought
budget (`ReasoningAsk`):

- `chat_template_kwargs` (vLLM's and llama.cpp's): variables for the template, e.g.
  `{"enable_thinking": false}` (Qwen3's switch); the ones the server sets itself are refused by name.
- `reasoning_effort` (OpenAI's: none, minimal, low, medium, high): given to the template as
  `reasoning_effort` (gpt-oss reads it); "none" turns thinking off through the template's
  `enable_thinking` when it has one, else by a budget of 0; "medium" and "high" leave the model its own
  full thought. A model whose template writes no thought refuses it (400), as does gpt-oss
  "none"/"minimal" (it always reasons; its lowest is low), and "minimal"/"low" where the template has
  no effort setting (they would change nothing).
- `reasoning_budget` (and `serve --reasoning-budget`, its default): the thought's most tokens; once
  they are spent the close is forced and the model answers (`RequestOptions.thought_budget`). 0 turns
  thinking off (through `enable_thinking` when the template has it, else the close is forced at once:
  `constrained.thought_first`), -1 leaves it unbounded. Only for `<think>` templates (gpt-oss bounds
  its thought by reasoning_effort: 400); beside a constrained answer (a JSON response_format, forced
  calls) the forced close is followed by the answer's constraint.
"""

from __future__ import annotations

from dataclasses import dataclass

from lucebox.server.api_errors import APIError, invalid
from lucebox.text.reasoning import HARMONY, THINK

EFFORTS = ("none", "minimal", "low", "medium", "high")
_SET_BY_SERVER = ("messages", "tools", "add_generation_prompt", "documents", "self")  # "self": the renderer's
MAX_BUDGET = 2**24  # tokens; past any context lucebox serves


@dataclass(frozen=True)
class ReasoningAsk:
    variables: dict  # the chat template's variables
    budget: int | None  # the thought's most tokens; None: no bound


def reasoning_ask(body: dict, fmt: str | None, template: str, default_budget: int) -> ReasoningAsk:
    """The request's reasoning fields, checked; `fmt`: the model's reasoning syntax (None: it has none);
    `template`: its chat template's source; `default_budget`: the server's --reasoning-budget (for a
    request with no grammar of its own, which covers the thought)."""
    variables = _template_kwargs(body.get("chat_template_kwargs"))
    budget = body.get("reasoning_budget")
    if budget is None:
        budget = default_budget if fmt == THINK and body.get("grammar") is None else -1
    elif isinstance(budget, bool) or not isinstance(budget, int) or not -1 <= budget <= MAX_BUDGET:
        raise invalid("reasoning_budget", f"must be -1 (no bound) or a number of tokens up to {MAX_BUDGET}, "
                                          f"got {budget!r}")
    elif budget != -1 and fmt != THINK:
        why = "gpt-oss reasoning takes reasoning_effort" if fmt == HARMONY else "it does not reason"
        raise APIError(400, f"reasoning_budget: this model's chat template writes no <think> thought to bound ({why})",
                       "reasoning_budget")
    effort = body.get("reasoning_effort")
    if effort is not None:
        budget = _effort(effort, fmt, template, variables, budget)
    if budget == 0 and "enable_thinking" in template:  # the template's own switch, unless the request set it
        if variables.setdefault("enable_thinking", False) is False:
            budget = -1  # the model answers as trained to without a thought
    return ReasoningAsk(variables, None if budget == -1 else budget)


def _effort(effort, fmt: str | None, template: str, variables: dict, budget: int) -> int:
    """`reasoning_effort` into the template's variables; the budget it leaves."""
    if effort not in EFFORTS:
        raise invalid("reasoning_effort", f"must be one of {', '.join(EFFORTS)}, got {effort!r}")
    if fmt is None:
        raise APIError(400, "reasoning_effort: this model's chat template writes no thought; it does not "
                            "reason", "reasoning_effort")
    if fmt == HARMONY and effort in ("none", "minimal"):
        raise APIError(400, f"reasoning_effort: gpt-oss always reasons; its efforts are low, medium, high, got "
                            f"{effort!r}", "reasoning_effort")
    if effort in ("minimal", "low") and "reasoning_effort" not in template:
        raise APIError(400, f"reasoning_effort: this model's template has no effort setting, so {effort!r} would "
                            "change nothing; bound the thought with reasoning_budget, or turn it off with none",
                       "reasoning_effort")
    variables.setdefault("reasoning_effort", effort)  # medium and high: the model's own full thought
    return 0 if effort == "none" else budget


def _template_kwargs(value) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise invalid("chat_template_kwargs", 'must be an object of the template\'s variables, like '
                                              '{"enable_thinking": false}')
    for key in value:
        if key in _SET_BY_SERVER:
            raise invalid(f"chat_template_kwargs.{key}", "is not a variable a request may set (the server sets it "
                                                         "from the request's own fields)")
    return dict(value)
