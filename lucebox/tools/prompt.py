"""The tools in the prompt: given to a chat template that reads them as transformers passes them
(`tools=[{"type": "function", "function": {...}}]`, the "tool_use" template when the model has one);
a template that never reads `tools` (or none at all) gets them in a system message instead, so the
model still sees them."""

from __future__ import annotations

import json

from lucebox.errors import LuceboxError
from lucebox.text.tool_calls import detect_format


def tools_as_system_text(tools: list[dict], fmt: str | None) -> str:
    """The tools in a system message, for a template that does not render them itself."""
    example = {"hermes": '<tool_call>\n{"name": NAME, "arguments": {...}}\n</tool_call>',
               "llama3": '{"name": NAME, "parameters": {...}}',
               "mistral": '[TOOL_CALLS][{"name": NAME, "arguments": {...}}]'}.get(fmt)
    how = f" To call one, write:\n{example}" if example else ""
    return f"You can call these tools (JSON Schema of their arguments):\n{json.dumps(tools)}\n{how}".rstrip()


def prompt_parts(tokenizer, messages: list[dict], request) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools for the template) for a `ToolRequest`: the tools go to a template that reads
    them, else into a system message of their own before the chat."""
    template = tokenizer.chat_template(tools=True) if tokenizer.has_chat_template else None
    if template is not None and "tools" in template:
        return messages, request.tools
    return [{"role": "system", "content": tools_as_system_text(request.tools, request.fmt)}, *messages], None


def model_tool_format(llm, forced: str | None) -> tuple[str | None, bool]:
    """(the call syntax to use, whether it is Mistral's `name[ARGS]{...}` form): `forced`
    (--tool-parser), else the one the model's chat template writes."""
    try:
        tokenizer = llm.tokenizer
    except LuceboxError:  # no tokenizer: no chat, no tools
        return forced, False
    template = tokenizer.chat_template(tools=True) or ""
    return forced or detect_format(template), "[ARGS]" in template
