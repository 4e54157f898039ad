"""The task both sides of `bench/peer_trl.py` train on: two-digit addition, reward 1 when the reply starts with the
right answer. Standard library only: the TRL side imports it from its own venv, which has no rlbus.

A prompt is the quickstart's chat prompt (its system prompt and "What is 17+23?"), so the warm-started quickstart
model knows the format; the reply "starts with the right answer" when its first number, after an optional
`<answer>` tag and spaces, is the sum. A reply that calls the calculator instead earns 0 (no tools here, and 8 new
tokens cannot hold a tool call anyway).

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
_LEADING_NUMBER = re.compile(r"\s*(?:<answer>)?\s*(\d+)")


def problems(num: int, seed: int) -> list[tuple[str, str]]:
    """`num` seeded ("What is a+b?", "a+b") pairs with a, b in [10, 99]."""
    rng = random.Random(seed)
    out = []
    for _ in range(num):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        out.append((f"What is {a}+{b}?", str(a + b)))
    return out


def messages(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]


def score(reply: str, truth: str) -> float:
    """1.0 when the reply's first number (after an optional `<answer>` tag) is `truth`, else 0.0."""
    m = _LEADING_NUMBER.match(reply)
    return 1.0 if m is not None and m.group(1) == truth else 0.0


def reward(response_text: str, ground_truth: str, *, task: Any = None) -> float:
    """rlbus's reward signature (`rollout.reward=bench.peer_task:reward`)."""
    return score(response_text, ground_truth)


def write_jsonl(path: Path, num: int, seed: int) -> Path:
    """The rlbus side's data file, in the layout `data.type=jsonl` reads (verl's keys)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for q, a in problems(num, seed):
            f.write(json.dumps({"prompt": messages(q), "reward_model": {"ground_truth": a}}) + "\n")
    return path


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num", type=int, default=2048)
    args = ap.parse_args()
    print(write_jsonl(Path(args.out), args.num, args.seed))
