"""Workloads of bench/agentic.py: the quickstart's task with a remote service's latency in its tool, judge or env.

Each is named in a config from the repository root; its latency is a lognormal wait (median, sigma, capped) whose
random stream is seeded per process (the seed variable * 100003 + pid). The waits are sleeps: what costs time is the
waiting, not the computing. They are drawn by bench/agentic_latency.py (standard library only: the TRL side,
bench/agentic_trl.py, draws the same waits in its own venv).

- B1, `rollout.tools=[bench.agentic_tools:RemoteCalculator]`: the built-in `calculator`'s answers, each after
  RLBUS_TOOL_MEDIAN_S (sigma RLBUS_TOOL_SIGMA, cap RLBUS_TOOL_CAP_S, seed RLBUS_TOOL_SEED), as an HTTP API answers.
  An async tool.
- B2, `rollout.reward=bench.agentic_tools:slow_judge`: a remote judge with few slots. It scores as the `math`
  reward does, after RLBUS_JUDGE_MEDIAN_S (RLBUS_JUDGE_SIGMA, RLBUS_JUDGE_CAP_S, RLBUS_JUDGE_SEED), at most
  RLBUS_JUDGE_SLOTS calls at once per producer process. rlbus has no attribute by which a reward declares its
  concurrency (a tool's `max_concurrency` is applied by the tool runner only), so, like rlbus's own judge reward
  (producers/rewards/judge.py), it holds an asyncio.Semaphore of its own.
- B3, `env.type=gym env.make=bench.agentic_tools:make_straggler_env`: the quickstart's question as a Gym-style text
  environment that straggles. Its `step` (synchronous: it runs in the producer's worker threads) is also the
  calculator, so that the quickstart's model plays it in its own format: a turn holding a tool call is answered
  with the calculator's `<tool_response>` (the same text the tool loop inserts), a turn without one is scored as the
  `math` reward scores it (1 for the right answer) and ends the episode. Each step first waits RLBUS_ENV_MEDIAN_S
  (RLBUS_ENV_SIGMA, RLBUS_ENV_CAP_S, RLBUS_ENV_SEED); a share RLBUS_ENV_STRAGGLE of steps waits RLBUS_ENV_STRAGGLE_S
  instead, and a share RLBUS_ENV_HANG hangs (RLBUS_ENV_HANG_S, an hour by default) until rlbus's
  rollout.episode_timeout_s gives the task back as an infrastructure failure.

    .venv/bin/python -m pytest -q tests/unit/test_agentic_bench.py
"""

from __future__ import annotations

import asyncio
import functools
import random
import time
from typing import Any

from bench.agentic_latency import Lognormal, StepLatency, env_float
from rlbus.common.chat import ANSWER_START, TOOL_RESPONSE_END, TOOL_RESPONSE_START
from rlbus.common.model.demos import arithmetic_problem
from rlbus.producers.agent_loops.tool_parser import parse_tool_calls
from rlbus.producers.rewards.math import compute_score
from rlbus.producers.tools.calculator import CALCULATOR, evaluate
from rlbus.schemas.wire import PromptTask


# ---------------------------------------------------------------------------------------------------------------
# B1: a slow tool


class RemoteCalculator:
    name = CALCULATOR.name  # the quickstart model calls "calculator"
    description = CALCULATOR.description
    parameters = CALCULATOR.parameters

    latency: Lognormal

    def __init__(self) -> None:
        self.latency = Lognormal.from_env("TOOL")

    async def __call__(self, arguments: dict[str, Any]) -> str:
        await asyncio.sleep(self.latency.draw())
        return await CALCULATOR(arguments)


# ---------------------------------------------------------------------------------------------------------------
# B2: a judge with few slots


class SlowJudge:
    """The math reward's score after a judge's wait, at most `slots` calls at once (callers beyond wait their turn,
    and that wait is part of the episode's scoring time, as a busy judge's queue is)."""

    latency: Lognormal
    slots: int
    _loop: asyncio.AbstractEventLoop | None
    _slots: asyncio.Semaphore | None  # of the loop `_loop` (a semaphore belongs to one event loop)

    def __init__(self, latency: Lognormal, slots: int):
        if slots < 1:
            raise ValueError(f"RLBUS_JUDGE_SLOTS: must be >= 1, got {slots}")
        self.latency, self.slots = latency, slots
        self._loop, self._slots = None, None

    async def __call__(self, response_text: str, ground_truth: str) -> float:
        loop = asyncio.get_running_loop()
        if self._slots is None or self._loop is not loop:
            self._loop, self._slots = loop, asyncio.Semaphore(self.slots)
        async with self._slots:
            await asyncio.sleep(self.latency.draw())
        return compute_score(response_text, ground_truth)


@functools.cache
def _judge() -> SlowJudge:
    """This process's judge, made on first use (the producer's environment sets the variables before it starts)."""
    return SlowJudge(Lognormal.from_env("JUDGE"), int(env_float("JUDGE_SLOTS", 4)))


async def slow_judge(response_text: str, ground_truth: str, *, task: PromptTask) -> float:
    """`rollout.reward=bench.agentic_tools:slow_judge`: a reward as producers/rewards/registry.py calls one."""
    return await _judge()(response_text, ground_truth)


# ---------------------------------------------------------------------------------------------------------------
# B3: a straggling environment


class StragglerEnv:
    """The quickstart's question as a text environment: reset(seed) asks "What is 17*23?", step(action) answers a
    calculator call or scores an answer, after the step's wait."""

    latency: StepLatency | None  # None: no wait (the pure logic, as the tests check it)
    answer: str  # the right answer of the question of the last reset

    def __init__(self, latency: StepLatency | None = None):
        self.latency = latency
        self.answer = ""

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict]:
        question, self.answer = arithmetic_problem(random.Random(seed))  # deterministic in the seed, as rlbus checks
        return question, {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        if self.latency is not None:
            time.sleep(self.latency.draw())
        return self.respond(action)

    def respond(self, action: str) -> tuple[str, float, bool, bool, dict]:
        """What the quickstart's tool loop and math reward would make of the turn: (obs, reward, terminated,
        truncated, info)."""
        calls = parse_tool_calls(action)
        if not calls or ANSWER_START in action:
            return "", compute_score(action, self.answer), True, False, {}
        results = [call.error or _calculator(call.name, call.arguments or {}) for call in calls]
        return "".join(f"{TOOL_RESPONSE_START}{r}{TOOL_RESPONSE_END}" for r in results), 0.0, False, False, {}

    def close(self) -> None:
        pass


def _calculator(name: str, arguments: dict[str, Any]) -> str:
    """The built-in calculator's answer to a call, as the tool loop gives it (an error is the model's to read)."""
    if name != CALCULATOR.name:
        return f"error: unknown tool {name!r}; available: {CALCULATOR.name}"
    if "expression" not in arguments:
        return 'error: missing argument "expression"'
    return evaluate(arguments["expression"])


@functools.cache
def _step_latency() -> StepLatency:
    """One stream per process, shared by every episode's environment (each sample makes its own)."""
    return StepLatency.from_env()


def make_straggler_env() -> StragglerEnv:
    """`env.make=bench.agentic_tools:make_straggler_env`: a fresh environment with this process's step latency."""
    return StragglerEnv(_step_latency())
