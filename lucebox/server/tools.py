"""Tool calling on /v1/chat/completions: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`
checked into what the prompt and the engine need, and the messages of a tool-calling chat
(assistant `tool_calls`, `tool` results) made ready for the chat template.

- The tools go to the chat template as transformers passes them (`tools=[{"type": "function",
  "function": {...}}]`, the "tool_use" template when the model has one). A template that never reads
  `tools` (or none at all) gets them in a system message instead, so the model still sees them.
- `auto`: the model decides; calls are parsed from its output in its own syntax (`text.tool_calls`,
  chosen from the template or by `--tool-parser`). `none`: the tools are rendered, nothing is parsed.
  `required` or a named function: the output is constrained to calls in that syntax whose arguments
  follow each function's schema (`constrained.tool_grammar`).
- A named function is called exactly once. `required` calls one or more of the tools, exactly one
  with `parallel_tool_calls=false`, under which `auto` keeps the first call the model wrote.
- `strict`: a constrained call always follows its schema; under `auto` nothing constrains the
  arguments, so a call to a `strict` function whose arguments its schema refuses is not returned as a
  call: the answer comes back as text (`tool_stream`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from lucebox.constrained.schema_check import follows_schema
from lucebox.constrained.spec import Constraint
from lucebox.constrained.tool_grammar import tool_call_grammar
from lucebox.errors import GrammarError, LuceboxError
from lucebox.server.openai_api import APIError, invalid
from lucebox.text.tool_calls import FORMATS, ToolCall, detect_format

_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}


@dataclass(frozen=True)
class ToolRequest:
    tools: list[dict]  # [{"type": "function", "function": {...}}], as the template takes them
    choice: str  # "auto" | "none" | "required" | "function" (one named function)
    parallel: bool
    fmt: str | None  # the model's call syntax (`text.tool_calls.FORMATS`); None: the model has none
    constraint: dict  # LLM.stream keywords ({"grammar": ...} under required / a named function)

    @property
    def parses(self) -> bool:
        return self.choice != "none"

    def allows(self, call: ToolCall) -> bool:
        """Is `call` one to a tool given, with arguments that follow its schema where it is `strict`?"""
        f = next((t["function"] for t in self.tools if t["function"]["name"] == call.name), None)
        return f is not None and (not f.get("strict") or follows_schema(call.arguments, f.get("parameters") or {}))


def tool_request(body: dict, kind: str, fmt: str | None, token_id, mistral_args: bool) -> ToolRequest | None:
    """The request's tool calling, checked (None: no tools); `fmt`: the server's call syntax."""
    for name in ("functions", "function_call"):
        if body.get(name) is not None:
            raise invalid(name, "is OpenAI's deprecated form; give tools and tool_choice")
    if kind != "chat":  # tool_choice "none" and parallel_tool_calls without tools ask for nothing
        if body.get("tools") or body.get("tool_choice") not in (None, "none"):
            raise invalid("tools" if body.get("tools") else "tool_choice",
                          "tool calling is only on /v1/chat/completions")
        return None
    tools, choice = _tools(body.get("tools")), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid("parallel_tool_calls", "must be true or false")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice: there are no tools to call (give tools)", "tool_choice")
        return None
    functions = {t["function"]["name"]: t["function"] for t in tools}
    if choice is None:
        choice = "auto"
    forced = list(functions.values()) if choice == "required" else None
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if not isinstance(name, str) or set(choice) - {"type", "function"}:
            raise invalid("tool_choice", 'must be "none", "auto", "required" or '
                                         '{"type": "function", "function": {"name": ...}}')
        if name not in functions:
            raise APIError(400, f"tool_choice: no tool is named {name!r}", "tool_choice")
        choice, forced = "function", [functions[name]]
    elif choice not in ("none", "auto", "required"):
        raise invalid("tool_choice", 'must be "none", "auto", "required" or {"type": "function", ...}')
    if choice != "none" and fmt is None:
        raise APIError(400, "tools: this model's chat template writes no tool-call syntax lucebox knows; start "
                            f"the server with --tool-parser ({', '.join(FORMATS)}) to choose one", "tools")
    constraint = {}
    if forced is not None:
        if body.get("response_format") not in (None, {"type": "text"}) or body.get("grammar") is not None:
            raise APIError(400, f"tool_choice {choice!r} constrains the output to tool calls; it cannot take "
                                "response_format or grammar too", "tool_choice")
        try:
            parallel = parallel is not False and choice == "required"
            constraint = {"grammar": tool_call_grammar(forced, fmt, parallel, token_id, mistral_args)}
        except GrammarError as e:
            raise APIError(400, str(e), e.field, "invalid_tool_schema") from None
    return ToolRequest(tools, choice, parallel is not False, fmt, constraint)


def _tools(value) -> list[dict]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise invalid("tools", 'must be a list of {"type": "function", "function": {...}}')
    tools, names = [], set()
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") != "function" or set(tool) - {"type", "function"}:
            raise invalid(f"tools[{i}]", 'must be {"type": "function", "function": {name, description, parameters}}')
        f, at = tool.get("function"), f"tools[{i}].function"
        if not isinstance(f, dict):
            raise invalid(at, "must be an object {name, description, parameters, strict}")
        unknown = sorted(set(f) - _FUNCTION_KEYS)
        if unknown:
            raise invalid(f"{at}.{unknown[0]}", f"is not one of {', '.join(sorted(_FUNCTION_KEYS))}")
        if not isinstance(f.get("name"), str) or not _NAME.fullmatch(f["name"]):
            raise invalid(f"{at}.name", "must be 1 to 64 letters, digits, underscores or dashes")
        if f["name"] in names:
            raise APIError(400, f"{at}.name: two tools are named {f['name']!r}", f"{at}.name")
        for key, kind in (("description", str), ("strict", bool)):
            if f.get(key) is not None and not isinstance(f[key], kind):
                raise invalid(f"{at}.{key}", f"must be a {kind.__name__}")
        if f.get("parameters") is not None:
            try:
                Constraint.json_schema(f["parameters"], f"{at}.parameters")
            except GrammarError as e:
                raise APIError(400, str(e), e.field, "invalid_tool_schema") from None
        names.add(f["name"])
        tools.append({"type": "function", "function": {k: v for k, v in f.items() if v is not None}})
    return tools


def tool_message(message: dict, i: int, content: str) -> dict:
    """A `tool` result or an assistant turn with `tool_calls`, as chat templates read them: each call's
    arguments as an object (OpenAI's API carries them as JSON text; transformers' templates write
    them with `tojson`)."""
    if message["role"] == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise invalid(f"messages[{i}].tool_call_id", "is required: the id of the call this answers")
        name = {"name": message["name"]} if isinstance(message.get("name"), str) else {}  # some templates print it
        return {"role": "tool", "content": content, "tool_call_id": call_id, **name}
    calls = []
    for j, call in enumerate(message["tool_calls"] if isinstance(message["tool_calls"], list) else [None]):
        at = f"messages[{i}].tool_calls[{j}]"
        f = call.get("function") if isinstance(call, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not isinstance(f.get("arguments"), str):
            raise invalid(at, 'must be {"id", "type": "function", "function": {"name", "arguments": JSON text}}')
        try:
            arguments = json.loads(f["arguments"])
        except json.JSONDecodeError as e:
            raise invalid(f"{at}.function.arguments", f"is not JSON text ({e})") from None
        calls.append({"id": call.get("id", ""), "type": "function",
                      "function": {"name": f["name"], "arguments": arguments}})
    return {"role": "assistant", "content": content, "tool_calls": calls}


def tools_as_system_text(tools: list[dict], fmt: str | None) -> str:
    """The tools in a system message, for a template that does not render them itself."""
    example = {"hermes": '<tool_call>\n{"name": NAME, "arguments": {...}}\n</tool_call>',
               "llama3": '{"name": NAME, "parameters": {...}}',
               "mistral": '[TOOL_CALLS][{"name": NAME, "arguments": {...}}]'}.get(fmt)
    how = f" To call one, write:\n{example}" if example else ""
    return f"You can call these tools (JSON Schema of their arguments):\n{json.dumps(tools)}\n{how}".rstrip()


def call_json(calls: tuple[ToolCall, ...], with_index: bool = False) -> list[dict]:
    """`tool_calls` as OpenAI's API writes them (stream deltas carry an index)."""
    return [{**({"index": i} if with_index else {}), "id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for i, c in enumerate(calls)]


def prompt_parts(tokenizer, messages: list[dict], request: ToolRequest) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools for the template): the tools go to a template that reads them, else into a
    system message of their own before the chat."""
    template = tokenizer.chat_template(tools=True) if tokenizer.has_chat_template else None
    if template is not None and "tools" in template:
        return messages, request.tools
    return [{"role": "system", "content": tools_as_system_text(request.tools, request.fmt)}, *messages], None


def model_tool_format(llm, forced: str | None) -> tuple[str | None, bool]:
    """(the call syntax the server uses, whether it is Mistral's `name[ARGS]{...}` form): `forced`
    (--tool-parser), else the one the model's chat template writes."""
    try:
        tokenizer = llm.tokenizer
    except LuceboxError:  # no tokenizer: no chat, no tools
        return forced, False
    template = tokenizer.chat_template(tools=True) or ""
    return forced or detect_format(template), "[ARGS]" in template
