"""A saved conversation (`ChatSession.save`, `/save`): its JSON format, and reading one back.

A saved chat may come from someone else, so reading one is bounded and every way it can be wrong
is an InvalidArgumentError naming the file: a name with a NUL character, something that is not a
regular file (`/dev/zero`, a FIFO, a folder) or is larger than CHAT_FILE_MAX_BYTES (checked before
reading, and at most that many bytes are read), text that is not UTF-8 or JSON (nested too deeply,
a number with more digits than Python converts), a record that is not a saved chat.

A chat with tools saves them (`"tools"`: the tools, tool_choice and parallel_tool_calls it was opened
with, and its tool_parser) and its tool messages as templates read them: an assistant message's `tool_calls` (each
`{"id", "type": "function", "function": {"name", "arguments": object}}`, its content then text or
null) and `{"role": "tool", "tool_call_id", "name", "content"}` results.
"""

from __future__ import annotations

import json
from pathlib import Path

from lucebox import bounded_json
from lucebox.errors import InvalidArgumentError

CHAT_FORMAT = "lucebox-chat"
ROLES = ("system", "user", "assistant")
# what a chat opened with tools keeps of them (`LLM.chat`'s arguments), in this order
TOOL_KEYS = ("tools", "tool_choice", "parallel_tool_calls", "tool_parser")
CHAT_FILE_MAX_BYTES = 16 * 2**20  # ~4M tokens of text: past any context a conversation could fill


def chat_record(model: str, system: str | None, settings: dict, messages: list[dict],
                tools: dict | None = None) -> str:
    """The JSON text a conversation is saved as; `tools`: {"tools", "tool_choice",
    "parallel_tool_calls", "tool_parser"} of a chat opened with tools."""
    record = {"format": CHAT_FORMAT, "version": 1, "model": model, "system": system, "settings": settings,
              "messages": messages}
    if tools is not None:
        record["tools"] = tools
    return json.dumps(record, indent=2, ensure_ascii=False) + "\n"


def read_chat(path: str | Path) -> dict:
    """The record saved at `path`, checked: {"messages": [{"role", "content"}, ...], "system", "settings"}."""
    # its schema and calls' arguments are held to MAX_DEPTH where they are used
    record = bounded_json.read_json_file(path, "the chat file", CHAT_FILE_MAX_BYTES,
                                         max_depth=bounded_json.MAX_DEPTH + bounded_json.ENVELOPE_DEPTH)
    _check_record(path, record)
    return record


def _check_record(path: str | Path, record: object) -> None:
    if not isinstance(record, dict) or record.get("format") != CHAT_FORMAT:
        raise InvalidArgumentError(f"{path} is not a saved chat (no \"format\": \"{CHAT_FORMAT}\")")
    messages = record.get("messages")
    if not isinstance(messages, list):
        raise InvalidArgumentError(f"{path}: \"messages\" must be a list")
    for i, m in enumerate(messages):
        problem = _message_problem(m)
        if problem:
            raise InvalidArgumentError(f"{path}: message {i} {problem}")
    system = record.get("system")
    if system is not None and not isinstance(system, str):
        raise InvalidArgumentError(f"{path}: \"system\" must be text or null")
    if not isinstance(record.get("settings", {}), dict):
        raise InvalidArgumentError(f"{path}: \"settings\" must be an object")
    tools = record.get("tools")
    if tools is not None and not (isinstance(tools, dict) and set(tools) <= set(TOOL_KEYS)):
        raise InvalidArgumentError(f"{path}: \"tools\" must be an object with some of {', '.join(TOOL_KEYS)}")


PLAIN_MESSAGE = '{"role": "user"|"assistant", "content": text}'


def _message_problem(m: object) -> str | None:
    """What is wrong with a saved message, or None: a user or assistant turn, an assistant's tool
    calls, or a tool's result."""
    if not isinstance(m, dict):
        return f"must be {PLAIN_MESSAGE}"
    role, content = m.get("role"), m.get("content")
    if role == "tool":
        if not all(isinstance(m.get(k), str) for k in ("tool_call_id", "name", "content")):
            return 'must be {"role": "tool", "tool_call_id": text, "name": text, "content": text}'
        return None
    if role == "assistant" and "tool_calls" in m:
        calls = m["tool_calls"]
        if not (isinstance(calls, list) and calls and all(_is_call(c) for c in calls)):
            return ('has "tool_calls" that are not a list of {"id": text, "type": "function", '
                    '"function": {"name": text, "arguments": object}}')
        return None if content is None or isinstance(content, str) else "must have text or null as content"
    if role not in ROLES[1:] or not isinstance(content, str):
        return f"must be {PLAIN_MESSAGE}"
    if role == "assistant" and not isinstance(m.get("reasoning_content", ""), str):
        return 'has a "reasoning_content" (the answer\'s thought) that is not text'
    return None


def _is_call(call: object) -> bool:
    if not isinstance(call, dict):
        return False
    function = call.get("function")
    return (isinstance(call.get("id"), str) and call.get("type") == "function" and isinstance(function, dict)
            and isinstance(function.get("name"), str) and isinstance(function.get("arguments"), dict))
