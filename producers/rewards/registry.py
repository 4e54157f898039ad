"""Reward functions by name ("math") or import path ("pkg.module:fn"), normalised to one async signature.

A reward function is `fn(response_text: str, ground_truth: str, *, task: PromptTask) -> float`, sync or async.
`load_reward(cfg.rollout)` returns an async callable of that signature (`env_reward(cfg)`: the environment's own
scorer where it has one); a synchronous function runs in the producer's bounded worker pool (producers/blocking.py),
never on its event loop, unless it is marked `fn.inline = True` (the built-in math reward: microseconds of work). A
reward that depends on a service (a judge, a sandbox) raises InfrastructureError when the service fails: the task is
rolled out again, never scored 0.

    .venv/bin/python -m pytest -q tests/unit/test_rewards.py
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import Any, Callable, Protocol

from rlbus.producers.blocking import is_async, run_blocking
from rlbus.producers.rewards.math import compute_score
from rlbus.common.imports import import_object
from rlbus.schemas.config import RolloutConfig, RunConfig
from rlbus.schemas.env import ReasoningGymEnvConfig
from rlbus.schemas.errors import ConfigError, RlbusError
from rlbus.schemas.wire import PromptTask


class RewardFn(Protocol):
    async def __call__(self, response_text: str, ground_truth: str, *, task: PromptTask) -> float: ...


class RewardError(RlbusError):
    """A reward function returned something that is not a finite number."""


def _math_reward(format_reward: float) -> Callable[..., float]:
    def math_reward(response_text: str, ground_truth: str, *, task: PromptTask) -> float:
        return compute_score(response_text, ground_truth, format_reward=format_reward)

    math_reward.inline = True  # type: ignore[attr-defined]  # microseconds of string work: a thread costs more
    return math_reward


def _resolve(cfg: RolloutConfig) -> Callable[..., Any]:
    if cfg.reward == "math":
        return _math_reward(cfg.format_reward)
    fn = import_object(cfg.reward, "rollout.reward")
    if not callable(fn):
        raise ConfigError("rollout.reward", f"{cfg.reward!r} is not callable")
    return fn


def checked(fn: Callable[..., Any], name: str) -> RewardFn:
    """`fn` as an async reward whose result is checked to be a finite float (RewardError names `name` otherwise)."""

    inline = getattr(fn, "inline", False) or is_async(fn)

    async def reward(response_text: str, ground_truth: str, *, task: PromptTask) -> float:
        if inline:
            value: Any = fn(response_text, ground_truth, task=task)
        else:  # a synchronous reward may block (a verifier's subprocess, an HTTP call): off the event loop
            value = await run_blocking(functools.partial(fn, response_text, ground_truth, task=task))
        if inspect.isawaitable(value):
            value = await value
        # bool is accepted on purpose: `return answer == truth` is a natural 0/1 reward.
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            raise RewardError(f"reward {name!r} returned {value!r} for task {task.task_id!r}; expected a finite float")
        return float(value)

    return reward


def load_reward(cfg: RolloutConfig, run: RunConfig | None = None) -> RewardFn:
    """The run's reward as an async callable; its result is checked to be a finite float. A reward that needs the
    run's config (the judge's: its `judge` section and run directory) offers `fn.for_run(run)`, which binds it."""
    fn = _resolve(cfg)
    bind = getattr(fn, "for_run", None)
    if callable(bind):
        if run is None:
            raise ConfigError("rollout.reward", f"{cfg.reward!r} needs the run's config to be loaded")
        fn = bind(run)
    return checked(fn, cfg.reward)


def env_reward(cfg: RunConfig) -> RewardFn:
    """The reward of the run's environment: a reasoning-gym task's own scorer, else rollout.reward (a gym or
    verifiers environment scores its episodes itself; this one then scores only what the environment leaves
    unscored)."""
    if isinstance(cfg.env, ReasoningGymEnvConfig):
        from rlbus.common.envs.reasoning_gym import ReasoningGymScorer

        return checked(ReasoningGymScorer(cfg.env, cfg.rollout.format_reward), "reasoning_gym")
    return load_reward(cfg.rollout, cfg)


__all__ = ["RewardError", "RewardFn", "checked", "env_reward", "load_reward"]
