"""A request's prompt as the engine takes it (`Prompt`): a chat's messages rendered by the model's
template (with the tools and the template's variables: `chat_template_kwargs`, `reasoning_effort`)
and tokenized, with its turn boundary; a completion's text or ids. Then what the prompt decides for
a reasoning model: whether the answer starts inside a thought, and a grammar that puts the thought
first when its budget or the request's constraint needs one (`constrained.thought_first`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from lucebox.chat.conversation import encode_all, render, turn_boundary
from lucebox.constrained.thought_first import thought_first_options
from lucebox.errors import GrammarError, LuceboxError
from lucebox.server import openai_api as api
from lucebox.text.reasoning import THINK, reasoning_format, thinking_off, thought_fields
from lucebox.tools import prompt_parts


@dataclass(frozen=True)
class Prompt:
    ids: list[int]
    snapshots: tuple[int, ...]  # `LLM.stream`'s snapshot_at: a chat's turn boundary
    text: str = ""  # a chat's rendered prompt


def model_reasoning(llm) -> tuple[str | None, str]:
    """(the model's reasoning syntax, its chat template's source); none without a template."""
    try:
        tokenizer = llm.tokenizer
    except LuceboxError:  # no tokenizer: no chat
        return None, ""
    template = (tokenizer.chat_template() or "") if tokenizer.has_chat_template else ""
    return reasoning_format(template), template


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


def engine_options(req, prompt: Prompt, room: int, stop: list[str], fmt: str | None, ask, token_id):
    """The RequestOptions the engine runs: the request's, with what the prompt decides (the room left,
    the turn boundary), the stop strings, the tools' and (`ask`: a chat's `ReasoningAsk`) the thought's.
    `token_id(text)`: the id of the one token spelled `text` (a marker), or None."""
    calls = {**req.tools.engine_options, **thought_fields(fmt, prompt.text)} if req.tools else {}
    options = replace(req.options, max_tokens=min(req.options.max_tokens, room), stop=stop,
                      snapshot_at=prompt.snapshots, **calls)
    if ask is None:
        return options
    tool_grammar = req.tools.constraint.get("grammar") if req.tools else None
    try:
        return replace(options, **thought_options(fmt, prompt, ask.budget, options, tool_grammar, token_id))
    except GrammarError as e:  # the thought and the answer's constraint in one grammar: past the engine's bounds
        field = e.field if e.field == "reasoning_budget" else "tools" if tool_grammar else "response_format"
        raise api.APIError(400, f"{e} (a reasoning model's answer: its thought and the constraint in one grammar)",
                           field, "invalid_constraint") from None


def thought_options(fmt: str | None, prompt: Prompt, budget: int | None, options, tool_grammar: str | None,
                    token_id) -> dict:
    """`constrained.thought_first.thought_first_options`; a request's own `grammar` constrains the whole
    output, thought included, so it cannot take a budget too (400)."""
    if budget is not None and options.grammar not in (None, tool_grammar) and fmt == THINK \
            and not thinking_off(fmt, prompt.text):
        raise api.APIError(400, "reasoning_budget: a request's grammar constrains the whole output, thought "
                                "included; write the thought's bound into it, or leave one of them out",
                           "reasoning_budget")
    return thought_first_options(fmt, prompt.text, options, budget, tool_grammar, token_id)
