"""Estimates, made before a template step runs, of results that multiply their inputs' sizes: an
operator, a filter, a method of a string, a global. Each ends in `template_limits.refuse_over`; the
module docstring there gives the whole scheme. Estimates are upper bounds, tight where a chat
template can meet them (a message's text formatted, replaced, joined, turned into JSON)."""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterator, Mapping, Sized
from typing import Any

from jinja2.filters import make_attrgetter
from jinja2.utils import generate_lorem_ipsum

from lucebox.text.template_limits import (
    TEMPLATE_MAX_BITS,
    TemplateSizeError,
    refuse_number_over,
    refuse_over,
    text_length,
    text_shape,
)

# A field width or precision of 10000 or more, or one taken from an argument ('%*d', '{:{}}')
_WIDE_FORMAT = re.compile(r"%[-#0 +]*(\*|\d{5,})|%[-#0 +]*\d*\.(\*|\d{5,})|\{[^}]*\d{5,}")
_NESTED_FIELD = re.compile(r"\{[^{}]*\{")
# Filters that write their value as text: the value's text is measured first (a nested list that
# shares its parts prints far larger than it is).
_WRITES_TEXT = frozenset(["string", "e", "escape", "forceescape", "safe", "xmlattr", "urlencode", "upper",
                          "lower", "title", "capitalize", "trim", "striptags", "wordcount", "replace", "center",
                          "indent", "wordwrap", "urlize", "truncate", "format", "tojson", "pprint", "join",
                          "filesizeformat"])
_LOREM = inspect.signature(generate_lorem_ipsum)
_READS_ONCE = frozenset(["join", "sum"])  # filters that consume an iterator: read it into a list to measure it


def check_int_arguments(args: tuple, kwargs: dict) -> None:
    """No width, count or repeat argument beyond the text limit ('x'.ljust(10**9), center(10**9))."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool):
            refuse_over(abs(value), what="an argument")


def binop_growth(operator: str, left: Any, right: Any) -> None:
    if operator == "*":
        for seq, times in ((left, right), (right, left)):
            if isinstance(seq, (str, bytes, list, tuple)) and isinstance(times, int):
                refuse_over(len(seq) * times, items=not isinstance(seq, (str, bytes)), what="a repeat")
    elif operator == "+" and isinstance(left, Sized) and isinstance(right, Sized):
        refuse_over(len(left) + len(right), items=not isinstance(left, (str, bytes)), what="a sum")
    elif operator == "**" and isinstance(left, int) and isinstance(right, int):
        # a number of b bits to the power n has about b * n bits (n clamped: only the verdict matters)
        refuse_number_over(max(abs(left).bit_length(), 1) * min(abs(right), TEMPLATE_MAX_BITS + 1))
    elif operator == "%" and isinstance(left, str):
        format_growth(left, right if isinstance(right, (tuple, Mapping)) else (right,), "%")


def format_growth(fmt: str, values: tuple | Mapping, marker: str) -> None:
    """`fmt % values` or `fmt.format(*values)`: each field (`marker`) writes at most the longest value."""
    if _WIDE_FORMAT.search(fmt):
        raise TemplateSizeError("the template formats with a field width of 10000 or more")
    values = list(values.values() if isinstance(values, Mapping) else values)
    longest = max((text_length(v) for v in values), default=0)
    if marker == "{" and _NESTED_FIELD.search(fmt):  # '{:{}}': a width comes from an argument
        longest += max((v for v in values if isinstance(v, int)), default=0)
    refuse_over(len(fmt) + fmt.count(marker) * longest, what="formatted text")


def _replaced(text: Any, old: Any, new: Any, count: Any) -> None:
    length = text_length(text)
    hits = text.count(old) if isinstance(text, type(old)) and old else length + 1
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    refuse_over(length + hits * text_length(new), what="replaced text")


def _lines(text: Any) -> int:
    return text.count("\n") + 1 if isinstance(text, str) else text_length(text) + 1


def _size_argument(value: Any, default: int) -> int:
    """A width given as a number or as text (indent's width may be either)."""
    if value is None:
        return default
    return value if isinstance(value, int) else text_length(value)


def _indent_growth(text: Any, arguments: dict) -> None:
    refuse_over(text_length(text) + _lines(text) * _size_argument(arguments.get("width"), 4), what="indented text")


def _wrap_growth(text: Any, arguments: dict) -> None:
    breaks = text_length(text) // max(_size_argument(arguments.get("width"), 79), 1) + _lines(text)
    refuse_over(text_length(text) + breaks * text_length(arguments.get("wrapstring") or "\n"), what="wrapped text")


def _urlize_growth(text: Any, arguments: dict) -> None:
    # each word may be a link, and each link gets the target and rel attributes
    words = sum(text.count(c) for c in " \n\t") + 1 if isinstance(text, str) else text_length(text) + 1
    attributes = text_length(arguments.get("target") or "") + text_length(arguments.get("rel") or "")
    refuse_over(text_length(text) + words * attributes, what="linked text")


def _json_growth(value: Any, arguments: dict) -> None:
    shape = text_shape(value)
    between = text_length(arguments["separators"]) if arguments.get("separators") is not None else 2
    line = _size_argument(arguments.get("indent"), 0) * shape.depth + between
    refuse_over(shape.chars + shape.values * line, what="JSON")


def _pprint_growth(value: Any, arguments: dict) -> None:
    shape = text_shape(value)
    refuse_over(shape.chars + shape.values * (shape.depth + 2), what="text")


def _sum_growth(items: Any, arguments: dict) -> None:
    """sum() adds one item at a time and each addition copies the sum so far: adding up lists takes
    the square of the result's length, and a large number added to many small ones its size each
    time. Estimated as the sizes of all the partial sums, in items of a list or tuple and in digits
    (of 30 bits, past the first: adding machine-sized numbers costs one step) of a number."""
    start = arguments.get("start", 0)
    if arguments.get("attribute") is not None:
        items = map(make_attrgetter(arguments["environment"], arguments["attribute"]), items)
    grows = isinstance(start, (list, tuple))  # else a number: the sum is as large as its largest part
    partial = work = _addend_size(start)
    for item in items:
        partial = partial + _addend_size(item) if grows else max(partial, _addend_size(item))
        work += partial
    refuse_over(work, items=True, what="a sum (counting the partial sums each addition copies)")


def _addend_size(value: Any) -> int:
    if isinstance(value, (list, tuple)):
        return len(value)
    return value.bit_length() // 30 if isinstance(value, int) else 0


def _count_growth(value: Any, count: Any) -> None:
    if isinstance(count, int):
        refuse_over((len(value) if isinstance(value, Sized) else 0) + count, items=True, what="a list")


# filter name -> estimate(value, the filter's arguments by name)
_FILTERS = {
    "replace": lambda s, a: _replaced(s, a["old"], a["new"], a.get("count")),
    "join": lambda s, a: refuse_over(text_length(s) + len(s) * text_length(a.get("d", "")), what="joined text"),
    "indent": _indent_growth,
    "wordwrap": _wrap_growth,
    "urlize": _urlize_growth,
    "format": lambda s, a: format_growth(str(s), a.get("kwargs") or a.get("args", ()), "%"),
    "tojson": _json_growth,
    "pprint": _pprint_growth,
    "sum": _sum_growth,
    "batch": lambda s, a: _count_growth(s, a["linecount"]),
    "slice": lambda s, a: _count_growth(s, a["slices"]),
}


def filter_growth(name: str, value_name: str, arguments: dict) -> None:
    """Before the filter `name` runs on its arguments by name (`arguments[value_name]`, the value it
    filters). An iterator that the filter consumes is read into a list here, in `arguments`, to measure it."""
    value = arguments[value_name]
    if name in _READS_ONCE and isinstance(value, Iterator):
        arguments[value_name] = value = list(value)
    if name in _WRITES_TEXT:
        refuse_over(text_length(value), what="text")
    if name in _FILTERS:
        _FILTERS[name](value, arguments)


# method of a string (or bytes) -> estimate(the string, the call's arguments)
_TEXT_METHODS = {
    "replace": lambda s, old, new, count=-1: _replaced(s, old, new, count),
    "join": lambda s, items: refuse_over(text_length(items) + len(items) * len(s), what="joined text"),
    "expandtabs": lambda s, tabsize=8: refuse_over(len(s) + s.count(type(s)("\t")) * max(tabsize, 0)),
    "translate": lambda s, table: refuse_over(len(s) * max([1, *(
        text_length(v) for v in table.values() if v is not None)] if isinstance(table, Mapping) else [1])),
    "format": lambda s, *args, **kwargs: format_growth(s, (*args, *kwargs.values()), "{"),
    "format_map": lambda s, mapping: format_growth(s, mapping, "{"),
}


def call_growth(func: Any, args: tuple, kwargs: dict) -> tuple:
    """Before a call from a template: its integer arguments, a method of text whose result multiplies
    its inputs, lipsum. Returns the arguments to call with: an iterator that str.join consumes is read
    into a list here to measure it."""
    check_int_arguments(args, kwargs)
    method = getattr(func, "__wrapped__", func)  # the sandbox wraps str.format in a function of its own
    receiver, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
    if isinstance(receiver, (str, bytes)) and name in _TEXT_METHODS:
        if name == "join" and args and isinstance(args[0], Iterator):
            args = (list(args[0]), *args[1:])
        _TEXT_METHODS[name](receiver, *args, **kwargs)
    elif method is generate_lorem_ipsum:  # n paragraphs of up to `max` words each
        lorem = _LOREM.bind(*args, **kwargs)
        lorem.apply_defaults()
        paragraphs, words = lorem.arguments["n"], lorem.arguments["max"]
        if isinstance(paragraphs, int) and isinstance(words, int):
            refuse_over(paragraphs * words * 16, what="lorem ipsum")
    return args

