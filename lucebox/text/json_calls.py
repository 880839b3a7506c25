"""The generic tool-call syntax ("json"), for a model whose chat template teaches none: the whole
answer is one JSON object, either the calls or the answer,

    {"tool_calls": [{"name": ..., "arguments": {...}}, ...]}
    {"content": "the answer's text"}

which the grammar forces (`constrained.tool_grammar`), so any model writes it. The answer's text
streams as its JSON string is written (`answer_text`: the characters decoded so far)."""

from __future__ import annotations

import json

CALLS_HEAD = '{"tool_calls": ['
ANSWER_HEAD = '{"content": '
_DECODER = json.JSONDecoder()


def parse_json_answer(text: str):
    """(content, [(name, arguments)]) of a generic answer, or None when `text` is not one. An answer
    cut short inside its text (max_tokens) gives the text written so far."""
    body = text.strip()
    if body.startswith(ANSWER_HEAD):
        whole = _whole(body)
        if isinstance(whole, dict) and set(whole) == {"content"} and isinstance(whole["content"], str):
            return whole["content"], []
        partial = answer_text(body)
        return (partial, []) if partial is not None else None
    whole = _whole(body)
    if not isinstance(whole, dict) or set(whole) != {"tool_calls"} or not isinstance(whole["tool_calls"], list) \
            or not whole["tool_calls"]:
        return None
    return "", whole["tool_calls"]


def answer_text(text: str) -> str | None:
    """The answer's text decoded so far, when `text` (stripped of leading whitespace) is the start of
    `{"content": "...`; None when it is not (yet) known to be an answer."""
    body = text.lstrip()
    head = ANSWER_HEAD + '"'
    if not body.startswith(head):
        return None
    return string_prefix(body[len(head):])


def is_calls(text: str) -> bool:
    """Has the answer started the calls' object (or anything that is not the answer's)?"""
    body = text.lstrip()
    n = min(len(body), len(ANSWER_HEAD) + 1)
    return bool(body) and not (ANSWER_HEAD + '"').startswith(body[:n])


def string_prefix(escaped: str) -> str:
    """The characters of a JSON string's body (the text after its opening quote) whose escapes are
    complete, up to its closing quote: an escape cut in two, or a surrogate pair's first half, waits."""
    return decode_from(escaped, 0)[0]


def decode_from(text: str, at: int) -> tuple[str, int]:
    """(the characters of a JSON string's body from `text[at:]` whose escapes are complete, where they
    end): a stream decodes each new piece once, from where the last one ended."""
    i, end, n = at, at, len(text)
    while i < n:
        c = text[i]
        if c == '"':
            break
        if c != "\\":
            i += 1
        elif i + 1 >= n:
            break
        elif text[i + 1] != "u":
            i += 2
        elif i + 6 > n:
            break
        elif 0xD800 <= _hex(text[i + 2:i + 6]) < 0xDC00:  # a high surrogate: its low half must follow
            if i + 12 > n:
                break
            i += 12
        else:
            i += 6
        end = i
    try:
        return json.loads('"' + text[at:end] + '"'), end
    except ValueError:  # not JSON's escapes (never under the grammar): nothing decodable yet
        return "", at


def _hex(digits: str) -> int:
    try:
        return int(digits, 16)
    except ValueError:
        return -1


def _whole(body: str):
    try:
        value, end = _DECODER.raw_decode(body)
    except ValueError:
        return None
    return value if not body[end:].strip() else None
