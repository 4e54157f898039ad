"""The tool-call parser on the forms real chat models write, and on turns SmolLM2-135M-Instruct really wrote.

tests/fixtures/smollm2_turns.json holds assistant turns sampled from the imported SmolLM2-135M-Instruct
(greedy and at temperature 1) on the smollm2_calculator prompts, each with the calls a reader of the turn sees in it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlbus.producers.agent_loops.tool_parser import parse_tool_calls

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "smollm2_turns.json"


def _calls(text: str) -> list[tuple[str, dict | None, bool]]:
    return [(c.name, c.arguments, bool(c.error)) for c in parse_tool_calls(text)]


CALC = {"expression": "17*23"}


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "calculator", "arguments": {"expression": "17*23"}}</tool_call>',  # Hermes / Qwen
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17*23"}}\n</tool_call>',  # Qwen2.5 layout
        '<tool_call>[{"name": "calculator", "arguments": {"expression": "17*23"}}]</tool_call>',  # SmolLM2's list
        '<tool_call>[\n{"name": "calculator", "arguments": {"expression": "17*23"}}\n]</tool_call>',
        '<tool_call>\n```json\n{"name": "calculator", "arguments": {"expression": "17*23"}}\n```\n</tool_call>',
        '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"17*23\\"}"}</tool_call>',  # OpenAI
        '<tool_call>{"name": "calculator", "parameters": {"expression": "17*23"}}</tool_call>',
        'Let me compute that.\n<tool_call>{"name": "calculator", "arguments": {"expression": "17*23"}}</tool_call>',
        '  <tool_call> {"name": "calculator", "arguments": {"expression": "17*23"}} </tool_call>  then I answer',
        # Stopped at <|im_end|> right after the JSON, the tag never closed.
        '<tool_call>{"name": "calculator", "arguments": {"expression": "17*23"}}',
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17*23"}}\nand some trailing words',
    ],
)
def test_one_call_in_every_form(text: str) -> None:
    assert _calls(text) == [("calculator", CALC, False)]


def test_several_calls_in_order_and_a_list_with_two() -> None:
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call> and '
            '<tool_call>[{"name": "b", "arguments": {"x": 1}}, {"name": "c"}]</tool_call>')
    assert _calls(text) == [("a", {}, False), ("b", {"x": 1}, False), ("c", {}, False)]


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "17*', "unterminated"),
        ("<tool_call>not json</tool_call>", "invalid tool call JSON"),
        ("<tool_call>[]</tool_call>", "empty tool call list"),
        ('<tool_call>{"arguments": {}}</tool_call>', "must be"),
        ('<tool_call>{"name": "calculator", "arguments": [1, 2]}</tool_call>', "must be an object"),
        ('<tool_call>{"name": "calculator", "arguments": "{oops"}</tool_call>', "not valid JSON"),
    ],
)
def test_what_cannot_be_understood_is_an_error_call(text: str, error: str) -> None:
    [call] = parse_tool_calls(text)
    assert call.error.startswith("error: ") and error in call.error and call.name == ""


def test_no_tag_no_call() -> None:
    assert parse_tool_calls("<answer>391</answer>") == []
    assert parse_tool_calls('17 * 23 = 391. {"name": "calculator"}') == []


def test_real_smollm2_turns() -> None:
    cases = json.loads(FIXTURE.read_text())
    assert len(cases) >= 20 and {c["mode"] for c in cases} >= {"greedy", "sampled"}
    assert any(c["calls"] for c in cases) and any(not c["calls"] for c in cases)
    for case in cases:
        got = [{"name": c.name, "arguments": c.arguments} if not c.error else {"error": True}
               for c in parse_tool_calls(case["text"])]
        assert got == case["calls"], case["text"]
