"""A grammar (llguidance's Lark) whose every sentence is tool calls in the model's own syntax
(`text.tool_calls`), each call's arguments following its function's JSON Schema: what
`tool_choice="required"` or a named function constrain the output to.

A marker the tokenizer holds as one token (`<tool_call>` in Qwen's vocabulary, `[TOOL_CALLS]` in
Mistral's) is written as that token (`<[id]>`): a special token is never matched by text, and the
model writes the single token, not its spelling."""

from __future__ import annotations

import json

from lucebox.constrained.spec import JSON_DEFAULTS, Constraint
from lucebox.errors import GrammarError
from lucebox.text.json_calls import ANSWER_HEAD, CALLS_HEAD


def tool_call_grammar(functions: list[dict], fmt: str, parallel: bool, token_id, mistral_args: bool = False,
                      field: str = "tools", answer: bool = False) -> str:
    """The grammar (Lark text, checked by the grammar engine) for calls to any of `functions`
    ({"name", "parameters"} dicts) in syntax `fmt`; one call, or (`parallel`) one or more.
    `token_id(text)`: the id of a token spelled `text`, or None.
    `mistral_args`: Mistral's newer `[TOOL_CALLS]name[ARGS]{...}` syntax.
    `answer`: the generic syntax's answer object is allowed instead of the calls (tool_choice auto)."""
    def literal(text: str) -> str:
        i = token_id(text)
        return f"<[{i}]>" if i is not None else json.dumps(text)

    def arguments(f: dict) -> str:
        schema = f.get("parameters") or {"type": "object"}
        options = schema.get("x-guidance", {})
        if not isinstance(options, dict):  # `tools.request` refuses it first, naming the tool
            raise GrammarError(field, f"x-guidance must be an object, got {type(options).__name__}")
        schema = {**schema, "x-guidance": {**JSON_DEFAULTS, **options}}
        return "%json " + json.dumps(schema)

    def json_call(f: dict, key: str) -> str:  # {"name": "f", "<key>": {...}}
        head = json.dumps({"name": f["name"]})[:-1] + ", " + json.dumps(key) + ": "
        return f'{json.dumps(head)} {arguments(f)} "}}"'

    if fmt == "hermes":
        call = " | ".join(f'{literal("<tool_call>")} "\\n" {json_call(f, "arguments")} "\\n" {literal("</tool_call>")}'
                          for f in functions)
        start = 'call ("\\n" call)*' if parallel else "call"
    elif fmt == "qwen3_coder":
        call = " | ".join(xml_call(f, literal) for f in functions)
        start = 'call ("\\n" call)*' if parallel else "call"
    elif fmt == "llama3":
        call = " | ".join(json_call(f, "parameters") for f in functions)
        start = 'call ("; " call)*' if parallel else "call"
    elif fmt == "json":  # {"tool_calls": [call, ...]} or {"content": "..."}
        call = " | ".join(json_call(f, "arguments") for f in functions)
        more = ' (", " call)*' if parallel else ""
        calls = f'{json.dumps(CALLS_HEAD)} call{more} "]}}"'
        start = f'{calls} | {json.dumps(ANSWER_HEAD)} %json {{"type": "string"}} "}}"' if answer else calls
    elif mistral_args:
        call = " | ".join(f'{literal("[TOOL_CALLS]")} {json.dumps(f["name"])} {literal("[ARGS]")} {arguments(f)}'
                          for f in functions)
        start = "call+" if parallel else "call"
    else:
        call = " | ".join(json_call(f, "arguments") for f in functions)
        start = f'{literal("[TOOL_CALLS]")} "[" call (", " call)* "]"' if parallel else \
            f'{literal("[TOOL_CALLS]")} "[" call "]"'
    lark = f"start: {start}\ncall: {call}\n"
    if "param_text" in call:  # a string parameter's text: up to its closing tag, which ends it
        lark += 'param_text[suffix="\\n</parameter>\\n"]: /(.|\\n)*/\n'
    Constraint.lark(lark, field)  # a GrammarError naming `field` if the engine cannot compile it
    return lark


# Non-string values as the templates write them (Jinja's tojson: Python's json.dumps separators)
_AS_TOJSON = {**JSON_DEFAULTS, "item_separator": ", ", "key_separator": ": "}


def xml_call(f: dict, literal) -> str:
    """One call to `f` in Qwen3-Coder's tags (`text.xml_calls`): its schema's parameters in order,
    the required ones always; a string is written bare (one of its enum, or any text up to its
    closing tag: its other string constraints are not held), any other value as JSON following its
    schema. A schema without properties takes any parameters as text."""
    schema = f.get("parameters") or {}
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = set(schema.get("required") or ()) if isinstance(schema.get("required"), list) else set()
    close = json.dumps("\n</parameter>\n")
    parts = []
    for key, sub in properties.items():
        sub = sub if isinstance(sub, dict) else {}
        enum = sub.get("enum")
        if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):  # bare, one of them
            value = "(" + " | ".join(json.dumps(v) for v in enum) + f") {close}"
        elif sub.get("type") == "string" or "type" not in sub and "anyOf" not in sub:
            value = "param_text"
        else:
            value = "%json " + json.dumps({**sub, "x-guidance": _AS_TOJSON}) + f" {close}"
        part = f'("<parameter=" {json.dumps(key)} ">\\n" {value})'
        parts.append(part if key in required else part + "?")
    if not properties:
        parts.append('("<parameter=" /[^>\\n]+/ ">\\n" param_text)*')
    head = f'{literal("<tool_call>")} "\\n<function=" {json.dumps(f["name"])} ">\\n"'
    return f'({head} {" ".join(parts)} "</function>\\n" {literal("</tool_call>")})'
