"""OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`, checked into what the prompt and the
engine need (`ToolRequest`); anything wrong is a ToolError naming the field.

- `auto`: the model decides; calls are parsed from its output in its own syntax (`text.tool_calls`,
  chosen from the template or by `--tool-parser`). `none`: the tools are rendered, nothing is parsed.
  `required` or a named function: the output is constrained to calls in that syntax whose arguments
  follow each function's schema (`constrained.tool_grammar`).
- A model whose template teaches no call syntax gets the generic one ("json", `text.json_calls`):
  one JSON object, the calls or the answer, which the grammar forces under `auto` too (so it cannot
  take another constraint beside it).
- An answer that repeats a call it already wrote ends there (`RequestOptions.end_on_repeated_call`):
  a model looping on its calls returns them once, not until max_tokens.
- A named function is called exactly once. `required` calls one or more of the tools, exactly one
  with `parallel_tool_calls=false`, under which `auto` keeps the first call the model wrote.
- `strict`: a constrained call always follows its schema; under `auto` nothing constrains the
  arguments, so a call to a `strict` function whose arguments its schema refuses is not returned as a
  call: the answer comes back as text (`answer.ToolCallStream`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from lucebox.constrained.schema_check import follows_schema
from lucebox.constrained.spec import Constraint
from lucebox.constrained.tool_grammar import tool_call_grammar
from lucebox.errors import GrammarError, ToolError
from lucebox.text.tool_calls import ToolCall

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
# what a stop string is refused beside (`constrained.spec.refuse_stops`)
CONSTRAINED_CALLS = "tool calls under a grammar (tool_choice required, a named function, or the generic JSON syntax)"
_CHOICES = 'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'


@dataclass(frozen=True)
class ToolRequest:
    tools: list[dict]  # [{"type": "function", "function": {...}}], as the template takes them
    choice: str  # "auto" | "none" | "required" | "function" (one named function)
    parallel: bool
    fmt: str  # the model's call syntax (`text.tool_calls.FORMATS`): "json" when its template has none
    constraint: dict  # LLM.stream keywords ({"grammar": ...} under required / a named function)

    @property
    def parses(self) -> bool:
        return self.choice != "none"

    @property
    def engine_options(self) -> dict:
        """LLM.stream keywords: the constraint, and the end of an answer that repeats a call."""
        return {**self.constraint, **({"end_on_repeated_call": self.fmt} if self.parses else {})}

    def allows(self, call: ToolCall) -> bool:
        """Is `call` one to a tool given, with arguments that follow its schema where it is `strict`?"""
        f = next((t["function"] for t in self.tools if t["function"]["name"] == call.name), None)
        return f is not None and (not f.get("strict") or follows_schema(call.arguments, f.get("parameters") or {}))


def _invalid(field: str, message: str) -> ToolError:
    return ToolError(field, f"{field}: {message}")


def check_tools(tools, choice, parallel, fmt: str | None, token_id, mistral_args: bool,
                other_constraint: str | None = None) -> ToolRequest | None:
    """The tool calling asked for, checked (None: no tools). `fmt`: the model's call syntax;
    (None: the template has none, and the generic "json" is used); `token_id(text)`: the id of the one
    token spelled `text`, or None; `mistral_args`: Mistral's
    `name[ARGS]{...}` syntax; `other_constraint`: the name of another constraint the request gives
    (which required / a named function cannot take too)."""
    tools = _tools(tools)
    if parallel is not None and not isinstance(parallel, bool):
        raise _invalid("parallel_tool_calls", "must be true or false")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ToolError("tool_choice", "tool_choice: there are no tools to call (give tools)", 400)
        return None
    functions = {t["function"]["name"]: t["function"] for t in tools}
    if choice is None:
        choice = "auto"
    forced = list(functions.values()) if choice == "required" else None
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or set(choice) - {"type", "function"}:
            raise _invalid("tool_choice", _CHOICES)
        if name not in functions:
            raise ToolError("tool_choice", f"tool_choice: no tool is named {name!r}", 400)
        choice, forced = "function", [functions[name]]
    elif choice not in ("none", "auto", "required"):
        raise _invalid("tool_choice", _CHOICES)
    fmt = fmt or "json"
    generic_auto = fmt == "json" and choice == "auto"
    constraint = {}
    if forced is not None or generic_auto:
        if other_constraint is not None:
            how = (f"tool_choice {choice!r} constrains the output to tool calls" if not generic_auto else
                   "this model's template has no tool-call syntax, so with tools its answer is constrained to "
                   "the generic JSON one")
            raise ToolError("tool_choice", f"{how}; it cannot take {other_constraint} too", 400)
        try:
            many = parallel is not False and choice in ("required", "auto")
            constraint = {"grammar": tool_call_grammar(forced or list(functions.values()), fmt, many, token_id,
                                                       mistral_args, answer=generic_auto)}
        except GrammarError as e:
            raise ToolError(e.field, str(e), 400, "invalid_tool_schema") from None
    return ToolRequest(tools, choice, parallel is not False, fmt, constraint)


def _tools(value) -> list[dict]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise _invalid("tools", 'must be a list of {"type": "function", "function": {...}}')
    tools, names = [], set()
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") != "function" or set(tool) - {"type", "function"}:
            raise _invalid(f"tools[{i}]", 'must be {"type": "function", "function": {name, description, parameters}}')
        f, at = tool.get("function"), f"tools[{i}].function"
        if not isinstance(f, dict):
            raise _invalid(at, "must be an object {name, description, parameters, strict}")
        unknown = sorted(set(f) - _FUNCTION_KEYS)
        if unknown:
            raise _invalid(f"{at}.{unknown[0]}", f"is not one of {', '.join(sorted(_FUNCTION_KEYS))}")
        if not isinstance(f.get("name"), str) or not _NAME.fullmatch(f["name"]):
            raise _invalid(f"{at}.name", "must be 1 to 64 letters, digits, underscores or dashes")
        if f["name"] in names:
            raise ToolError(f"{at}.name", f"{at}.name: two tools are named {f['name']!r}", 400)
        for key, kind in (("description", str), ("strict", bool)):
            if f.get(key) is not None and not isinstance(f[key], kind):
                raise _invalid(f"{at}.{key}", f"must be a {kind.__name__}")
        if f.get("parameters") is not None:
            if not isinstance(f["parameters"], dict):  # JSON text would reach the template as a string
                raise _invalid(f"{at}.parameters", "must be a JSON Schema object, not "
                                                   f"{type(f['parameters']).__name__}")
            kind = f["parameters"].get("type")
            if kind is not None and kind != "object":  # a call's arguments are an object, never another value
                raise ToolError(f"{at}.parameters", f'{at}.parameters: a call\'s arguments are a JSON object: give '
                                f'"type": "object" (with "properties"), got "type": {json.dumps(kind)}', 400,
                                "invalid_tool_schema")
            try:
                Constraint.json_schema(f["parameters"], f"{at}.parameters")
            except GrammarError as e:
                raise ToolError(e.field, str(e), 400, "invalid_tool_schema") from None
        names.add(f["name"])
        tools.append({"type": "function", "function": {k: v for k, v in f.items() if v is not None}})
    return tools
