"""Tool calling on /v1/chat/completions: the request's `tools`, `tool_choice` and
`parallel_tool_calls` checked (`lucebox.tools`) into the server's errors, the messages of a
tool-calling chat (assistant `tool_calls`, `tool` results) made ready for the chat template, and
calls as OpenAI's API writes them."""

from __future__ import annotations

import json

from lucebox import bounded_json
from lucebox.constrained.spec import refuse_stops
from lucebox.errors import GrammarError, JSONInputError, ToolError
from lucebox.server.api_errors import APIError, invalid
from lucebox.text.tool_calls import ToolCall
from lucebox.tools import CONSTRAINED_CALLS, ToolRequest, check_tools


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
    _check_tool_results(body.get("messages"))
    other = ("response_format" if body.get("response_format") not in (None, {"type": "text"}) else
             "grammar" if body.get("grammar") is not None else None)
    try:
        request = check_tools(body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls"), fmt,
                              token_id, mistral_args, other)
        if request is not None and request.constraint:
            refuse_stops(body.get("stop"), CONSTRAINED_CALLS)
    except ToolError as e:
        raise APIError(e.status, str(e), e.field, e.code) from None
    except GrammarError as e:
        raise APIError(400, str(e), e.field, "invalid_constraint") from None
    return request


def _check_tool_results(messages) -> None:
    """Each `tool` message answers a call of the assistant message before it (other results of the same
    answer may come between): a result with no call, or for an id no call has, is a 400 naming it."""
    calls: set[str] | None = None  # the call ids the results that follow may answer; None: no answer made calls
    for i, m in enumerate(messages if isinstance(messages, list) else []):
        role = m.get("role") if isinstance(m, dict) else None
        if role != "tool":
            calls = _call_ids(m) if role == "assistant" else None
            continue
        if calls is None:
            raise APIError(400, f"messages[{i}]: a tool result must follow an assistant message with tool_calls; "
                                "give the assistant's tool_calls before their results", f"messages[{i}]")
        if m.get("tool_call_id") not in calls:
            raise APIError(400, f"messages[{i}].tool_call_id: {m.get('tool_call_id')!r} is not the id of a call in "
                                f"the assistant message before it (its calls: {', '.join(sorted(calls)) or 'none'})",
                           f"messages[{i}].tool_call_id")


def _call_ids(message: dict) -> set[str] | None:
    calls = message.get("tool_calls")
    if not isinstance(calls, list) or not calls:
        return None
    return {c["id"] for c in calls if isinstance(c, dict) and isinstance(c.get("id"), str)}


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
            arguments = bounded_json.loads(f["arguments"], "the arguments' JSON text")
            json.dumps(arguments, ensure_ascii=False).encode("utf-8")  # a "\ud800" escape decodes to no text
        except JSONInputError as e:
            raise invalid(f"{at}.function.arguments", str(e)) from None
        except UnicodeEncodeError:
            raise invalid(f"{at}.function.arguments", "holds a lone surrogate escape (\\ud800-\\udfff alone); "
                                                      "text must be valid Unicode") from None
        calls.append({"id": call.get("id", ""), "type": "function",
                      "function": {"name": f["name"], "arguments": arguments}})
    return {"role": "assistant", "content": content, "tool_calls": calls}


def call_json(calls: tuple[ToolCall, ...], with_index: bool = False) -> list[dict]:
    """`tool_calls` as OpenAI's API writes them (stream deltas carry an index)."""
    return [{**({"index": i} if with_index else {}), "id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for i, c in enumerate(calls)]
