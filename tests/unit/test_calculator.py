"""The calculator tool: right answers for arithmetic, an "error: ..." string (fast) for everything else."""

from __future__ import annotations

import time

import pytest

from rlbus.producers.tools.calculator import CALCULATOR, MAX_EXPRESSION_CHARS, evaluate


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("17*23", "391"),
        (" 17 * 23 ", "391"),
        ("1 + 2 * 3", "7"),
        ("(1 + 2) * 3", "9"),
        ("-5 + 3", "-2"),
        ("+4", "4"),
        ("2**10", "1024"),
        ("2 ^ 10", "1024"),
        ("7/2", "3.5"),
        ("391/17", "23"),  # exact integer division prints as an integer
        ("10//3", "3"),
        ("10 % 3", "1"),
        ("2**-1", "0.5"),
        ("0.1 + 0.2", "0.3"),  # floats print compactly
        ("1/3", "0.3333333333"),
        ("391.0", "391"),
        ("17 × 23", "391"),
        ("97*01", "97"),  # leading zeros, which Python's grammar rejects
        ("007 + 0.5 + 100 + 1.05", "108.55"),
        ("0", "0"),
        ("(" * 120 + "1" + ")" * 120, "1"),  # deep but short nesting is fine
    ],
)
def test_arithmetic(expression: str, expected: str) -> None:
    assert evaluate(expression) == expected


@pytest.mark.parametrize(
    ("expression", "reason"),
    [
        ("__import__('os')", "Call"),
        ("__import__('os').system('true')", "Call"),
        ("9**9**9", "too large"),
        ("10**100000", "too large"),
        ("2**100", "too large"),
        ("1/0", "division by zero"),
        ("1//0", "division by zero"),
        ("5 % 0", "by zero"),
        ("0**-1", "division by zero"),
        ("x", "Name"),
        ("x + 1", "Name"),
        ("(1).real", "Attribute"),
        ("().__class__", "Attribute"),
        ("lambda: 1", "Lambda"),
        ("[1, 2]", "List"),
        ("'a' * 3", "constant"),
        ("True + 1", "constant"),
        ("1 if 1 else 2", "IfExp"),
        ("1 < 2", "Compare"),
        ("17*", "invalid syntax"),
        ("", "empty"),
        ("1e300 * 1e300", "too large"),
        ("(-8) ** 0.5", "not a real number"),
        ("1" + "+1" * 100, "too complex"),
        ("-" * 200 + "1", "too complex"),
        ("1+" * 5000 + "1", "too long"),
    ],
)
def test_hostile_or_invalid_input_is_an_error_string(expression: str, reason: str) -> None:
    t0 = time.perf_counter()
    out = evaluate(expression)
    assert time.perf_counter() - t0 < 0.1, "refusals must be fast"
    assert out.startswith("error: "), out
    assert reason in out, out


def test_very_long_input_is_refused_before_parsing() -> None:
    out = evaluate("1" * (MAX_EXPRESSION_CHARS * 1000))
    assert out.startswith("error: expression too long")


def test_non_string_expression() -> None:
    assert evaluate(17).startswith("error: ")  # type: ignore[arg-type]


async def test_tool_call_interface() -> None:
    assert CALCULATOR.name == "calculator"
    assert await CALCULATOR({"expression": "17*23"}) == "391"
    assert (await CALCULATOR({})).startswith("error: missing argument")
    assert (await CALCULATOR({"expression": "1/0"})) == "error: division by zero"
