"""Chat rendering shared by every role: the tags the agent loop reads and writes, and prompt -> token ids.

One route from messages to token ids, used by the data set's prompt-length filter (trainer), the agent loop
(producers) and the quickstart model's tooling: the tokenizer's own chat template renders text, and the text is
encoded without adding special tokens (a BOS the template wrote must not be added twice; transformers 5 returns a
BatchEncoding from `apply_chat_template(tokenize=True)` where 4.x returned a list).

    ids = prompt_token_ids(tokenizer, task.prompt)           # [ChatMessage] -> ids, with the assistant header
    ids = encode_chat(tokenizer, [{"role": "user", "content": "17*23?"}], add_generation_prompt=True)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rlbus.schemas.wire import ChatMessage

#: Hermes/Qwen-style tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
#: What the environment wraps a tool's output in (the quickstart's template; other templates bring their own).
TOOL_RESPONSE_START, TOOL_RESPONSE_END = "<tool_response>", "</tool_response>"
#: The final answer the math reward reads first.
ANSWER_START, ANSWER_END = "<answer>", "</answer>"


def as_dicts(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    """Wire chat messages as the {"role", "content"} dicts chat templates take."""
    return [{"role": m.role, "content": m.content} for m in messages]


def encode_chat(tokenizer: Any, messages: Sequence[Mapping[str, str]], *,
                add_generation_prompt: bool = False) -> list[int]:
    """Token ids of `messages` through the tokenizer's own chat template (any HF tokenizer, transformers 4 or 5)."""
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt, tokenize=False)
    return list(tokenizer.encode(text, add_special_tokens=False))


def prompt_token_ids(tokenizer: Any, prompt: Sequence[ChatMessage]) -> list[int]:
    """A task's prompt rendered by the chat template, with the assistant generation header, as token ids."""
    return encode_chat(tokenizer, as_dicts(prompt), add_generation_prompt=True)
