"""Conversations for supervised training: token ids and an assistant-token mask, through the model's chat template.

A row of a JSONL or Parquet file holds an OpenAI-style message list (`trainer.sft.messages_key`, default
`messages`): roles system / developer / user / assistant / tool, `content` a string (or null next to tool calls),
and an assistant's `tool_calls` (`[{"function": {"name", "arguments"}}]`), which are written into its text as the
agent loop's tool parser reads them, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as the producer's
OpenAI endpoint writes them (producers/capture.py): what SFT teaches is what RL's rollouts then parse.

The mask is found by rendering prefixes and diffing, not by a template's `{% generation %}` tags (few templates
have them; this works with any template that renders a conversation's prefix as a prefix of its text): for each
assistant message i, the text before it is the template's rendering of messages[:i] with the generation prompt, and
its own text is what rendering messages[:i + 1] adds, up to and including the tokenizer's eos (the token the agent
loop stops a turn on); what the template writes after the eos ("\\n" in ChatML) is context of the next turn. Each
piece is encoded on its own, so the token boundaries are the rollout's: the prompt with its generation header, then
the assistant's tokens, then the next context (the agent loop's `encode`s; common/model/warm_start.py's
`encode_demonstration` lays the quickstart's demonstrations out the same way, and the test compares the two). A
template whose rendering of a longer prefix rewrites an earlier part (some drop the reasoning of past turns) is
refused with the row named: its masks would not be the rollout's.

    convs = load_conversations("chats.jsonl", tokenizer, max_length=1024)    # [Conversation(ids, mask)]
    .venv/bin/python -m pytest -q tests/unit/test_conversations.py
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from rlbus.common.chat import TOOL_CALL_END, TOOL_CALL_START
from rlbus.common.data.datasets import DataError, _read_jsonl, _read_parquet

log = logging.getLogger(__name__)

_ROLES = ("system", "developer", "user", "assistant", "tool")


class Conversation(msgspec.Struct, array_like=True, gc=False):
    """One tokenized conversation. array_like / gc=False: a data set holds many, each only two int lists."""

    ids: list[int]  # the conversation's token ids, as the rollout would segment them
    mask: list[int]  # 1 on the assistant's own tokens (its contents and their eos), 0 on context


def _tool_call_text(call: Any, where: str) -> str:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f"{where}: a tool call needs function.name")  # noqa: TRY004 - the row's fault: DataError
    args = fn.get("arguments", {})
    if isinstance(args, str):  # OpenAI's form: the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            pass  # kept as the string the data gives
    return f"{TOOL_CALL_START}{json.dumps({'name': fn['name'], 'arguments': args})}{TOOL_CALL_END}"


def template_messages(raw: Any) -> list[dict[str, str]]:
    """A row's message list as the {"role", "content"} dicts chat templates take (tool calls written into the
    assistant's text, "developer" as "system"); ValueError naming the message when it is malformed."""
    if not isinstance(raw, list) or not raw:
        raise ValueError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, Mapping) or m.get("role") not in _ROLES:
            raise ValueError(f"messages[{i}] needs a role among {', '.join(_ROLES)}")
        content = m.get("content")
        if content is not None and not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or null")
        text = content or ""
        for j, call in enumerate(m.get("tool_calls") or ()):
            text += _tool_call_text(call, f"messages[{i}].tool_calls[{j}]")
        out.append({"role": "system" if m["role"] == "developer" else m["role"], "content": text})
    if not any(m["role"] == "assistant" for m in out):
        raise ValueError("has no assistant message: nothing to train on")
    return out


def encode_conversation(tokenizer: Any, messages: Sequence[Mapping[str, str]]) -> Conversation:
    """(ids, assistant mask) of `messages` (template dicts, `template_messages`), segmented as a rollout is."""
    eos = tokenizer.eos_token or ""

    def render(msgs: Sequence[Mapping[str, str]], generation: bool) -> str:
        return tokenizer.apply_chat_template(list(msgs), add_generation_prompt=generation, tokenize=False)

    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False)) if text else []

    ids: list[int] = []
    mask: list[int] = []
    done = ""  # the text encoded so far
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = render(messages[:i], True)  # everything before the turn, with the generation prompt
        full = render(messages[: i + 1], False)
        if not head.startswith(done) or not full.startswith(head):
            raise ValueError(f"the chat template renders messages[:{i + 1}] with another beginning than the "
                             f"conversation before it (it rewrites earlier turns): no assistant mask can match "
                             f"what a rollout samples")  # fmt: skip
        turn = full[len(head):]
        end = turn.find(eos) if eos else -1
        own = turn[: end + len(eos)] if end >= 0 else turn  # through the eos; the template's tail is context
        context_ids, own_ids = encode(head[len(done):]), encode(own)
        ids += context_ids + own_ids
        mask += [0] * len(context_ids) + [1] * len(own_ids)
        done = head + own
    return Conversation(ids=ids, mask=mask)


def _rows(path: Path) -> Iterator[tuple[int, Any]]:
    if not path.is_file():
        raise DataError(str(path), None, "no such file")
    return _read_parquet(path) if path.suffix.lower() in (".parquet", ".pq") else _read_jsonl(path)


def load_conversations(path: str | Path, tokenizer: Any, *, messages_key: str = "messages",
                       max_length: int = 1024) -> list[Conversation]:
    """Every conversation of a JSONL or Parquet file (by its suffix), tokenized and cut to its first `max_length`
    tokens. One left with no assistant token to predict is skipped, with a warning saying how many; a malformed
    row raises `DataError` naming the file and the row."""
    path = Path(path)
    out: list[Conversation] = []
    skipped = 0
    for num, row in _rows(path):
        if not isinstance(row, Mapping) or messages_key not in row:
            raise DataError(str(path), num, f"needs a {messages_key!r} column (trainer.sft.messages_key)")
        try:
            conv = encode_conversation(tokenizer, template_messages(row[messages_key]))
        except ValueError as e:
            raise DataError(str(path), num, str(e)) from None
        ids, mask = conv.ids[:max_length], conv.mask[:max_length]
        if not any(mask[1:]):  # position 0 predicts nothing
            skipped += 1
            continue
        out.append(Conversation(ids=ids, mask=mask))
    if skipped:
        log.warning("%s: %d conversation(s) skipped: no assistant token within the first %d tokens "
                    "(trainer.sft.max_length)", path, skipped, max_length)  # fmt: skip
    if not out:
        raise DataError(str(path), None, "no conversation to train on")
    return out
