"""One chat choice as the client sees it: its thought (`reasoning_content`), its content and its
tool calls, read from its tokens as they stream (`text.answer_split.AnswerSplit`), then its message
fields or the stream events that carry them."""

from __future__ import annotations

from lucebox.server.choice_events import ChoiceEvents
from lucebox.server.tools import call_json
from lucebox.text.answer_split import AnswerSplit


def whole_message(parts: AnswerSplit, token_ids, text: str, finish: str) -> tuple[dict, str]:
    """(the message's fields, the finish reason) of a whole answer."""
    thought, content = parts.push(token_ids, text)
    end = parts.finish(finish)
    message = {"reasoning_content": thought + end.thought} if end.had_thought else {}
    content += end.content
    if end.parsed is None or not end.parsed.calls:
        return {**message, "content": content}, finish
    return {**message, "content": content.strip() or None, "tool_calls": call_json(end.parsed.calls)}, (
        "tool_calls" if finish == "stop" else finish)


def chunk_events(choice: ChoiceEvents, parts: AnswerSplit, chunk, logprobs_asked: bool) -> list[dict]:
    """The events of one chunk: its thought, then its content (its logprobs on the first)."""
    thought, content = parts.push(chunk.token_ids, chunk.text)
    events = [_thought_event(choice, thought, chunk.logprobs)] if thought else []
    parts.sent_thought = parts.sent_thought or bool(thought)
    if content or (not events and logprobs_asked and chunk.token_ids):
        events.append(choice.event(content, None, None if events else chunk.logprobs))
    return events


def closing_events(choice: ChoiceEvents, parts: AnswerSplit, finish: str) -> list[dict]:
    """The events that close a streamed choice: the thought and the content held back, then each call
    whole, as OpenAI's deltas carry them ({"tool_calls": [{"index", "id", "type", "function"}]}), then
    the finish."""
    end = parts.finish(finish)
    thought = end.thought or (end.had_thought and not parts.sent_thought)  # as a whole answer's "" is there
    events = [_thought_event(choice, end.thought, None)] if thought else []
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
