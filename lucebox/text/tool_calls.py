"""Tool calls in the model's own syntax: which syntax a chat template teaches, and the calls read
back out of what the model wrote.

Three syntaxes, named as `lucebox serve --tool-parser` takes them:
- "hermes" (Hermes, Qwen 2.5/3, many fine-tunes): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  one block per call;
- "llama3" (Llama 3.1-3.3 JSON tool calling): `{"name": ..., "parameters": {...}}`, the whole answer,
  optionally after `<|python_tag|>`, several calls separated by `;`;
- "mistral": `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the newer
  `[TOOL_CALLS]name[ARGS]{...}` (repeated for parallel calls);
- "qwen3_coder" (Qwen3-Coder, Qwen3.5/3.6): `<tool_call>\n<function=name>\n<parameter=key>\nvalue\n</parameter>\n
  </function>\n</tool_call>`, one block per call (`text.xml_calls`);
- "json", the generic syntax for a model whose template teaches none (`text.json_calls`): the whole
  answer is `{"tool_calls": [{"name": ..., "arguments": {...}}, ...]}` or `{"content": "..."}`.

Output that does not parse as calls in the chosen syntax (broken JSON, a missing name, arguments
that are not an object) comes back whole as text: a malformed call is the model's text, never a
server error. An answer cut short (max_tokens, or a model repeating a call) keeps the calls it wrote
whole (`complete_calls`). The text given here is decoded with special tokens kept
(`[TOOL_CALLS]` and `<|python_tag|>` are special tokens that plain decoding drops).
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass

from lucebox import bounded_json
from lucebox.text.json_calls import CALLS_HEAD, parse_json_answer
from lucebox.text.xml_calls import xml_calls, xml_calls_prefix

FORMATS = ("hermes", "llama3", "mistral", "qwen3_coder", "json")
_DECODER = json.JSONDecoder()
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI's API carries it
    id: str


@dataclass(frozen=True)
class ParsedOutput:
    content: str  # the text beside the calls (text before the first call first), or all of it when none parsed
    calls: tuple[ToolCall, ...]


def detect_format(template: str | None) -> str | None:
    """The tool-call syntax a chat template writes (from the markers it renders), or None."""
    if not template:
        return None
    if "<tool_call>" in template:  # its blocks hold JSON, or Qwen3-Coder's and Qwen3.5's XML-like tags
        return "qwen3_coder" if "<function=" in template and "<parameter=" in template else "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    return None


def call_markers(fmt: str) -> tuple[str, ...]:
    """Text that starts a call in `fmt`: streamed content stops where one may begin. Llama 3's bare
    JSON call starts with "{", which only counts at the start of the answer (`starts_at_beginning`)."""
    return {"hermes": ("<tool_call>",), "llama3": ("<|python_tag|>", "{"), "mistral": ("[TOOL_CALLS]",),
            "qwen3_coder": ("<tool_call>",), "json": ("{",)}[fmt]


def starts_at_beginning(fmt: str, marker: str) -> bool:
    return fmt in ("llama3", "json") and marker == "{"


def new_call_id(fmt: str) -> str:
    """A call id; Mistral's templates refuse any id that is not 9 letters or digits."""
    if fmt == "mistral":
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return "call_" + secrets.token_hex(12)


def parse_tool_calls(text: str, fmt: str, strings: dict | None = None) -> ParsedOutput:
    """The calls in `text` (written in syntax `fmt`) and the text beside them; no call, or a malformed
    one: all of `text` as content. `strings`: each function's string parameters (`xml_calls`)."""
    try:
        found = xml_calls(text, strings) if fmt == "qwen3_coder" else {
            "hermes": _hermes, "llama3": _llama3, "mistral": _mistral, "json": _json}[fmt](text)
        if found:
            return _parsed(*found, fmt)
    except (ValueError, TypeError, KeyError, RecursionError):  # json's, UTF-8's and bounded_json's are ValueErrors
        pass
    return ParsedOutput(text, ())


def complete_calls(text: str, fmt: str, strings: dict | None = None) -> ParsedOutput:
    """The calls of an answer cut short, as far as they were written whole (the first one cut, or
    malformed, and all after it are dropped), and the text before them; none: all of `text`."""
    try:
        content, pairs = xml_calls_prefix(text, strings) if fmt == "qwen3_coder" else {
            "hermes": _hermes_prefix, "llama3": _llama3_prefix, "mistral": _mistral_prefix,
            "json": _json_prefix}[fmt](text)
        while pairs:
            try:
                return _parsed(content, pairs, fmt)
            except (ValueError, TypeError, KeyError, RecursionError):
                pairs = pairs[:-1]  # only the last can be the one a reader refuses: checked one by one
    except (ValueError, TypeError, KeyError, RecursionError):
        pass
    return ParsedOutput(text, ())


def first_repeat(calls: tuple[ToolCall, ...]) -> int | None:
    """Where a call repeats one before it (same name, same arguments): a model looping on its calls."""
    seen = set()
    for i, call in enumerate(calls):
        key = (call.name, json.dumps(json.loads(call.arguments), sort_keys=True))
        if key in seen:
            return i
        seen.add(key)
    return None


def _parsed(content: str, pairs: list, fmt: str) -> ParsedOutput:
    """The output of (content, [(name, arguments)]); a ValueError when a call's arguments are not ones
    OpenAI's readers take back."""
    arguments = [json.dumps(args, ensure_ascii=False) for _, args in pairs]
    for text_of_call in arguments:  # a lone surrogate escape ("\ud800") decodes to text UTF-8 cannot
        text_of_call.encode("utf-8")  # write (no answer or saved chat could carry it): malformed
        # and what a reader of the answer refuses (NaN, 1e999, a 200-digit number, nesting past
        # the bounds) is malformed here too, so a call lucebox returns always reads back
        bounded_json.loads(text_of_call, "a call's arguments")
    calls = tuple(ToolCall(name, args, new_call_id(fmt)) for (name, _), args in zip(pairs, arguments, strict=True))
    return ParsedOutput(content, calls)


def _call(obj, arguments_key: str) -> tuple[str, dict]:
    """(name, arguments) of one decoded call; a ValueError when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        raise ValueError("a call needs a name")
    args = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text, as OpenAI's API carries them
        args = bounded_json.loads(args, "a call's arguments")
    if not isinstance(args, dict):
        raise ValueError("a call's arguments must be an object")
    return obj["name"], args


def _whole_json(text: str):
    """`text` as one JSON value, nothing after it but whitespace."""
    value, end = _DECODER.raw_decode(text)
    if text[end:].strip():
        raise ValueError("text after the call")
    return value


def _json(text: str):
    found = parse_json_answer(text)
    if found is None:
        return None
    content, calls = found
    return content, [_call(c, "arguments") for c in calls]


def _successive(body: str, at: int, separator: str) -> list[tuple[str, dict]]:
    """The calls written whole from `body[at:]`: JSON objects separated by `separator`, up to the first
    one cut short or malformed."""
    pairs = []
    while True:
        at = len(body) - len(body[at:].lstrip())
        try:
            obj, end = _DECODER.raw_decode(body, at)
            pairs.append(_call(obj, "arguments" if separator == "," else "parameters"))
        except ValueError:
            return pairs
        rest = body[end:].lstrip()
        if not rest.startswith(separator):
            return pairs
        at = len(body) - len(rest) + 1


def _hermes_prefix(text: str):
    pairs = []
    for block in re.finditer(r"<tool_call>(.*?)</tool_call>", text, re.DOTALL):
        try:
            pairs.append(_call(_whole_json(block.group(1).strip()), "arguments"))
        except ValueError:
            break
    return text.split("<tool_call>", 1)[0], pairs


def _llama3_prefix(text: str):
    content, tag, body = text.partition("<|python_tag|>")
    if not tag:
        content, body = "", text
    return (content, _successive(body, 0, ";")) if body.strip().startswith("{") else (text, [])


def _mistral_prefix(text: str):
    content, _, body = text.partition("[TOOL_CALLS]")
    body = body.strip()
    if body.startswith("["):
        return content, _successive(body, 1, ",")
    pairs = []
    for part in body.split("[TOOL_CALLS]"):
        name, _, args = part.partition("[ARGS]")
        try:
            obj, _ = _DECODER.raw_decode(args.strip())
            pairs.append(_call({"name": name.strip(), "arguments": obj}, "arguments"))
        except ValueError:
            break
    return content, pairs


def _json_prefix(text: str):
    body = text.strip()
    return ("", _successive(body, len(CALLS_HEAD), ",")) if body.startswith(CALLS_HEAD) else (text, [])


def _hermes(text: str):
    blocks = list(_HERMES_BLOCK.finditer(text))
    if not blocks:
        return None
    pairs = [_call(_whole_json(b.group(1).strip()), "arguments") for b in blocks]
    return _HERMES_BLOCK.sub("", text), pairs


def _llama3(text: str):
    content, tag, body = text.partition("<|python_tag|>")
    if not tag:
        content, body = "", text
    body = body.strip()
    if not body.startswith("{"):
        return None
    pairs, at = [], 0
    while True:
        obj, end = _DECODER.raw_decode(body, at)
        pairs.append(_call(obj, "parameters"))
        rest = body[end:].lstrip()
        if not rest:
            return content, pairs
        if not rest.startswith(";"):
            raise ValueError("calls are separated by ';'")
        at = len(body) - len(rest[1:].lstrip())


def _mistral(text: str):
    content, tag, body = text.partition("[TOOL_CALLS]")
    if not tag:
        return None
    body = body.strip()
    if body.startswith("["):  # [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]
        calls = _whole_json(body)
        if not isinstance(calls, list) or not calls:
            raise ValueError("[TOOL_CALLS] takes a list of calls")
        return content, [_call(c, "arguments") for c in calls]
    pairs = []  # [TOOL_CALLS]name[ARGS]{...}[TOOL_CALLS]name[ARGS]{...}
    for part in body.split("[TOOL_CALLS]"):
        name, args_tag, args = part.partition("[ARGS]")
        if not args_tag:
            raise ValueError("a call needs [ARGS]")
        pairs.append(_call({"name": name.strip(), "arguments": _whole_json(args.strip())}, "arguments"))
    return content, pairs
