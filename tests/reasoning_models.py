"""Model folders whose chat templates teach reasoning, one per family lucebox splits (`text.reasoning`):
the built-in model's weights and tokenizer under a Qwen3-style template (the model opens `<think>`
itself; `enable_thinking=false` writes an empty thought into the prompt), a DeepSeek-R1-style one (the
generation prompt opens the thought) and a gpt-oss-style harmony one (channels; `reasoning_effort`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from lucebox.builtin import builtin_model

QWEN3 = """{%- for message in messages %}<|im_start|>{{ message.role }}
{% if message.role == 'assistant' and message.reasoning_content and loop.last %}<think>
{{ message.reasoning_content }}
</think>

{% endif %}{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""

DEEPSEEK_R1 = """{%- for message in messages %}{% if message.role == 'user' %}<|User|>{{ message.content }}
{%- elif message.role == 'assistant' %}<|Assistant|>{{ message.content }}<|end|>{% endif %}{% endfor %}
{%- if add_generation_prompt %}<|Assistant|><think>
{% endif %}"""

HARMONY = """<|start|>system<|message|>Reasoning: {{ reasoning_effort or 'medium' }}<|end|>
{%- for message in messages %}<|start|>{{ message.role }}<|message|>{{ message.content }}<|end|>{% endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}
{#- answers are written <|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>... #}"""


def templated_model(dest: Path, template: str) -> Path:
    """The built-in model (no drafter) at `dest` with `template` as its chat template."""
    shutil.copytree(builtin_model(), dest, ignore=shutil.ignore_patterns("dflash"), dirs_exist_ok=True)
    config = json.loads((dest / "tokenizer_config.json").read_text())
    (dest / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return dest
