"""The built-in `calculator` tool: safe arithmetic by walking Python's `ast`, never `eval`.

The model writes `<tool_call>{"name": "calculator", "arguments": {"expression": "17*23"}}</tool_call>`; the agent
loop calls `await CALCULATOR({"expression": "17*23"})` and gets "391". Everything a model can throw at it (syntax
errors, division by zero, `9**9**9`, names, calls, attribute access, absurdly long input) comes back as an
"error: ..." string: a tool error is an observation for the model, not a crash of the rollout.

    .venv/bin/python -m pytest -q tests/unit/test_calculator.py
"""

from __future__ import annotations

import ast
import math
import operator
import re
from typing import Any, Callable

#: Longest expression accepted (characters). Longer input is refused before parsing.
MAX_EXPRESSION_CHARS = 256
#: Most AST nodes in one expression (bounds the work of deeply nested input).
MAX_NODES = 128
#: Largest magnitude of any intermediate or final result; beyond this the answer is "too large".
MAX_MAGNITUDE = 10**30
#: Largest |exponent| of `**` (with MAX_MAGNITUDE this keeps every power cheap to compute).
MAX_EXPONENT = 128

Number = int | float

#: Leading zeros of an integer ("01", "007"): Python's grammar rejects them, a person (or a model) means 1 and 7.
_LEADING_ZEROS = re.compile(r"(?<![\d.eE])0+(?=\d)")


class CalculatorError(Exception):
    """An expression the calculator refuses; its message becomes the tool's "error: ..." answer."""


def _check(value: Number) -> Number:
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result is not a finite number")
    if abs(value) > MAX_MAGNITUDE:
        raise CalculatorError("number too large")
    return value


def _div(a: Number, b: Number) -> Number:
    if b == 0:
        raise CalculatorError("division by zero")
    # Exact integer division stays an integer ("391 / 17" -> "23"), so the answer compares cleanly.
    if isinstance(a, int) and isinstance(b, int) and a % b == 0:
        return a // b
    return a / b


def _floordiv(a: Number, b: Number) -> Number:
    if b == 0:
        raise CalculatorError("division by zero")
    return a // b


def _mod(a: Number, b: Number) -> Number:
    if b == 0:
        raise CalculatorError("modulo by zero")
    return a % b


def _pow(a: Number, b: Number) -> Number:
    # Refuse before computing: 10**100000 or 9**(9**9) would otherwise burn CPU (or memory) first.
    if abs(b) > MAX_EXPONENT:
        raise CalculatorError("exponent too large")
    if a == 0 and b < 0:
        raise CalculatorError("division by zero")
    if abs(a) > 1 and abs(b) * math.log10(abs(a)) > math.log10(MAX_MAGNITUDE) + 1:
        raise CalculatorError("number too large")
    result = a**b
    if isinstance(result, complex):
        raise CalculatorError("result is not a real number")
    return result


_BINARY: dict[type, Callable[[Number, Number], Number]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: _div,
    ast.FloorDiv: _floordiv,
    ast.Mod: _mod,
    ast.Pow: _pow,
}
_UNARY: dict[type, Callable[[Number], Number]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def _eval(node: ast.AST) -> Number:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant):
        # bool is an int subclass; "True + 1" is not arithmetic the model should rely on.
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise CalculatorError(f"unsupported constant {node.value!r}")
        return _check(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        return _check(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _check(_UNARY[type(node.op)](_eval(node.operand)))
    raise CalculatorError(f"unsupported expression element: {type(node).__name__}")


def format_number(value: Number) -> str:
    """Integers as integers ("391"); floats compactly ("0.5", "3.333333333", "391" for 391.0)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    if isinstance(value, float):
        return f"{value:.10g}"
    return str(value)


def evaluate(expression: str) -> str:
    """Evaluate an arithmetic expression; the result or an "error: ..." string. Never raises."""
    if not isinstance(expression, str):
        return f"error: expression must be a string, got {type(expression).__name__}"
    text = expression.strip()
    if not text:
        return "error: empty expression"
    if len(text) > MAX_EXPRESSION_CHARS:
        return f"error: expression too long ({len(text)} > {MAX_EXPRESSION_CHARS} characters)"
    # Models write "17 × 23" or "17 x 23"; "^" is read as power, as a person means it.
    text = text.replace("×", "*").replace("÷", "/").replace("^", "**")
    text = _LEADING_ZEROS.sub("", text)
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError):  # ValueError: e.g. null bytes in the source
        return "error: invalid syntax"
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        return f"error: expression too complex (more than {MAX_NODES} elements)"
    try:
        return format_number(_eval(tree))
    except CalculatorError as e:
        return f"error: {e}"
    except (OverflowError, ZeroDivisionError) as e:  # float overflow / float modulo corner cases
        return f"error: {e}"


class Calculator:
    """The `calculator` tool object the registry exposes (satisfies producers.tools.registry.Tool)."""

    name = "calculator"
    description = "Evaluate an arithmetic expression with + - * / // % ** and parentheses."
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. 17*23"}},
        "required": ["expression"],
    }

    async def __call__(self, arguments: dict[str, Any]) -> str:
        if "expression" not in arguments:
            return 'error: missing argument "expression"'
        # Cheap and bounded (MAX_NODES, MAX_EXPONENT): no need to leave the event loop for it.
        return evaluate(arguments["expression"])


CALCULATOR = Calculator()
