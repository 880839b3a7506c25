"""A model folder whose chat template teaches tool calls in Qwen 2.5's syntax (Hermes'
`<tool_call>` JSON blocks): the built-in model's weights and tokenizer (which spells any JSON)
under a template that renders `tools`, assistant `tool_calls` and `tool` results as Qwen's does."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from lucebox.builtin import builtin_model

QWEN_TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
{{ messages[0]['content'] if messages[0]['role'] == 'system' else 'You are a helpful assistant.' }}

# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0]['role'] == 'system' %}<|im_start|>system
{{ messages[0]['content'] }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{%- if message.content %}
{{ message.content }}{% endif %}
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def qwen_tools_model(dest: Path, template: str = QWEN_TOOLS_TEMPLATE) -> Path:
    """The built-in model (no drafter) at `dest` with `template` (Qwen's, by default) as its chat template."""
    shutil.copytree(builtin_model(), dest, ignore=shutil.ignore_patterns("dflash"), dirs_exist_ok=True)
    config = json.loads((dest / "tokenizer_config.json").read_text())
    (dest / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return dest


WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                            "metric": {"type": "boolean"}},
           "required": ["city", "days"], "additionalProperties": False}
PING = {"type": "object", "properties": {"host": {"type": "string", "maxLength": 12}}, "required": ["host"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "ping", "parameters": PING}}]
SCHEMAS = {"get_weather": WEATHER, "ping": PING}

# Lark grammars that make the model write an answer, as a model trained for tools would
AUTO_CALL = ('start: "Checking.\\n<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": '
             '{\\"city\\": \\"Oslo\\", \\"days\\": 2}}\\n</tool_call>\\n<tool_call>\\n{\\"name\\": \\"ping\\", '
             '\\"arguments\\": {\\"host\\": \\"a.b\\"}}\\n</tool_call>"')
MALFORMED = 'start: "<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": }\\n</tool_call>"'


def streamed_answer(events):
    """(content, calls as (name, arguments text), finish reason) from an openai client's stream."""
    content, calls, finish = "", {}, None
    for e in events:
        delta = e.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            calls.setdefault(call.index, [call.function.name, ""])[1] += call.function.arguments or ""
            assert call.id and call.type == "function"
        finish = e.choices[0].finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish
