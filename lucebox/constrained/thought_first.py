"""A thought before the answer, in one grammar (llguidance's Lark), for a reasoning model whose
answer is constrained or whose thought is off (`reasoning_budget` 0): the model thinks freely until it
closes the thought itself (or the close comes at once); then the answer, free or under the request's
constraint (a JSON Schema, JSON mode, a grammar, forced tool calls), so that a constraint never
forbids the thought (as vLLM and llama.cpp apply a grammar after the reasoning ends). A budget of N
tokens is counted by the engine, which then forces the close with the answer's constraint after it
(`thought_close_grammar`).

For the `<think>` syntax (`text.reasoning`), whose markers are text in the vocabularies that use them
(Qwen3's `<think>` tokens are not special), the grammar engine forces a marker held as one token as
that token. For gpt-oss's harmony channels (`harmony_first_grammar`), whose markers are special tokens,
a constrained answer is the final channel's message, after the analysis channel's free one; a
marker the tokenizer holds as one token is written as that token (`<[id]>`), never by its spelling.
A harmony thought takes no budget (gpt-oss bounds its reasoning by `reasoning_effort`)."""

from __future__ import annotations

import json

from lucebox.constrained.spec import JSON_DEFAULTS, Constraint
from lucebox.errors import GrammarError
from lucebox.text.reasoning import CLOSE, HARMONY, OPEN, THINK, starts_inside, thinking_off, thought_fields


def thought_first_grammar(inside: bool, budget: int | None = None, answer: str | None = None,
                          markers: tuple[str, str] = (OPEN, CLOSE)) -> str:
    """Lark text: the thought (opened by the model unless the prompt left it `inside` one), its close,
    then the answer: `answer` (a rule's body, from `answer_rule`) after a little whitespace, or any
    text. `budget`: None (the model closes the thought where it will) or 0 (closed at once). A bound
    between is not a grammar (a GrammarError naming reasoning_budget): the grammar engine's way to force
    a close after N tokens of a thought that may close itself (a lazy lexeme's stop followed by the close,
    and its max_tokens) fails inside it when the close takes several tokens, so the engine counts the
    thought instead (`thought_first_options`, `RequestOptions.thought_budget`). `markers`: the
    thought's open and close (`<think>`, `</think>`)."""
    opening, close = ("" if inside else f"{json.dumps(markers[0])} "), json.dumps(markers[1])
    if budget == 0:
        lark = f"start: {opening}{close} answer\n"
    elif budget is None:  # lazy: the thought ends where the model closes it (the close is the lexeme's suffix)
        lark = f"start: {opening}thought answer\nthought[suffix={close}]: /(.|\\n)*/\n"
    else:
        raise GrammarError("reasoning_budget", f"a bound of {budget} tokens is the engine's to count "
                                               "(RequestOptions.thought_budget), not a grammar's")
    lark += _answer_rules(answer)
    Constraint.lark(lark, "reasoning_budget" if answer is None else "grammar")
    return lark


def harmony_first_grammar(inside: bool, answer: str, token_id) -> str:
    """Lark text: gpt-oss's analysis message (free; opened by the model unless the prompt left it
    `inside` one, and left out if the model goes to its final message at once), then the final
    message, whose text is `answer` (a rule's body). `token_id(text)`: the id of the one token spelled
    `text`, or None (a vocabulary that spells the markers as text: the thought then ends at the first
    `<|end|>` it writes)."""
    def marker(text: str) -> str:
        i = token_id(text)
        return f"<[{i}]>" if i is not None else json.dumps(text)

    channel, message, end, start = (marker(m) for m in ("<|channel|>", "<|message|>", "<|end|>", "<|start|>"))
    if token_id("<|end|>") is not None:  # text never writes a special token: the thought's text stops before it
        thought, close = "thought: /(.|\\n)*/\n", f"{end} "
    else:
        thought, close = f"thought[suffix={end}]: /(.|\\n)*/\n", ""
    opening = "" if inside else f'{channel} "analysis" {message} '
    lark = (f"start: {'analysis' if inside else 'analysis?'} final\n"
            f'analysis: {opening}thought {close}{start} "assistant"\n'
            f'final: {channel} "final" {message} constrained\n{thought}constrained: {answer}\n')
    Constraint.lark(lark, "grammar")
    return lark


def _answer_rules(answer: str | None) -> str:
    """The `answer` rule: any text, or the constrained answer (a rule's body)."""
    if answer is None:
        return "answer: /(.|\\n)*/\n"
    # between the close and a constrained answer, the blank line templates write (Qwen3's, R1's "\n\n")
    return f"answer: gap constrained\ngap: /\\s{{0,2}}/\nconstrained: {answer}\n"


def thought_close_grammar(answer: str | None = None) -> str:
    """Lark text: the thought's close, then the answer (any, or `answer`'s constraint): what a spent
    thought budget forces (`RequestOptions.thought_budget` and `after_thought`, the engine swapping
    it in once the text stage saw the budget spent)."""
    return f"start: {json.dumps(CLOSE)} answer\n" + _answer_rules(answer)


def answer_rule(json_schema=None, json_object: bool = False, grammar: str | None = None) -> str | None:
    """The body of a Lark rule for a request's constraint (None: it has none)."""
    if json_schema is not None or json_object:
        schema = json.loads(json_schema) if isinstance(json_schema, str) else (json_schema or {"type": "object"})
        options = schema.get("x-guidance") if isinstance(schema.get("x-guidance"), dict) else {}
        return "%json " + json.dumps({**schema, "x-guidance": {**JSON_DEFAULTS, **options}})
    if grammar is not None:
        from llguidance.gbnf_to_lark import any_to_lark

        return "%lark {\n" + any_to_lark(grammar) + "\n}"
    return None


def thought_first_options(fmt: str | None, prompt_text: str, options, budget: int | None = None,
                          tool_grammar: str | None = None, token_id=lambda text: None) -> dict:
    """RequestOptions fields for a reasoning model's answer (after `prompt_text`) that is bounded
    (`budget`, `<think>` only) or constrained by a JSON Schema, JSON mode or forced tool calls
    (`tool_grammar`): one grammar, the thought first. None needed (`{}`): the model does not think
    here, nothing is asked, or the options carry a grammar of their own, which constrains the whole
    output, thought included. `token_id(text)`: the id of the one token spelled `text`, or None."""
    if fmt not in (THINK, HARMONY) or thinking_off(fmt, prompt_text) or options.grammar not in (None, tool_grammar):
        return {}
    answer = answer_rule(options.json_schema, options.json_object, tool_grammar)
    if fmt == HARMONY:
        if budget is not None:  # `server.reasoning_fields` refuses it first, naming reasoning_effort
            raise GrammarError("reasoning_budget", "a gpt-oss thought takes no budget; bound it with reasoning_effort")
        if answer is None:
            return {}
        grammar = harmony_first_grammar(starts_inside(fmt, prompt_text), answer, token_id)
        return {"grammar": grammar, "json_schema": None, "json_object": False}
    if budget is not None and budget > 0:  # counted by the engine's text stage, the close forced when spent
        bounded = {"thought_budget": budget, **thought_fields(fmt, prompt_text)}
        if answer is None:
            return bounded
        grammar = thought_first_grammar(starts_inside(fmt, prompt_text), None, answer)
        return {**bounded, "grammar": grammar, "json_schema": None, "json_object": False,
                "after_thought": thought_close_grammar(answer)}
    if budget is None and answer is None:
        return {}
    grammar = thought_first_grammar(starts_inside(fmt, prompt_text), budget, answer)
    return {"grammar": grammar, "json_schema": None, "json_object": False}
