"""One chat choice as the client sees it: its thought (`reasoning_content`), its content and its
tool calls, read from its tokens as they stream (`ChoiceParts`), then its message fields or the
stream events that carry them.

Without a reasoning syntax the content is the engine's text, or, with tools, what the call parser
(`tools.ToolCallStream`) lets out. With one (`text.reasoning`), the answer is decoded here with
special tokens kept (minus the tokens that ended it, cut at a stop string as the engine cuts its own
text), its thought split off, and the rest is the content the call parser reads."""

from __future__ import annotations

from dataclasses import dataclass

from lucebox.server.choice_events import ChoiceEvents
from lucebox.server.tools import call_json
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


class ChoiceParts:
    def __init__(self, tokenizer, prompt_ids, end_ids, stops: list[str], reasoning: str | None, inside: bool,
                 calls=None):
        """`reasoning`: the model's reasoning syntax (None: none, or not split off); `inside`: the prompt
        left the answer inside a thought; `calls`: a `ToolCallStream`, or None when nothing is parsed."""
        self._calls, self._end_ids = calls, frozenset(end_ids)
        self._split = ReasoningSplit(reasoning, inside) if reasoning is not None else None
        if self._split is not None:
            self._decoder = IncrementalDecoder(tokenizer, prompt_ids, skip_special_tokens=False)
            self._stops, self._stopped = StopStrings(stops), False

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


def whole_message(parts: ChoiceParts, token_ids, text: str, finish: str) -> tuple[dict, str]:
    """(the message's fields, the finish reason) of a whole answer."""
    thought, content = parts.push(token_ids, text)
    end = parts.finish(finish)
    message = {"reasoning_content": thought + end.thought} if end.had_thought else {}
    content += end.content
    if end.parsed is None or not end.parsed.calls:
        return {**message, "content": content}, finish
    return {**message, "content": content.strip() or None, "tool_calls": call_json(end.parsed.calls)}, (
        "tool_calls" if finish == "stop" else finish)


def chunk_events(choice: ChoiceEvents, parts: ChoiceParts, chunk, logprobs_asked: bool) -> list[dict]:
    """The events of one chunk: its thought, then its content (its logprobs on the first)."""
    thought, content = parts.push(chunk.token_ids, chunk.text)
    events = [_thought_event(choice, thought, chunk.logprobs)] if thought else []
    if content or (not events and logprobs_asked and chunk.token_ids):
        events.append(choice.event(content, None, None if events else chunk.logprobs))
    return events


def closing_events(choice: ChoiceEvents, parts: ChoiceParts, finish: str) -> list[dict]:
    """The events that close a streamed choice: the thought and the content held back, then each call
    whole, as OpenAI's deltas carry them ({"tool_calls": [{"index", "id", "type", "function"}]}), then
    the finish."""
    end = parts.finish(finish)
    events = [_thought_event(choice, end.thought, None)] if end.thought else []
    content = end.content if end.parsed is None or not end.parsed.calls or end.content.strip() else ""
    events += [choice.event(content, None)] if content else []
    calls = end.parsed.calls if end.parsed is not None else ()
    for call in call_json(calls, with_index=True):
        event = choice.event(None, None)
        event["choices"][0]["delta"] = {"tool_calls": [call]}
        events.append(event)
    return [*events, choice.event(None, "tool_calls" if calls and finish == "stop" else finish)]


def _thought_event(choice: ChoiceEvents, thought: str, logprobs) -> dict:
    event = choice.event(None, None, logprobs)
    event["choices"][0]["delta"] = {"reasoning_content": thought}
    return event
