"""A tool-calling choice on the OpenAI API: its calls read as it streams (`tools.ToolCallStream`, one
per choice), then its message fields, or the stream events that close it (the content held back,
then each call whole)."""

from __future__ import annotations

from lucebox.server.choice_events import ChoiceEvents
from lucebox.server.choices import Answer
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


def whole_choice(body_choice: dict, answer: Answer, calls: ToolCallStream) -> None:
    """A whole choice's message and finish reason (`body_choice`, changed in place), from its tokens."""
    content = calls.push(answer.token_ids)
    rest, parsed = calls.finish(answer.finish_reason)
    message, body_choice["finish_reason"] = tool_fields(content + rest, parsed, answer.finish_reason)
    body_choice["message"].update(message)


def closing_events(choice: ChoiceEvents, calls: ToolCallStream, finish: str) -> list[dict]:
    """The events that close a streamed choice: the content held back, then each call whole, as OpenAI's
    deltas carry them ({"tool_calls": [{"index", "id", "type", "function": {"name", "arguments"}}]}),
    then the finish."""
    rest, parsed = calls.finish(finish)
    events = [choice.event(rest, None)] if rest else []
    for call in call_json(parsed.calls, with_index=True):
        event = choice.event(None, None)
        event["choices"][0]["delta"] = {"tool_calls": [call]}
        events.append(event)
    return [*events, choice.event(None, tool_fields("", parsed, finish)[1])]
