"""An answer read from its tokens as they stream: its thought (`text.reasoning`), its content and,
when they are parsed, its tool calls (a `tools.ToolCallStream`), for the server's choices and the chat
session alike.

Without a reasoning syntax the content is the engine's text, or, with tools, what the call parser lets
out. With one, the answer is decoded here with special tokens kept (harmony's markers are special
tokens), minus the tokens that ended it and cut at a stop string as the engine cuts its own text; its
thought is split off, and the rest is the content the call parser reads."""

from __future__ import annotations

from dataclasses import dataclass

from lucebox.text.incremental import IncrementalDecoder
from lucebox.text.reasoning import ReasoningSplit
from lucebox.text.stopping import StopStrings
from lucebox.text.tool_calls import ParsedOutput


@dataclass(frozen=True)
class Ending:
    thought: str  # the thought not sent yet
    content: str  # the content not sent yet
    parsed: ParsedOutput | None  # the calls, when they are parsed
    had_thought: bool


class AnswerSplit:
    def __init__(self, tokenizer, prompt_ids, end_ids, stops: list[str], reasoning: str | None, inside: bool,
                 calls=None):
        """`reasoning`: the model's reasoning syntax (None: none, or not split off); `inside`: the prompt
        left the answer inside a thought; `calls`: a `ToolCallStream`, or None when nothing is parsed."""
        self._calls, self._end_ids = calls, frozenset(end_ids)
        self.sent_thought = False  # a stream has sent a piece of the thought (an empty one still gets its delta)
        self._split = ReasoningSplit(reasoning, inside) if reasoning is not None else None
        if self._split is not None:
            self._decoder = IncrementalDecoder(tokenizer, prompt_ids, skip_special_tokens=False)
            self._stops, self._stopped = StopStrings(stops), False

    @property
    def had_thought(self) -> bool:
        return self._split is not None and self._split.thought

    def push(self, ids, text: str | None) -> tuple[str, str]:
        """(thought, content) the chunk's tokens let go out now."""
        if self._split is None:
            return "", (self._calls.push(ids) if self._calls is not None else text or "")
        text = self._decoder.push([i for i in ids if i not in self._end_ids])
        thought, content = self._split.push(self._decode(text))
        return thought, self._content(content)

    def finish(self, finish_reason: str) -> Ending:
        if self._split is None:
            rest, parsed = self._calls.finish(finish_reason) if self._calls is not None else ("", None)
            return Ending("", rest, parsed, False)
        thought, content = self._split.push(self._decode(self._decoder.flush()) + self._decode(None))
        more_thought, more_content = self._split.finish()
        content = self._content(content + more_content)
        rest, parsed = self._calls.finish(finish_reason) if self._calls is not None else ("", None)
        return Ending(thought + more_thought, content + rest, parsed, self._split.thought)

    def _decode(self, text: str | None) -> str:
        """`text` cut at a stop string (None: the end, what was held for one)."""
        if self._stopped:
            return ""
        if text is None:
            return self._stops.flush()
        released, self._stopped = self._stops.feed(text)
        return released

    def _content(self, content: str) -> str:
        return self._calls.push_text(content) if self._calls is not None and content else content
