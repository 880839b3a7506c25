"""Chat templates: where a model folder keeps them, and rendering them safely.

A chat template comes from a stranger's model folder: it renders in transformers' jinja2 setup (so
prompts come out the same as there) inside a sandbox (template_sandbox.py: no attribute escapes, and
no step may build text, a list or a number past its limit, template_limits.py), within a time limit,
and all the text it writes (its output, and what macros and blocks collect) within the text limit.
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import jinja2

from lucebox.errors import TokenizerError
from lucebox.text.template_sandbox import bounded_environment, render_counted

TEMPLATE_SECONDS = 5.0


class _TemplateTimeout(Exception):
    """Raised inside a rendering thread whose template ran past TEMPLATE_SECONDS."""


_JINJA = bounded_environment()


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

    def text(self, name: str) -> str | None:
        """The source of template `name`, or None."""
        return self._templates.get(name)

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
    """Render with all the text written bounded by TEMPLATE_MAX_CHARS (render_counted) and the time by
    TEMPLATE_SECONDS. The time limit is a timer that raises _TemplateTimeout in the rendering thread
    (between two Python bytecodes, so also inside a loop that writes nothing); single operations,
    which it cannot interrupt, are bounded by the sandbox's checks."""
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
        return render_counted(template, variables)
    finally:
        with lock:
            state["rendering"] = False
            if state["fired"]:  # the exception may still be pending: cancel it
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), None)
        timer.cancel()
