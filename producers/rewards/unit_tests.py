"""The `unit_tests` reward: the response's code and the task's tests run together in the code sandbox; 1.0 if they
pass, else 0.0.

`rollout.reward: rlbus.producers.rewards.unit_tests:unit_tests`. The task's ground truth is JSON, HumanEval's fields:

    {"prompt": "def add(a, b):\\n    \\"\\"\\"...\\"\\"\\"\\n", "test": "def check(candidate):\\n    assert ...",
     "entry_point": "add"}

`prompt` (optional) is the code the model was shown; `test` defines `check(candidate)`, called with the function
named `entry_point` (without an entry point, `test` is a script whose asserts run as they are). The program is

    prompt + the code of the response + test + check(entry_point) + print(a random token)

where the response's code is its last ```python block that defines the entry point, else its first fenced block
(unclosed fences, as a response cut at max_new_tokens leaves them, count), else the whole response as the
continuation of the prompt (a completion model). The prompt comes first, so its imports and helper functions are
there, and the model's own `def` replaces the stub. The run passes only if it exits 0 *and* prints the token: a
program that calls `sys.exit(0)` or `os._exit(0)` before the tests ran has not passed them.

The program's own failures (an exception, a failed assert, a timeout, a memory hog) score 0.0: the policy's doing.
A failure of the sandbox raises InfrastructureError, which the producer never scores (it gives the task back).
Not stopped (the tests run in the program's own process): a solution returning an object whose `__eq__` is always
true passes `assert candidate(x) == y`, and code that reads the program's own text can learn the token.

    .venv/bin/python -m pytest -q tests/unit/test_unit_tests_reward.py
"""

from __future__ import annotations

import re
import secrets

import msgspec

from rlbus.producers.sandbox import Sandbox, shared_sandbox
from rlbus.schemas.errors import RlbusError
from rlbus.schemas.wire import PromptTask

#: Wall clock of one program (HumanEval's own harness allows 3 s; its slowest canonical solution takes ~0.1 s here).
TIMEOUT_S = 5.0

# ```python ... ``` (or ```py, ```python3, or untagged); an unclosed fence runs to the end of the text.
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL | re.IGNORECASE)


class GroundTruthError(RlbusError, ValueError):
    """A task's ground truth is not the JSON this reward needs (a data set bug, not the policy's)."""


class UnitTests(msgspec.Struct, kw_only=True):
    """A task's ground truth, as JSON."""

    test: str  # code that defines check(candidate), or asserts that run as they are
    entry_point: str = ""  # the function check() is called with ("" = none)
    prompt: str = ""  # the code the model was shown, run before its answer


def parse_ground_truth(ground_truth: str, task_id: str = "") -> UnitTests:
    try:
        truth = msgspec.json.decode(ground_truth, type=UnitTests)
    except msgspec.DecodeError as e:
        raise GroundTruthError(f"task {task_id!r}: ground truth is not unit-test JSON ({e}): {ground_truth[:80]!r}")
    if truth.entry_point and not truth.entry_point.isidentifier():
        raise GroundTruthError(f"task {task_id!r}: entry_point {truth.entry_point!r} is not a Python name")
    return truth


def fenced_code(response_text: str, entry_point: str = "") -> str | None:
    """The response's last fenced block that defines `entry_point`, else its first fenced block, else None."""
    blocks = _FENCE.findall(response_text)
    if entry_point:
        defines = re.compile(rf"^\s*(?:async\s+)?def\s+{re.escape(entry_point)}\s*\(", re.MULTILINE)
        defining = [b for b in blocks if defines.search(b)]
        if defining:
            return defining[-1]
    return blocks[0] if blocks else None


def build_program(response_text: str, truth: UnitTests, token: str) -> str:
    """The program that passes only if the response's code passes the tests: it ends by printing `token`."""
    block = fenced_code(response_text, truth.entry_point)
    # A fenced block stands apart from the prompt; unfenced text continues it (the function's body, say).
    code = truth.prompt + response_text if block is None else truth.prompt + "\n" + block
    parts = [code, truth.test]
    if truth.entry_point:
        parts.append(f"check({truth.entry_point})")
    parts.append(f"print({token!r})")
    return "\n\n".join(parts) + "\n"


class UnitTestsReward:
    """The reward function; `unit_tests` below is the instance a run config names. Give it a Sandbox of its own
    (tests do), or leave it to share the process's (producers/sandbox.py's shared_sandbox)."""

    def __init__(self, sandbox: Sandbox | None = None, *, timeout_s: float = TIMEOUT_S):
        self._sandbox = sandbox
        self.timeout_s = timeout_s

    async def __call__(self, response_text: str, ground_truth: str, *, task: PromptTask) -> float:
        truth = parse_ground_truth(ground_truth, task.task_id)
        token = secrets.token_hex(16)  # printed after the tests; the model's code cannot know it
        sandbox = self._sandbox or shared_sandbox()
        result = await sandbox.run(build_program(response_text, truth, token), timeout_s=self.timeout_s)
        return 1.0 if result.status == "ok" and token in result.stdout else 0.0


unit_tests = UnitTestsReward()

__all__ = ["GroundTruthError", "UnitTests", "UnitTestsReward", "build_program", "fenced_code", "unit_tests"]
