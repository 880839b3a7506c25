"""The one reader for JSON that comes from outside: a request body, a schema given as text, tool-call
arguments, a saved chat, a bench result, a config.json. Each is bounded before it is used:

- at most `max_bytes` of text (callers that read files read no more than that, `read_regular_file`);
- values nested at most MAX_DEPTH deep (arrays and objects counted together): deeper nesting is a
  crafted input, never a real schema, chat or config, and past Python's recursion limit it would
  be a RecursionError deep inside whatever walks it next;
- numbers of at most MAX_NUMBER_CHARS characters (a 5,000-digit integer is past what Python
  converts, and a float that long is a crafted one), no NaN or Infinity, which JSON has not, and
  no float past float64's range (`1e999`);

and every way it fails is one JSONInputError naming the source (`what`) and the bound.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path

from lucebox.arguments import path as path_argument
from lucebox.errors import JSONInputError

MAX_DEPTH = 100  # JSON Schemas, chats and configs nest a few levels; 100 leaves room for any of them
# The levels a document wraps a value in that is itself held to MAX_DEPTH (a saved chat's
# messages[i].tool_calls[j].function.arguments: 6; a request's response_format.json_schema.schema: 3),
# so that whatever a field takes, the document holding it takes too
ENVELOPE_DEPTH = 10
MAX_NUMBER_CHARS = 100  # float64 needs 24 characters; an exact decimal expansion of a double ~60


def _number(what: str, convert, nonfinite: bool):
    def checked(text: str):
        if len(text) > MAX_NUMBER_CHARS:
            raise JSONInputError(f"{what}: a number of {len(text)} characters ({text[:20]}...); numbers are "
                                 f"at most {MAX_NUMBER_CHARS} characters long")
        value = convert(text)
        if not nonfinite and not math.isfinite(value):  # 1e999: past float64's range, which JSON cannot mean
            raise JSONInputError(f"{what}: the number {text} is past the range of a float64")
        return value

    return checked


def _no_constant(what: str):
    def refuse(name: str):
        raise JSONInputError(f"{what}: {name} is not JSON; write a number or null")

    return refuse


def _depth_problem(value, max_depth: int = MAX_DEPTH) -> int | None:
    """The first depth past `max_depth` that `value` reaches, or None (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > max_depth:
            return depth
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return None


def loads(text: str | bytes | bytearray, what: str, *, max_bytes: int | None = None, max_depth: int = MAX_DEPTH,
          nonfinite: bool = False, object_pairs_hook=None):
    """The JSON value in `text`, within the bounds above; `what` names it in every error ("the request
    body", "tools[0].function.arguments", "config.json"). `max_depth`: MAX_DEPTH + ENVELOPE_DEPTH for
    a document whose fields are held to MAX_DEPTH on their own. `nonfinite`: take NaN, Infinity and
    1e999 as Python's json does (the model's own files: transformers writes an infinite float so)."""
    if max_bytes is not None and len(text) > max_bytes:
        raise JSONInputError(f"{what} is {len(text)} bytes long; at most {max_bytes} are read")
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode("utf-8-sig")  # a byte order mark may lead (RFC 8259 lets a reader skip it)
        except UnicodeDecodeError as e:
            raise JSONInputError(f"{what} is not UTF-8 text (byte {e.start})") from None
    try:
        value = json.loads(text, parse_int=_number(what, int, nonfinite), parse_float=_number(what, float, nonfinite),
                           parse_constant=float if nonfinite else _no_constant(what),
                           object_pairs_hook=object_pairs_hook)
    except RecursionError:
        raise _too_deep(what, max_depth) from None
    except json.JSONDecodeError as e:
        raise JSONInputError(f"{what} is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})") from None
    except ValueError as e:  # an object_pairs_hook's own refusal (a duplicate key, ...)
        if isinstance(e, JSONInputError):
            raise
        raise JSONInputError(f"{what} is not valid JSON: {str(e)[:200]}") from None
    if _depth_problem(value, max_depth) is not None:
        raise _too_deep(what, max_depth)
    return value


def _too_deep(what: str, max_depth: int = MAX_DEPTH) -> JSONInputError:
    return JSONInputError(f"{what} nests arrays and objects more than {max_depth} deep, the most lucebox reads")


def check_depth(value, what: str) -> None:
    """For a value that arrived already parsed (a dict given to `LLM.generate`, a request field)."""
    if _depth_problem(value) is not None:
        raise _too_deep(what)


def read_regular_file(path: str | os.PathLike, what: str, max_bytes: int) -> bytes:
    """The bytes of the regular file `path`, at most `max_bytes` of them: a FIFO, a device (/dev/zero),
    a folder or a larger file is a JSONInputError naming `what` and the path, found before any read
    that could wait or run unbounded."""
    path_argument(what, path)
    shown = f"{what} {os.fsdecode(path)!r}"
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # before opening: opening a FIFO waits for a writer
            raise JSONInputError(f"{shown} is not a regular file")
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise JSONInputError(f"{shown} does not exist") from None
    except OSError as e:
        raise JSONInputError(f"cannot read {shown}: {e.strerror or e}") from None
    with os.fdopen(fd, "rb") as f:
        opened = os.fstat(fd)  # what was opened: the name may point elsewhere by now
        if not stat.S_ISREG(opened.st_mode):
            raise JSONInputError(f"{shown} is not a regular file")
        if opened.st_size > max_bytes:
            raise _too_large(shown, max_bytes)
        try:
            data = f.read(max_bytes + 1)
        except OSError as e:
            raise JSONInputError(f"cannot read {shown}: {e.strerror or e}") from None
    if len(data) > max_bytes:  # it grew since
        raise _too_large(shown, max_bytes)
    return data


def _too_large(shown: str, max_bytes: int) -> JSONInputError:
    return JSONInputError(f"{shown} is larger than {max_bytes} bytes, the most lucebox reads of it")


def read_json_file(path: str | Path, what: str, max_bytes: int, **options):
    """`read_regular_file` then `loads` (with its keyword `options`)."""
    return loads(read_regular_file(path, what, max_bytes), f"{what} {os.fsdecode(path)!r}", **options)
