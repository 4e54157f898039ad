"""Tool calls as real chat models write them, parsed out of one assistant turn.

Accepted, in any mix within one turn:

    <tool_call>{"name": "calculator", "arguments": {"expression": "17*23"}}</tool_call>      Hermes / Qwen
    <tool_call>[{"name": "calculator", "arguments": {...}}, {...}]</tool_call>               SmolLM2 (a JSON list)
    <tool_call>\n```json\n{...}\n```\n</tool_call>                                         a fenced body
    {"name": ..., "arguments": "{\"expression\": \"17*23\"}"}                                OpenAI-style string args
    {"name": ..., "parameters": {...}}                                                     "parameters" for "arguments"

with whitespace and prose around the tags. A `<tool_call>` the model never closed still counts when a complete
JSON value follows it (a turn that stopped at `<|im_end|>` right after the JSON); otherwise it is an error call.
Whatever cannot be understood becomes a `ToolCall` with `error` set, which the agent loop shows the model as the
tool's answer: the rollout never fails because of what the model wrote.

    .venv/bin/python -m pytest -q tests/unit/test_tool_parser.py
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from rlbus.common.chat import TOOL_CALL_END, TOOL_CALL_START

_CLOSED_RE = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)" + re.escape(TOOL_CALL_END), re.DOTALL)
_FENCE_RE = re.compile(r"^```[a-zA-Z]*\s*(.*?)\s*```$", re.DOTALL)
_DECODER = json.JSONDecoder()


@dataclass
class ToolCall:
    """One parsed call; `error` set instead when the model's call could not be understood."""

    name: str = ""
    arguments: dict[str, Any] | None = None
    error: str = ""


def _one(call: Any) -> ToolCall:
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall(error='error: a tool call must be {"name": str, "arguments": {...}}')
    args = call.get("arguments", call.get("parameters", {}))
    if isinstance(args, str):  # OpenAI style: arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return ToolCall(error="error: tool call arguments are not valid JSON")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ToolCall(error="error: tool call arguments must be an object")
    return ToolCall(name=call["name"], arguments=args)


def _body(text: str) -> str:
    body = text.strip()
    fenced = _FENCE_RE.match(body)
    return fenced.group(1) if fenced else body


def _calls_of(value: Any) -> list[ToolCall]:
    if isinstance(value, list):
        if not value:
            return [ToolCall(error="error: empty tool call list")]
        return [_one(v) for v in value]
    return [_one(value)]


def _parse_body(body: str) -> list[ToolCall]:
    try:
        value = json.loads(_body(body))
    except json.JSONDecodeError as e:
        return [ToolCall(error=f"error: invalid tool call JSON ({e.msg} at column {e.colno})")]
    return _calls_of(value)


def _parse_unclosed(tail: str) -> list[ToolCall]:
    """After an unclosed `<tool_call>`: a complete JSON value there is a call; anything else is an error."""
    body = _body(tail)
    try:
        value, _ = _DECODER.raw_decode(body)
    except json.JSONDecodeError:
        return [ToolCall(error=f"error: unterminated {TOOL_CALL_START} (close it with {TOOL_CALL_END})")]
    return _calls_of(value)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every tool call of an assistant turn, in order (see the module docstring for the accepted forms)."""
    calls: list[ToolCall] = []
    for m in _CLOSED_RE.finditer(text):
        calls += _parse_body(m.group(1))
    rest = _CLOSED_RE.sub("", text)
    start = rest.find(TOOL_CALL_START)
    if start >= 0:
        calls += _parse_unclosed(rest[start + len(TOOL_CALL_START):])
    return calls
