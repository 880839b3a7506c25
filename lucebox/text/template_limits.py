"""How big a value a chat template may build, and the one check every step of a render passes.

A template can grow a value without any single large operation (a string or a list added to itself
forty times in a namespace or a recursive macro reaches a terabyte), or in one step whose result is a
product of its inputs' sizes ('a' * n, a long string replaced into every character, a nested list
that shares its parts turned into text). So the sandbox (template_sandbox.py) measures twice, both
times through `refuse_over`:
- after every operation, function call and filter, and for every list, tuple or dict a template writes
  out, `checked(result)`: text longer than TEMPLATE_MAX_CHARS, a number of more than TEMPLATE_MAX_BITS
  bits, or a list, tuple or dict past TEMPLATE_MAX_ITEMS items or TEMPLATE_MAX_CHARS characters written
  out, counting what it nests at every depth and a shared part each time it appears (`[[row] * 100] * 100`
  holds row 10000 times), as `==` and str() walk it: the render's timer cannot stop one built-in
  operation, so none may walk more than the limits;
- before a step whose result multiplies its inputs, an estimate of that result (template_growth.py),
  so that no single step allocates more than a few times a limit. Growth by a constant factor
  (escaping, upper-casing, adding two values below the limit) is left to the check after the step.
Besides, all the text one render writes (its output, and what macros, call blocks and set blocks
collect) counts in one running total (`WrittenText`), bounded by TEMPLATE_MAX_CHARS as it grows.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping, MappingView
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, NamedTuple

import jinja2.exceptions

TEMPLATE_MAX_CHARS = 16 * 2**20  # the most characters of any text a template builds, its output included
TEMPLATE_MAX_ITEMS = 2**20  # the most items of a list, tuple or dict it builds (each may be an object)
TEMPLATE_MAX_BITS = 2**20  # the largest number it computes (multiplying two takes milliseconds)
_CONTAINERS = (list, tuple, set, frozenset, MappingView)


class TemplateSizeError(jinja2.exceptions.SecurityError):
    """A template step would build a value past TEMPLATE_MAX_CHARS or TEMPLATE_MAX_ITEMS."""


def refuse_over(size: int, *, items: bool = False, what: str = "a value") -> None:
    """The one check: a TemplateSizeError when `size` characters (or `items`) pass their limit."""
    limit, unit = (TEMPLATE_MAX_ITEMS, "items") if items else (TEMPLATE_MAX_CHARS, "characters")
    if size > limit:
        raise TemplateSizeError(f"the template builds {what} of {_shown(size)} {unit} (the limit is {limit} {unit})")


def refuse_number_over(bits: int) -> None:
    """A TemplateSizeError when a number of `bits` bits is past TEMPLATE_MAX_BITS."""
    if bits > TEMPLATE_MAX_BITS:
        raise TemplateSizeError(f"the template computes a number of {_shown(bits)} bits "
                                f"(the limit is {TEMPLATE_MAX_BITS} bits)")


def _shown(size: int) -> str:
    # an estimate can be a number too long for str() (Python refuses more than 4300 digits)
    return str(size) if size.bit_length() < 64 else f"about 2**{size.bit_length() - 1}"


def checked(value: Any) -> Any:
    """`value` once its size is within the limits (the check after every step): a len for text, and
    a walk over the distinct parts of a list, tuple or dict (module docstring)."""
    if isinstance(value, (str, bytes)):
        refuse_over(len(value), what="text")
    elif isinstance(value, int):
        refuse_number_over(value.bit_length())
    elif isinstance(value, (list, tuple, dict, set, frozenset)):
        refuse_over(len(value), items=True, what="a list")
        shape = text_shape(value)
        refuse_over(shape.values, items=True, what="a list (counting what it nests, at every depth)")
        refuse_over(shape.chars, what="a list (as text)")
    return value


class _RunningTotal:
    """The characters one render has written so far."""

    def __init__(self) -> None:
        self.chars = 0


_RENDER_TOTAL: ContextVar[_RunningTotal] = ContextVar("template_render_total")


@contextmanager
def counting_written_text() -> Iterator[None]:
    """Within it, one render: every WrittenText made adds to the same running total."""
    token = _RENDER_TOTAL.set(_RunningTotal())
    try:
        yield
    finally:
        _RENDER_TOTAL.reset(token)


class WrittenText(list):
    """Pieces of text a render writes (its output, or what a macro, call block or set block
    collects before joining it), each counted as it comes in the render's running total. Text a
    macro returns and the template writes again counts twice, as memory holds it twice; an empty
    piece counts one character, as it takes a place in the list."""

    def __init__(self) -> None:
        super().__init__()
        self.total = _RENDER_TOTAL.get()  # a LookupError outside counting_written_text()

    def append(self, piece: str) -> None:
        self.total.chars += max(len(piece), 1)
        refuse_over(self.total.chars, what="text in all (output, macros and blocks together)")
        super().append(piece)

    def extend(self, pieces: Iterable[str]) -> None:
        for piece in pieces:  # one at a time: `pieces` may be a render's output, as it comes
            self.append(piece)


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
    flat = _flat_chars(items)
    if flat is not None:
        chars, values, depth = chars + flat, 1 + len(items), int(bool(items))
    else:
        for item in items:
            inner = _shape(item, measured)
            chars, values, depth = chars + inner.chars, values + inner.values, max(depth, inner.depth + 1)
            if chars > TEMPLATE_MAX_CHARS:
                break
    measured[id(value)] = TextShape(chars, values, depth)
    return measured[id(value)]


def _flat_chars(items: Any) -> int | None:
    """The characters of only text or only numbers in a repr (a list of messages' strings, a range
    made a list), measured without a walk; None for items of any other kinds."""
    kinds = set(map(type, items))
    if kinds <= {str}:
        return sum(map(len, items)) + 2 * len(items)  # with the quotes
    if kinds <= {int, bool}:
        return sum(map(int.bit_length, items)) // 3 + 2 * len(items)  # at least the digits and signs
    return None


def text_length(value: Any) -> int:
    """Characters of str(value) (an upper bound); exact for text."""
    return len(value) if isinstance(value, (str, bytes)) else text_shape(value).chars
