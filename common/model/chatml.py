"""The quickstart model's chat format, ChatML as in Qwen, as a Jinja template and the same thing in Python.

A tool result is a user turn wrapped in <tool_response> tags. The tokenizer (tokenizer.py) carries the template;
the demonstrations (demos.py) and the warm start's checks render conversations with the Python functions, which
tests/unit/test_tokenizer.py checks against the template.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from rlbus.common.chat import TOOL_RESPONSE_END, TOOL_RESPONSE_START

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"  # end of every turn; also the eos token (an assistant turn stops on it)
ENDOFTEXT = "<|endoftext|>"  # padding

#: The chat template (Jinja), ChatML as in Qwen; a tool result is a user turn wrapped in <tool_response> tags.
#: `render_chat` below is the same thing in Python; tests check that they agree.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{{- '<|im_start|>user\\n<tool_response>' + (message['content'] or '') + '</tool_response><|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def render_message(role: str, content: str) -> str:
    """One turn in the chat format (a "tool" message becomes a user turn holding a <tool_response>)."""
    if role == "tool":
        return f"{IM_START}user\n{TOOL_RESPONSE_START}{content}{TOOL_RESPONSE_END}{IM_END}\n"
    return f"{IM_START}{role}\n{content}{IM_END}\n"


def generation_prompt() -> str:
    """What opens an assistant turn for the model to complete."""
    return f"{IM_START}assistant\n"


def render_chat(messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = False) -> str:
    """The chat template in plain Python (for building corpora without a tokenizer)."""
    text = "".join(render_message(m["role"], m.get("content") or "") for m in messages)
    return text + (generation_prompt() if add_generation_prompt else "")
