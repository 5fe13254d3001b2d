"""Shared by the agent and endpoint tests: a tiny model with a chat template that renders tools
(Hermes-style, as Qwen2.5's), built from the tiny llama's files."""

from __future__ import annotations

import shutil
from pathlib import Path

from built_once import building

# ChatML with tools in the system turn, tool calls as <tool_call>{json}</tool_call> and tool results
# as a user turn of <tool_response>, each turn closed by the tokenizer's eos: a Qwen2.5-shaped
# template for the tiny model.
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "You may call these functions:\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor "
    "%}\n</tools>\n"
    'Call one as <tool_call>{"name": NAME, "arguments": ARGS}</tool_call>{{ eos_token }}\n'
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}{{ "
    "eos_token }}\n"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content "
    "}}\n</tool_response>{{ eos_token }}\n"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content or '' }}"
    '{%- for c in m.tool_calls or [] %}<tool_call>\n{"name": "{{ c.function.name }}", "arguments": '
    "{{ c.function.arguments | tojson }}}\n</tool_call>{%- endfor %}{{ eos_token }}\n"
    "{%- elif m.role != 'system' %}<|im_start|>{{ m.role }}\n{{ m.content }}{{ eos_token }}\n"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def with_chat_template(model: Path, out: Path, template: str = HERMES_TEMPLATE) -> Path:
    """A copy of `model` whose tokenizer has `template`."""
    from transformers import AutoTokenizer

    with building(out):
        if not (out / "model.safetensors").exists():
            out.mkdir(parents=True, exist_ok=True)
            for f in model.iterdir():
                if f.is_file():
                    shutil.copy(f, out / f.name)
            tok = AutoTokenizer.from_pretrained(out)
            tok.chat_template = template
            tok.save_pretrained(out)
    return out
