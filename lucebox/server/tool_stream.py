"""A tool-calling answer on the OpenAI API: its calls read as it streams (`tools.ToolCallStream`), then
its message fields, or its stream events (the text before a call as content, then each call whole)."""

from __future__ import annotations

from lucebox.errors import LuceboxError
from lucebox.server import openai_api as api
from lucebox.server.tools import call_json
from lucebox.text.tool_calls import ParsedOutput
from lucebox.tools import ToolCallStream


def tool_fields(content: str, parsed: ParsedOutput, finish: str) -> tuple[dict, str]:
    """(the message's content and tool_calls, the finish reason) of a whole answer whose content is
    `content`: with calls, the text beside them (None when only whitespace) and finish "tool_calls"."""
    if not parsed.calls:
        return {"content": content}, finish
    return {"content": content.strip() or None, "tool_calls": call_json(parsed.calls)}, (
        "tool_calls" if finish == "stop" else finish)


def tool_events(req, rid: str, model: str, rest: str, parsed: ParsedOutput) -> list[dict]:
    """The stream events that close an answer: the content held back, then each call whole, as OpenAI's
    deltas carry them ({"tool_calls": [{"index", "id", "type", "function": {"name", "arguments"}}]})."""
    events = [api.chunk(req, rid, model, rest, None)] if rest else []
    for call in call_json(parsed.calls, with_index=True):
        event = api.chunk(req, rid, model, None, None)
        event["choices"][0]["delta"] = {"tool_calls": [call]}
        events.append(event)
    return events


async def whole_call_reply(req, rid: str, model: str, first, next_chunk, calls: ToolCallStream) -> dict:
    """A tool-calling answer, not streamed (one choice: tools refuse n > 1 and logprobs): its text,
    then its calls. `next_chunk()`: the job's next chunk (None at the end); an engine error is a 500."""
    texts, chunk = [], first
    while chunk is not None:
        texts.append(calls.push(chunk.token_ids))
        last = chunk
        try:
            chunk = await next_chunk()
        except LuceboxError as e:
            raise api.APIError(500, str(e)) from None
    text = "".join(texts)
    reply = api.completion(req, rid, model, text, last.finish_reason, last.stats)
    rest, parsed = calls.finish()
    message, reply["choices"][0]["finish_reason"] = tool_fields(text + rest, parsed, last.finish_reason)
    reply["choices"][0]["message"].update(message)
    return reply


async def call_events(req, rid: str, model: str, first, next_chunk, calls: ToolCallStream):
    """A tool-calling answer's stream events: text as content, then each call whole, then the finish."""
    yield api.chunk(req, rid, model, "", None, first=True)
    chunk = first
    while chunk is not None:
        if text := calls.push(chunk.token_ids):
            yield api.chunk(req, rid, model, text, None)
        last = chunk
        chunk = await next_chunk()
    rest, parsed = calls.finish()
    for event in tool_events(req, rid, model, rest, parsed):
        yield event
    yield api.chunk(req, rid, model, None, tool_fields("", parsed, last.finish_reason)[1])
    if req.include_usage:
        yield api.usage_chunk(req, rid, model, last.stats)
