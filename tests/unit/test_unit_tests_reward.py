"""The `unit_tests` reward, run in the real sandbox: right code scores 1, wrong code 0, code that hangs 0, a sandbox
that is not there an InfrastructureError (never a 0); and every HumanEval problem, as examples/humaneval_to_jsonl.py
writes it, is solved by its canonical solution.

    .venv/bin/python -m pytest -q tests/unit/test_unit_tests_reward.py
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import AsyncIterator

import pytest

from rlbus.common.data.datasets import example_to_task, load_dataset
from rlbus.producers.rewards.registry import load_reward
from rlbus.producers.rewards.unit_tests import GroundTruthError, UnitTestsReward, fenced_code
from rlbus.producers.sandbox import Sandbox
from rlbus.schemas.config import DataConfig, RolloutConfig
from rlbus.schemas.errors import InfrastructureError
from rlbus.schemas.wire import ChatMessage, PromptTask

ROOT = Path(__file__).resolve().parents[2]
PROMPT = 'def add(a: int, b: int) -> int:\n    """The sum of a and b."""\n'
TEST = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"
TRUTH = json.dumps({"prompt": PROMPT, "entry_point": "add", "test": TEST})
TASK = PromptTask(task_id="t0", prompt=[ChatMessage(role="user", content=PROMPT)], ground_truth=TRUTH)


@pytest.fixture(scope="module")
async def reward() -> AsyncIterator[UnitTestsReward]:
    async with Sandbox(2) as sandbox:
        yield UnitTestsReward(sandbox, timeout_s=1.0)


def humaneval_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("humaneval_to_jsonl", ROOT / "examples" / "humaneval_to_jsonl.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_a_correct_solution_scores_one(reward: UnitTestsReward) -> None:
    fenced = "Here it is:\n```python\ndef add(a: int, b: int) -> int:\n    return a + b\n```\nDone."
    assert await reward(fenced, TRUTH, task=TASK) == 1.0
    # A completion model continues the prompt's code: the body alone, no fence.
    assert await reward("    return a + b\n", TRUTH, task=TASK) == 1.0
    # Cut at max_new_tokens after the function: the fence is never closed.
    assert await reward("```python\ndef add(a, b):\n    return b + a\n\nprint(add(1, 2))", TRUTH, task=TASK) == 1.0


async def test_a_wrong_solution_scores_zero(reward: UnitTestsReward) -> None:
    assert await reward("```python\ndef add(a, b):\n    return a - b\n```", TRUTH, task=TASK) == 0.0
    assert await reward("```python\ndef add(a, b) return a\n```", TRUTH, task=TASK) == 0.0  # a syntax error
    assert await reward("I do not know.", TRUTH, task=TASK) == 0.0


async def test_exiting_before_the_tests_scores_zero(reward: UnitTestsReward) -> None:
    # Exit status 0 is not enough: the tests must have run to the end.
    for escape in ("import sys; sys.exit(0)", "import os; os._exit(0)"):
        code = f"```python\ndef add(a, b):\n    return 0\n{escape}\n```"
        assert await reward(code, TRUTH, task=TASK) == 0.0


async def test_an_endless_loop_scores_zero_at_the_timeout(reward: UnitTestsReward) -> None:
    code = "```python\ndef add(a, b):\n    while True:\n        pass\n```"
    assert await reward(code, TRUTH, task=TASK) == 0.0


async def test_an_unavailable_sandbox_raises_instead_of_scoring(tmp_path: Path) -> None:
    async with Sandbox(1, bwrap=str(tmp_path / "missing" / "bwrap")) as sandbox:
        with pytest.raises(InfrastructureError) as err:
            await UnitTestsReward(sandbox)("```python\ndef add(a, b):\n    return a + b\n```", TRUTH, task=TASK)
    assert err.value.source == "sandbox"


async def test_a_malformed_ground_truth_is_a_data_error(reward: UnitTestsReward) -> None:
    with pytest.raises(GroundTruthError, match="task 't0'"):
        await reward("```python\n```", "42", task=TASK)


def test_the_code_is_the_block_that_defines_the_entry_point() -> None:
    text = "```python\nimport math\n```\nthen\n```py\ndef f(x):\n    return 1\n```\n```\nprint(f(2))\n```"
    assert fenced_code(text, "f") == "def f(x):\n    return 1\n"
    assert fenced_code(text, "g") == "import math\n"  # none defines it: the first block
    assert fenced_code("no code here", "f") is None


async def test_the_reward_is_named_by_import_path() -> None:
    # The path a run config gives; registry.load_reward wraps it in the finite-float check.
    fn = load_reward(RolloutConfig(reward="rlbus.producers.rewards.unit_tests:unit_tests"))
    assert await fn("```python\ndef add(a, b):\n    return a + b\n```", TRUTH, task=TASK) == 1.0


async def test_every_humaneval_problem_is_solved_by_its_canonical_solution(tmp_path: Path) -> None:
    script = humaneval_script()
    problems = {p["task_id"]: p for p in script.read_problems()}
    path = tmp_path / "humaneval.jsonl"
    path.write_text("".join(json.dumps(script.to_row(p)) + "\n" for p in problems.values()))
    data = load_dataset(DataConfig(type="jsonl", path=str(path)))  # what the feeder reads
    assert len(data) == 164
    async with Sandbox(2) as sandbox:
        reward = UnitTestsReward(sandbox)
        failed = []
        for example in data:
            task = example_to_task(example, task_id=f"t{example.index}", n=1)
            problem = problems[str(example.extra_info["task_id"])]
            assert problem["prompt"] in task.prompt[-1].content
            answer = f"```python\n{problem['prompt']}{problem['canonical_solution']}```"
            if await reward(answer, task.ground_truth, task=task) != 1.0:
                failed.append(problem["task_id"])
            if example.index % 20 == 0:  # and the prompt's stub alone fails
                assert await reward("```python\n```", task.ground_truth, task=task) == 0.0
    assert not failed
