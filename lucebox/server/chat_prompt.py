"""A request's prompt as the engine takes it (`Prompt`): a chat's messages rendered by the model's
template (with the tools and the template's variables: `chat_template_kwargs`, `reasoning_effort`)
and tokenized, with its turn boundary; a completion's text or ids. Then what the prompt decides for
a reasoning model: whether the answer starts inside a thought, and the thought's budget as a grammar
(`constrained.thought_budget`)."""

from __future__ import annotations

from dataclasses import dataclass

from lucebox.chat.conversation import encode_all, render, turn_boundary
from lucebox.constrained.thought_budget import thought_budget_grammar
from lucebox.errors import LuceboxError
from lucebox.request_options import chosen_constraint
from lucebox.server import openai_api as api
from lucebox.text.reasoning import reasoning_format, starts_inside, thinking_off
from lucebox.tools import prompt_parts


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    snapshots: tuple[int, ...]  # `LLM.stream`'s snapshot_at: a chat's turn boundary
    text: str = ""  # a chat's rendered prompt


def model_reasoning(llm, setting: str) -> tuple[str | None, str]:
    """(the model's reasoning syntax, its chat template's source): none under --reasoning-format none,
    or without a template."""
    try:
        tokenizer = llm.tokenizer
    except LuceboxError:  # no tokenizer: no chat
        return None, ""
    template = (tokenizer.chat_template() or "") if tokenizer.has_chat_template else ""
    return (reasoning_format(template) if setting == "auto" else None), template


def prompt_of(llm, req, variables: dict) -> Prompt:
    """The request's prompt; a 400 when the template fails on it."""
    try:
        if req.kind == "chat":
            tokenizer, messages, tools = llm.tokenizer, req.messages, None
            if req.tools is not None:
                messages, tools = prompt_parts(tokenizer, messages, req.tools)
            text = render(tokenizer, messages, True, tools, variables)
            ids = encode_all(tokenizer, text)
            history = encode_all(tokenizer, render(tokenizer, messages, False, tools, variables))
            return Prompt(ids, turn_boundary(history, ids), text)
        if isinstance(req.prompt, str):
            return Prompt(llm.tokenizer.encode(req.prompt), ())
        return Prompt(list(req.prompt), ())
    except LuceboxError as e:  # no tokenizer, a template that fails on these messages
        raise api.APIError(400, str(e)) from None


def budget_options(fmt: str | None, prompt: Prompt, budget: int | None, options) -> dict:
    """RequestOptions fields for a thought budget (a grammar), or none: no budget, or a prompt that
    turned thinking off. A request constrained otherwise cannot take one (400)."""
    if budget is None or thinking_off(fmt, prompt.text):
        return {}
    if chosen_constraint(options.json_schema, options.grammar, options.json_object) is not None:
        raise api.APIError(400, "reasoning_budget: a bounded thought is a grammar of its own; it cannot be combined "
                                "with response_format, grammar or forced tool calls", "reasoning_budget")
    return {"grammar": thought_budget_grammar(budget, starts_inside(fmt, prompt.text))}
