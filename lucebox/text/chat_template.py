"""Chat templates: where a model folder keeps them, and rendering them safely.

A chat template comes from a stranger's model folder: it renders in transformers' jinja2 setup (so
prompts come out the same as there) inside a sandbox (no attribute escapes), within a time limit and
an output size, and no single operation may build a value larger than the output could hold
('a' * 10**10, 10 ** 10 ** 10, '%999999999d' % 1).
"""

from __future__ import annotations

import ctypes
import functools
import json
import re
import threading
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox

from lucebox.errors import TokenizerError

TEMPLATE_SECONDS = 5.0
TEMPLATE_MAX_CHARS = 16 * 2**20


class _TemplateTimeout(Exception):
    """Raised inside a rendering thread whose template ran past TEMPLATE_SECONDS."""


def _too_big(size: int) -> None:
    if size > TEMPLATE_MAX_CHARS:
        raise jinja2.exceptions.SecurityError(f"the template builds a value of {size} items "
                                              f"(the limit is {TEMPLATE_MAX_CHARS})")


_WIDE_FORMAT = re.compile(r"%[-#0 +]*(\*|\d{5,})|%[-#0 +]*\d*\.(\*|\d{5,})|\{[^}]*\d{5,}")


class _BoundedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["*", "**", "%"])

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int):
                    _too_big(len(seq) * times)
        elif (operator == "**" and isinstance(left, int) and isinstance(right, int)
              and max(abs(left).bit_length(), 1) * abs(right) > 2**20):
            raise jinja2.exceptions.SecurityError("the template computes a number of more than 2**20 bits")
        elif operator == "%" and isinstance(left, str) and _WIDE_FORMAT.search(left):
            raise jinja2.exceptions.SecurityError("the template formats with a field width of 10000 or more")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's signature)
        _check_sizes(args, kwargs)  # 'x'.ljust(10**9), 'x'.zfill(10**9), range(...) is already bounded
        return super().call(__context, __obj, *args, **kwargs)


def _check_sizes(args: tuple, kwargs: dict) -> None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool):
            _too_big(abs(value))


def _bounded_filter(f):
    """A filter that refuses integer arguments beyond the output limit (center(10**9), indent(10**9))."""
    @functools.wraps(f)  # keeps jinja's pass_context/pass_eval_context marks
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _check_sizes(args[1:], kwargs)
        return f(*args, **kwargs)

    return bounded


def _format(value: Any, *args: Any, **kwargs: Any) -> str:
    if _WIDE_FORMAT.search(str(value)):
        raise jinja2.exceptions.SecurityError("the template formats with a field width of 10000 or more")
    return str(value) % (kwargs or args)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


# The same environment transformers builds: templates come from the Hub, hence the sandbox.
_JINJA = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
_JINJA.filters["format"] = _format
_JINJA.filters.update({name: _bounded_filter(f) for name, f in _JINJA.filters.items()})
# jinja's own tojson HTML-escapes <, >, & and '; templates expect plain JSON, as transformers gives them
_JINJA.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: (
    json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys))
_JINJA.globals["raise_exception"] = _raise_exception
_JINJA.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)


def folder_chat_templates(folder: Path, tok_config: dict) -> tuple[dict[str, str], Path]:
    """A model folder's chat templates by name ("default", "tool_use", ...) and the file they came from:
    chat_template.jinja when present, else tokenizer_config.json's chat_template (one string, or a list of
    {"name", "template"})."""
    templates, source, jinja_file = {}, folder / "tokenizer_config.json", folder / "chat_template.jinja"
    if jinja_file.is_file():
        source = jinja_file
        try:
            templates["default"] = jinja_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise TokenizerError(f"{jinja_file} cannot be read ({e})") from e
    elif isinstance(tok_config.get("chat_template"), str):
        templates["default"] = tok_config["chat_template"]
    elif isinstance(tok_config.get("chat_template"), list):
        templates = {t["name"]: t["template"] for t in tok_config["chat_template"]
                     if isinstance(t, dict) and isinstance(t.get("template"), str)}
    return templates, source


class ChatTemplates:
    """A model's named chat templates, compiled on first use; every failure of a render, whether the
    template's own error, a limit or a plain Python error, is a TokenizerError naming `source`."""

    def __init__(self, templates: dict[str, str], source: str) -> None:
        self._templates, self._source, self._compiled = templates, source, {}

    def __contains__(self, name: str) -> bool:
        return name in self._templates

    def render(self, name: str, messages: list[dict], variables: dict) -> str:
        """The template `name` (one this holds) rendered with `variables` and the `messages` of a chat."""
        try:
            if name not in self._compiled:
                self._compiled[name] = _JINJA.from_string(self._templates[name])
            return _render_bounded(self._compiled[name], {**variables, "messages": _as_transformers_does(messages)})
        except jinja2.exceptions.TemplateError as e:
            raise TokenizerError(f"chat template from {self._source}: {e}") from e
        except _TemplateTimeout:
            raise TokenizerError(f"chat template from {self._source} ran longer than {TEMPLATE_SECONDS} s; "
                                 "the template is broken or hostile: fix or replace it") from None
        except (TypeError, ValueError, LookupError, ArithmeticError, AttributeError, MemoryError,
                RecursionError) as e:
            # templates can fail in plain Python ways too (a number added to a string, a huge range)
            raise TokenizerError(f"chat template from {self._source} failed: "
                                 f"{type(e).__name__}: {str(e)[:200]}") from None


def _as_transformers_does(messages: list[dict]) -> list[dict]:
    # like transformers: None-valued keys are dropped (templates print "None" or crash on them)
    # and reasoning is visible under every name templates read it by
    chat = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        r = next((m[k] for k in ("reasoning_content", "thinking", "reasoning") if k in m), None)
        chat.append(m if r is None else {"thinking": r, **m, "reasoning_content": r})
    return chat


def _render_bounded(template: jinja2.Template, variables: dict) -> str:
    """Render with the output cut at TEMPLATE_MAX_CHARS and the time at TEMPLATE_SECONDS. The time
    limit is a timer that raises _TemplateTimeout in the rendering thread (between two Python
    bytecodes, so also inside a loop that writes nothing); single operations are bounded by the
    sandbox's operator checks."""
    thread, lock, state = threading.get_ident(), threading.Lock(), {"rendering": True, "fired": False}

    def expire() -> None:
        with lock:
            if state["rendering"]:
                state["fired"] = True
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread),
                                                           ctypes.py_object(_TemplateTimeout))

    timer = threading.Timer(TEMPLATE_SECONDS, expire)
    timer.daemon = True
    timer.start()
    try:
        pieces, size = [], 0
        for piece in template.generate(variables):
            size += len(piece)
            if size > TEMPLATE_MAX_CHARS:
                raise jinja2.exceptions.SecurityError(f"the template writes more than {TEMPLATE_MAX_CHARS} "
                                                      "characters")
            pieces.append(piece)
        return "".join(pieces)
    finally:
        with lock:
            state["rendering"] = False
            if state["fired"]:  # the exception may still be pending: cancel it
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), None)
        timer.cancel()
