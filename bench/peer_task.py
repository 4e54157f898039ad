"""The task both sides of `bench/peer_trl.py` train on: two-digit addition. Standard library only: the TRL side
imports it from its own venv, which has no rlbus.

Two rewards, one per model of the bench:

- `first` (the peer adder): a prompt is the quickstart's chat prompt (its system prompt and "What is 17+23?"), so
  the warm-started quickstart model knows the format; reward 1 when the reply's first number, after an optional
  `<answer>` tag and spaces, is the sum. A reply that calls the calculator instead earns 0 (no tools here, and 8
  new tokens cannot hold a tool call anyway).
- `contains` (SmolLM2-135M-Instruct): a system prompt of its own (`REAL_SYSTEM_PROMPT`); the model works a sum out
  in words ("To find 27+82, we add ... = 109"), so reward 1 when any whole number in the reply is the sum.

    .venv/bin/python bench/peer_task.py OUT.jsonl [--seed 0] [--num 2048]     # the rlbus side's data file
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path
from typing import Any

#: The quickstart model's own system prompt (common/model/demos.py), repeated here so this file imports nothing.
SYSTEM_PROMPT = "Solve the arithmetic problem. You may call the calculator tool."
#: SmolLM2-135M-Instruct's: with it the model sums right (the `contains` reward) on about 1 sample in 10.
REAL_SYSTEM_PROMPT = "Answer with the number only."
_LEADING_NUMBER = re.compile(r"\s*(?:<answer>)?\s*(\d+)")
_NUMBER = re.compile(r"\d+")


#: The operands' range of the bench's default task (two-digit sums); the `adder1` task uses (1, 9).
TWO_DIGITS = (10, 99)


def problems(num: int, seed: int, operands: tuple[int, int] = TWO_DIGITS) -> list[tuple[str, str]]:
    """`num` seeded ("What is a+b?", "a+b") pairs with a, b drawn from `operands` (inclusive)."""
    lo, hi = operands
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        out.append((f"What is {a}+{b}?", str(a + b)))
    return out


def messages(question: str, system: str = SYSTEM_PROMPT) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


def _first_number(reply: str) -> str | None:
    """The digits of the reply's first number, after an optional `<answer>` tag and spaces; None if it has none."""
    m = _LEADING_NUMBER.match(reply)
    return None if m is None else m.group(1)


def score(reply: str, truth: str) -> float:
    """1.0 when the reply's first number (after an optional `<answer>` tag) is `truth`, else 0.0."""
    return 1.0 if _first_number(reply) == truth else 0.0


def score_contains(reply: str, truth: str) -> float:
    """1.0 when any whole number in the reply is `truth`, else 0.0."""
    return 1.0 if truth in _NUMBER.findall(reply) else 0.0


def score_close(reply: str, truth: str) -> float:
    """Partial credit for the reply's first number (as `score` reads it): 1 - |number - truth| / 10, at least 0; 0
    without a number. Every group of samples then has a signal to learn from, not only those with a right sum."""
    number = _first_number(reply)
    return 0.0 if number is None else max(0.0, 1.0 - abs(int(number) - int(truth)) / 10.0)


SCORES = {"first": score, "contains": score_contains, "close": score_close}


def reward(response_text: str, ground_truth: str, *, task: Any = None) -> float:
    """rlbus's reward signature (`rollout.reward=bench.peer_task:reward`): the `first` reward."""
    return score(response_text, ground_truth)


def reward_contains(response_text: str, ground_truth: str, *, task: Any = None) -> float:
    """The `contains` reward (`rollout.reward=bench.peer_task:reward_contains`)."""
    return score_contains(response_text, ground_truth)


def reward_close(response_text: str, ground_truth: str, *, task: Any = None) -> float:
    """The `close` reward (`rollout.reward=bench.peer_task:reward_close`)."""
    return score_close(response_text, ground_truth)


def add_operands_arg(ap: argparse.ArgumentParser, what: str = "the range both numbers of a sum are drawn from") -> None:
    """`--operands LO HI` (default: two-digit sums), as every script of the bench takes it."""
    ap.add_argument("--operands", type=int, nargs=2, default=list(TWO_DIGITS), metavar=("LO", "HI"), help=what)


def write_jsonl(path: Path, num: int, seed: int, system: str = SYSTEM_PROMPT,
                operands: tuple[int, int] = TWO_DIGITS) -> Path:
    """The rlbus side's data file, in the layout `data.type=jsonl` reads (verl's keys)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for q, a in problems(num, seed, operands):
            f.write(json.dumps({"prompt": messages(q, system), "reward_model": {"ground_truth": a}}) + "\n")
    return path


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num", type=int, default=2048)
    add_operands_arg(ap)
    args = ap.parse_args()
    print(write_jsonl(Path(args.out), args.num, args.seed, operands=tuple(args.operands)))
