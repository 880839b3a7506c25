"""An answer that may hold tool calls, as it streams (`ToolCallStream`): the text before a call goes
out as content while it comes; from where a call may begin, the rest waits for the end of the answer, where it is
parsed (`text.tool_calls`). Whole answers go through the same steps, so both agree.

The text is decoded with special tokens kept (Mistral's `[TOOL_CALLS]`, Llama's `<|python_tag|>` are
special tokens), minus the tokens that ended the answer (EOS), and cut at a stop string as the
engine cuts its own text. Content that could be the start of a call marker or of a stop string is
held back until the next tokens tell. Under the generic syntax (`text.json_calls`) the content is the
answer object's text, streamed as its JSON string is decoded.

An answer cut short (max_tokens), or ended where it repeated a call (`text.call_watch`), keeps the
calls it wrote whole, each once; a call cut in two is dropped, and the finish reason says why.
"""

from __future__ import annotations

from dataclasses import replace

from lucebox.text.incremental import IncrementalDecoder
from lucebox.text.json_calls import ANSWER_HEAD, answer_text, decode_from, is_calls
from lucebox.text.tool_calls import (
    ParsedOutput,
    call_markers,
    complete_calls,
    first_repeat,
    parse_tool_calls,
    starts_at_beginning,
)
from lucebox.text.xml_calls import string_parameters
from lucebox.tools.request import ToolRequest


class ToolCallStream:
    def __init__(self, tokenizer, request: ToolRequest, end_ids, stops: list[str], prompt_ids=()):
        """`request`: the tools asked for; `end_ids`: the tokens that end an answer; `stops`: stop strings;
        `prompt_ids`: the prompt, whose last tokens are context for the first (as the engine decodes)."""
        self._decoder = IncrementalDecoder(tokenizer, prompt_ids, skip_special_tokens=False)
        self._fmt, self._end_ids, self._stops = request.fmt, frozenset(end_ids), list(stops)
        self._request = request
        self._text, self._sent, self._in_call = "", 0, False
        self._scanned: int | None = None  # the generic syntax: where the answer's text is decoded up to

    def push(self, ids) -> str:
        """The content the new token ids let go out now (maybe "")."""
        return self.push_text(self._decoder.push([i for i in ids if i not in self._end_ids]))

    def push_text(self, text: str) -> str:
        """`push` for text decoded elsewhere (an answer's content once its thought is split off)."""
        self._text += text
        return self._release()

    def finish(self, finish_reason: str = "stop") -> tuple[str, ParsedOutput]:
        """(the content not sent yet, the whole answer parsed); `finish_reason`: how the answer ended."""
        self._text += self._decoder.flush()
        text = self._cut(self._text)
        strings = string_parameters([t["function"] for t in self._request.tools])
        parsed = parse_tool_calls(text, self._fmt, strings)
        if not parsed.calls and finish_reason in ("stop", "length"):  # cut short, or ended at a repeated call
            cut = complete_calls(text, self._fmt, strings)
            if cut.calls and (finish_reason == "length" or first_repeat(cut.calls) is not None):
                parsed = cut
        if self._fmt == "json" and not parsed.calls and answer_text(text) is None:
            parsed = ParsedOutput("", ())  # the generic syntax's own wrapper, cut before a whole call: no text
        if (repeat := first_repeat(parsed.calls)) is not None:
            parsed = replace(parsed, calls=parsed.calls[:repeat])
        if not all(self._request.allows(c) for c in parsed.calls):
            parsed = ParsedOutput(text, ())  # a call to a tool it was not given (or off a strict schema) is text
        if not self._request.parallel and len(parsed.calls) > 1:
            parsed = replace(parsed, calls=parsed.calls[:1])
        rest = parsed.content[self._sent:]
        return ("" if parsed.calls and not rest.strip() else rest), parsed  # no whitespace between calls

    def _cut(self, text: str) -> str:
        at = min((text.find(s) for s in self._stops if s in text), default=-1)
        return text if at < 0 else text[:at]

    def _release(self) -> str:
        if self._in_call:
            return ""
        text = self._cut(self._text)
        if self._fmt == "json":
            return self._release_answer(text)
        if not text.strip():
            return ""  # leading whitespace waits: a Llama 3 call may follow it
        starts = []
        for marker in call_markers(self._fmt):
            if starts_at_beginning(self._fmt, marker):
                if text.lstrip().startswith(marker):
                    starts.append(len(text) - len(text.lstrip()))
            elif marker in text:
                starts.append(text.index(marker))
        if starts:
            self._in_call = True
            end = min(starts)
        else:
            end = len(text) - self._held(text)
        out = text[self._sent:end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        return out

    def _release_answer(self, text: str) -> str:
        """The generic syntax: the answer object's text as far as it is decoded (each piece once, from
        where the last ended); nothing from calls."""
        if self._scanned is None:
            body = text.lstrip()
            if not body.startswith(ANSWER_HEAD + '"'):
                self._in_call = is_calls(text)
                return ""
            self._scanned = len(text) - len(body) + len(ANSWER_HEAD) + 1  # where the answer's string starts
        out, self._scanned = decode_from(text, self._scanned)
        self._sent += len(out)
        return out

    def _held(self, text: str) -> int:
        """How many of the last characters could begin a marker or a stop string."""
        held = 0
        for word in [*call_markers(self._fmt), *self._stops]:
            for n in range(min(len(word) - 1, len(text)), held, -1):
                if text.endswith(word[:n]):
                    held = n
                    break
        return held
