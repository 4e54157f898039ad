"""Synthetic arithmetic problems and calculator demonstrations for the quickstart model's warm start.

A problem is a two-digit multiplication or sum ("What is 17*23?", answer "391"). A demonstration either calls the
calculator (assistant: tool call -> tool result -> assistant: `<answer>391</answer>`) or answers directly with the
correct number. A tiny model fed about half of each learns to copy a tool result reliably but cannot multiply two
two-digit numbers in its head, so at the start of RL it picks the tool about half the time and earns reward mostly
when it does: the signal RL then amplifies into "always use the tool".

The synthetic dataset (common/data) reuses `arithmetic_problem`; the tokenizer trains its BPE on
`demonstration_corpus`. See them: `.venv/bin/python -m rlbus.common.model.demos`.
"""

from __future__ import annotations

import json
import random
from typing import Literal

from rlbus.common.chat import ANSWER_END, ANSWER_START, TOOL_CALL_END, TOOL_CALL_START
from rlbus.common.model.chatml import render_chat

QUICKSTART_SYSTEM_PROMPT = "Solve the arithmetic problem. You may call the calculator tool."

Message = dict[str, str]
Operator = Literal["*", "+"]


def arithmetic_problem(rng: random.Random, *, mul_fraction: float = 0.5) -> tuple[str, str]:
    """A random two-digit problem: ("What is 17*23?", "391"). Operands in [10, 99]; `*` with prob. mul_fraction."""
    op: Operator = "*" if rng.random() < mul_fraction else "+"
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return f"What is {a}{op}{b}?", str(a * b if op == "*" else a + b)


def question_expression(question: str) -> str:
    """The expression inside a quickstart question: "What is 17*23?" -> "17*23"."""
    return question.removeprefix("What is ").removesuffix("?")


def evaluate_expression(expression: str) -> int | None:
    """`a*b` or `a+b` of non-negative integers with int ops (no eval); None for anything else."""
    for op in ("*", "+"):
        left, sep, right = expression.partition(op)
        if sep and left.strip().isdigit() and right.strip().isdigit():
            a, b = int(left), int(right)
            return a * b if op == "*" else a + b
    return None


def tool_call_text(expression: str) -> str:
    """The assistant turn that calls the calculator (exactly what the agent loop parses)."""
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return f"{TOOL_CALL_START}{json.dumps(call)}{TOOL_CALL_END}"


def answer_text(answer: str) -> str:
    return f"{ANSWER_START}{answer}{ANSWER_END}"


def prompt_messages(question: str) -> list[Message]:
    """The quickstart prompt: system prompt + the question."""
    return [{"role": "system", "content": QUICKSTART_SYSTEM_PROMPT}, {"role": "user", "content": question}]


#: The worked examples `data.few_shot` puts before a question (fixed, so every prompt of a run shows the same ones).
FEW_SHOT_PROBLEMS: tuple[tuple[str, str], ...] = (("What is 12*34?", "408"), ("What is 45+27?", "72"),
                                                  ("What is 63*18?", "1134"), ("What is 29+58?", "87"))


def few_shot_messages(k: int) -> list[Message]:
    """`k` worked calculator conversations (user, tool call, tool result, answer): what a real chat model that was
    never shown this task's format copies from its context."""
    if k > len(FEW_SHOT_PROBLEMS):
        raise ValueError(f"at most {len(FEW_SHOT_PROBLEMS)} few-shot examples, not {k}")
    out: list[Message] = []
    for question, answer in FEW_SHOT_PROBLEMS[:k]:
        out += [{"role": "user", "content": question},
                {"role": "assistant", "content": tool_call_text(question_expression(question))},
                {"role": "tool", "content": answer},
                {"role": "assistant", "content": answer_text(answer)}]
    return out


def demonstration(question: str, answer: str, *, use_tool: bool) -> list[Message]:
    """A full conversation that solves `question`, with or without the calculator."""
    messages = prompt_messages(question)
    if use_tool:
        messages += [
            {"role": "assistant", "content": tool_call_text(question_expression(question))},
            {"role": "tool", "content": answer},
            {"role": "assistant", "content": answer_text(answer)},
        ]
    else:
        messages.append({"role": "assistant", "content": answer_text(answer)})
    return messages


def demonstrations(num_examples: int, *, seed: int = 0, tool_fraction: float = 0.5) -> list[list[Message]]:
    """`num_examples` seeded demonstrations; each calls the tool with probability `tool_fraction`."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_examples):
        question, answer = arithmetic_problem(rng)
        out.append(demonstration(question, answer, use_tool=rng.random() < tool_fraction))
    return out


def demonstration_corpus(num_examples: int = 512, *, seed: int = 0) -> list[str]:
    """The demonstrations rendered in the chat format (the tokenizer's BPE training text)."""
    return [render_chat(m) for m in demonstrations(num_examples, seed=seed)]


if __name__ == "__main__":
    for conv in demonstrations(3, seed=1):
        print(render_chat(conv))
