"""Qwen3-Coder's and Qwen3.5/3.6's tool-call syntax ("qwen3_coder", as vLLM names its parser): each
call a block of XML-like tags, one parameter each,

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A parameter's value is its text between the newline after `<parameter=...>` and the one before
`</parameter>`: the text itself for a parameter its tool's schema makes a string (`strings`: the
names of those, by function), else JSON when it reads as a number, true/false/null, an object or a
list, else the text (the templates write strings bare and everything else as JSON).
"""

from __future__ import annotations

import re

from lucebox import bounded_json

MARKER = "<tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def xml_calls(text: str, strings: dict | None = None):
    """(content, [(name, arguments)]) of an answer's calls, the text beside them as content; None
    when it has none; a ValueError when a `<tool_call>` block is not a call (the answer is then text).
    `strings`: {function name: the names of its string parameters}, whose text is kept as it is."""
    if MARKER not in text:
        return None
    pairs = [_call(block, strings or {}) for block in _BLOCK.finditer(text)]
    content = _BLOCK.sub("", text)
    if MARKER in content:
        raise ValueError("a <tool_call> block is not a call")
    return content, pairs


def xml_calls_prefix(text: str, strings: dict | None = None):
    """(the text before the first call, the calls written whole from there): an answer cut short
    keeps the calls before the first block that is cut or malformed. `strings`: as `xml_calls`."""
    content, marker, _ = text.partition(MARKER)
    pairs, at = [], len(content)
    for block in _BLOCK.finditer(text, at) if marker else ():
        if text[at : block.start()].strip():
            break  # something other than whitespace before it: a block that is not a call
        try:
            pairs.append(_call(block, strings or {}))
        except ValueError:
            break
        at = block.end()
    return content, pairs


def _call(block: re.Match, strings: dict) -> tuple[str, dict]:
    name = block.group(1).strip()
    return name, _arguments(block.group(2), strings.get(name, ()))


def _arguments(body: str, strings) -> dict:
    arguments = {}
    for parameter in _PARAMETER.finditer(body):
        name = parameter.group(1).strip()
        if not name or name in arguments:
            raise ValueError("a parameter needs a name, once")
        arguments[name] = parameter.group(2) if name in strings else _value(parameter.group(2))
    if _PARAMETER.sub("", body).strip():
        raise ValueError("text inside a call outside its parameters")
    return arguments


def _value(text: str):
    """JSON where the text reads as a JSON value other than a string, else the text itself."""
    try:
        value = bounded_json.loads(text.strip(), "a call's parameter")
    except ValueError:
        return text
    return text if isinstance(value, str) else value


def string_parameters(functions: list[dict]) -> dict[str, frozenset[str]]:
    """{name: its string parameters} of OpenAI-style function definitions: a property whose schema
    says "type": "string", or lists string values alone as its enum."""
    out = {}
    for f in functions:
        schema = f.get("parameters") if isinstance(f.get("parameters"), dict) else {}
        properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        out[f.get("name")] = frozenset(key for key, sub in properties.items() if isinstance(sub, dict) and (
            sub.get("type") == "string" or isinstance(sub.get("enum"), list) and sub["enum"]
            and all(isinstance(v, str) for v in sub["enum"])))
    return out
