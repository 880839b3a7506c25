"""The tools in the prompt: given to a chat template that reads them as transformers passes them
(`tools=[{"type": "function", "function": {...}}]`, the "tool_use" template when the model has one);
a template that never reads `tools` (or none at all) gets them in a system message instead, so the
model still sees them."""

from __future__ import annotations

import json

from lucebox.errors import LuceboxError
from lucebox.text.tool_calls import detect_format


def tools_as_system_text(tools: list[dict], fmt: str | None, choice: str = "auto") -> str:
    """The tools in a system message, for a template that does not render them itself (under
    tool_choice "none", with no way to call them: nothing parses a call then)."""
    if choice == "none":
        return ("These tools exist (JSON Schema of their arguments), but answer without calling them:\n"
                + json.dumps(tools))
    if fmt == "json":
        return (f"You can call these tools (JSON Schema of their arguments):\n{json.dumps(tools)}\n"
                "Answer with one JSON object: to call tools, "
                '{"tool_calls": [{"name": NAME, "arguments": {...}}, ...]}; to answer, {"content": "your answer"}.')
    example = {"hermes": '<tool_call>\n{"name": NAME, "arguments": {...}}\n</tool_call>',
               "llama3": '{"name": NAME, "parameters": {...}}',
               "mistral": '[TOOL_CALLS][{"name": NAME, "arguments": {...}}]',
               "qwen3_coder": "<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n"
                              "</tool_call>"}.get(fmt)
    how = f" To call one, write:\n{example}" if example else ""
    return f"You can call these tools (JSON Schema of their arguments):\n{json.dumps(tools)}\n{how}".rstrip()


def prompt_parts(tokenizer, messages: list[dict], request) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools for the template) for a `ToolRequest`: the tools go to a template that reads
    them, else into a system message of their own before the chat. Under the generic syntax they always
    go in the system message (a template's own tool syntax would teach another), and the calls and
    results of earlier turns are written as that syntax writes them (`generic_history`)."""
    template = tokenizer.chat_template(tools=True) if tokenizer.has_chat_template else None
    if request.fmt != "json" and template is not None and "tools" in template:
        return messages, request.tools
    if request.fmt == "json":
        messages = generic_history(messages)
    return [{"role": "system", "content": tools_as_system_text(request.tools, request.fmt, request.choice)},
            *messages], None


def generic_history(messages: list[dict]) -> list[dict]:
    """A chat's tool calls and results as plain turns any template renders: an answer's calls as the
    JSON object the model wrote them in, and the results that follow it as one user turn."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": json.dumps({"tool_calls": calls}, ensure_ascii=False)})
        elif m["role"] == "tool":
            result = json.dumps({"tool_call_id": m.get("tool_call_id"), "name": m.get("name"),
                                 "content": m["content"]}, ensure_ascii=False)
            if out and out[-1].get("tool_results"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + result}
            else:
                out.append({"role": "user", "content": result, "tool_results": True})
        else:
            out.append(m)
    return [{k: v for k, v in m.items() if k != "tool_results"} for m in out]


def model_tool_format(llm, forced: str | None) -> tuple[str | None, bool]:
    """(the call syntax to use, whether it is Mistral's `name[ARGS]{...}` form): `forced`
    (--tool-parser), else the one the model's chat template writes, else the generic "json"."""
    try:
        tokenizer = llm.tokenizer
    except LuceboxError:  # no tokenizer: no chat, no tools
        return forced, False
    template = tokenizer.chat_template(tools=True) or ""
    return forced or detect_format(template) or "json", "[ARGS]" in template
