"""A model folder whose chat template teaches tool calls in Qwen3-Coder's and Qwen3.5's tags
(`<tool_call><function=name><parameter=key>value</parameter>...`): the built-in model's weights and
tokenizer under a template that renders `tools`, assistant `tool_calls` and `tool` results as
Qwen3.5's does (strings bare, other values as JSON)."""

from __future__ import annotations

from pathlib import Path

from tool_models import qwen_tools_model

XML_TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
# Tools

You have access to the following functions:

<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

If you choose to call a function ONLY reply in the following format with NO suffix:

<tool_call>
<function=example_function_name>
<parameter=example_parameter_1>
value_1
</parameter>
</function>
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}<|im_start|>user
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{%- if message.content %}
{{ message.content }}{% endif %}
{%- for call in message.tool_calls %}
<tool_call>
<function={{ call.function.name }}>
{%- for key, value in call.function.arguments.items() %}
<parameter={{ key }}>
{{ value if value is string else value | tojson }}
</parameter>
{%- endfor %}
</function>
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

# The model writes two calls after a sentence, as a model trained for tools would
AUTO_XML_CALL = ('start: "Checking.\\n<tool_call>\\n<function=get_weather>\\n<parameter=city>\\nOslo\\n</parameter>\\n'
                 '<parameter=days>\\n2\\n</parameter>\\n</function>\\n</tool_call>\\n<tool_call>\\n<function=ping>\\n'
                 '<parameter=host>\\na.b\\n</parameter>\\n</function>\\n</tool_call>"')


def xml_tools_model(dest: Path) -> Path:
    """The built-in model (no drafter) at `dest` with XML_TOOLS_TEMPLATE as its chat template."""
    return qwen_tools_model(dest, XML_TOOLS_TEMPLATE)
