"""How big a value a chat template may build, and the one check every step of a render passes.

A template can grow a value without any single large operation (a string or a list added to itself
forty times in a namespace or a recursive macro reaches a terabyte), or in one step whose result is a
product of its inputs' sizes ('a' * n, a long string replaced into every character, a nested list
that shares its parts turned into text). So the sandbox (template_sandbox.py) measures twice, both
times through `refuse_over`:
- after every operation, function call and filter, `checked(result)`: text longer than
  TEMPLATE_MAX_CHARS or a list, tuple or dict of more than TEMPLATE_MAX_ITEMS items is refused
  (a len, so cheap enough for every step);
- before a step whose result multiplies its inputs, an estimate of that result (template_growth.py),
  so that no single step allocates more than a few times a limit. Growth by a constant factor
  (escaping, upper-casing, adding two values below the limit) is left to the check after the step.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, MappingView
from typing import Any, NamedTuple

import jinja2.exceptions

TEMPLATE_MAX_CHARS = 16 * 2**20  # the most characters of any text a template builds, its output included
TEMPLATE_MAX_ITEMS = 2**20  # the most items of a list, tuple or dict it builds (each may be an object)
_CONTAINERS = (list, tuple, set, frozenset, MappingView)


class TemplateSizeError(jinja2.exceptions.SecurityError):
    """A template step would build a value past TEMPLATE_MAX_CHARS or TEMPLATE_MAX_ITEMS."""


def refuse_over(size: int, *, items: bool = False, what: str = "a value") -> None:
    """The one check: a TemplateSizeError when `size` characters (or `items`) pass their limit."""
    limit, unit = (TEMPLATE_MAX_ITEMS, "items") if items else (TEMPLATE_MAX_CHARS, "characters")
    if size > limit:
        raise TemplateSizeError(f"the template builds {what} of {size} {unit} (the limit is {limit} {unit})")


def checked(value: Any) -> Any:
    """`value` once its size is within the limits (the check after every step)."""
    if isinstance(value, (str, bytes)):
        refuse_over(len(value), what="text")
    elif isinstance(value, (list, tuple, dict, set, frozenset)):
        refuse_over(len(value), items=True, what="a list")
    return value


class TextShape(NamedTuple):
    """What str(value) would write, measured without writing it: characters (an upper bound up to
    the quotes and separators of a repr), how many values it holds, and how deeply they nest."""

    chars: int
    values: int
    depth: int


def text_shape(value: Any) -> TextShape:
    """The shape of str(value). A value shared inside a structure counts each time str would write
    it, but is measured once, and a container stops adding once it passes the limit: the cost is at
    most the number of distinct values, however large the structure would print."""
    if isinstance(value, str):
        return TextShape(len(value), 1, 0)  # the common case, without the walk
    return _shape(value, {})


def _shape(value: Any, measured: dict[int, TextShape]) -> TextShape:
    if isinstance(value, str):
        return TextShape(len(value) + 2, 1, 0)  # a repr's quotes
    if isinstance(value, bytes):
        return TextShape(4 * len(value) + 3, 1, 0)  # \xNN for every byte, at worst
    if isinstance(value, int):
        return TextShape(value.bit_length() // 3 + 2, 1, 0)  # at least its decimal digits and sign
    if not isinstance(value, (Mapping, *_CONTAINERS)):
        return TextShape(32, 1, 0)  # a float, None, an Undefined, a macro: a short repr
    if id(value) in measured:  # shared (every value in the structure is alive, so ids are unique)
        return measured[id(value)]
    measured[id(value)] = TextShape(5, 1, 0)  # within itself: str writes a cycle as [...]
    items = list(itertools.chain.from_iterable(value.items())) if isinstance(value, Mapping) else value
    chars, values, depth = 2 + 2 * len(items), 1, 0
    if set(map(type, items)) <= {str}:  # flat text (a list of messages' strings): no walk
        chars += sum(map(len, items)) + 2 * len(items)
        values, depth = 1 + len(items), int(bool(items))
    else:
        for item in items:
            inner = _shape(item, measured)
            chars, values, depth = chars + inner.chars, values + inner.values, max(depth, inner.depth + 1)
            if chars > TEMPLATE_MAX_CHARS:
                break
    measured[id(value)] = TextShape(chars, values, depth)
    return measured[id(value)]


def text_length(value: Any) -> int:
    """Characters of str(value) (an upper bound); exact for text."""
    return len(value) if isinstance(value, (str, bytes)) else text_shape(value).chars
