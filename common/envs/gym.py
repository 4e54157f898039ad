"""Gymnasium-style text environments: `reset(seed=)` gives the first observation, `step(action_text)` the next.

    env:
      type: gym
      make: mypkg.games:GuessNumber      # a class or function returning a fresh env; or a registered gymnasium id
      kwargs: {low: 1, high: 64}
      num_tasks: 1024                    # training episodes: reset seeds seed .. seed + num_tasks - 1

A task is one reset seed: its prompt is the first observation (after env.system_prompt, if any), so the feeder,
the event log and the evaluator see what the model saw; a producer resets its own env instance per sample with
the same seed (a group's samples begin alike) and runs the episode (producers/agent_loops/gym.py). Observations and
actions are text: Gymnasium's `Env` over `spaces.Text`, or any object with the same two methods.

    .venv/bin/python -m pytest -q tests/unit/test_env_gym.py
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any, Callable

from rlbus.common.data.datasets import Example
from rlbus.common.imports import import_object
from rlbus.schemas.env import GYM_HELDOUT_SEED_OFFSET, GymEnvConfig
from rlbus.schemas.errors import ConfigError, RlbusError
from rlbus.schemas.wire import ChatMessage


class EnvProtocolError(RlbusError):
    """An environment returned something that is not what reset / step return (text observations)."""


def env_factory(cfg: GymEnvConfig) -> Callable[[], Any]:
    """A function that makes a fresh environment, as `env.make` and `env.kwargs` say."""
    if ":" in cfg.make:
        make = import_object(cfg.make, "env.make")
        if not callable(make):
            raise ConfigError("env.make", f"{cfg.make!r} is not callable")
        _check_kwargs(cfg, make)
        return lambda: make(**cfg.kwargs)
    try:
        import gymnasium
    except ModuleNotFoundError:
        raise ConfigError("env.make", f"{cfg.make!r} is not 'pkg.module:fn', and a gymnasium id needs gymnasium: "
                                      "pip install 'rlbus[gym]'") from None
    if cfg.make not in gymnasium.registry:
        near = difflib.get_close_matches(cfg.make, list(gymnasium.registry), n=3)
        raise ConfigError("env.make", f"gymnasium has no environment {cfg.make!r} registered"
                                      + (f" (did you mean {', '.join(near)}?)" if near else ""))
    return lambda: gymnasium.make(cfg.make, **cfg.kwargs)


def _check_kwargs(cfg: GymEnvConfig, make: Callable[..., Any]) -> None:
    """ConfigError naming env.kwargs when `make` cannot be called with them (an argument it does not take, one it
    needs and is not given): said when the config is checked, not when the first episode starts."""
    try:
        signature = inspect.signature(make)
    except (TypeError, ValueError):  # a builtin without a signature: the call itself will say
        return
    try:
        signature.bind(**cfg.kwargs)
    except TypeError as e:
        raise ConfigError("env.kwargs", f"{cfg.make!r}: {e}") from None


def observation_text(obs: Any, where: str) -> str:
    if not isinstance(obs, str):
        raise EnvProtocolError(f"{where} returned an observation of type {type(obs).__name__}; a text environment "
                               "observes with str")
    return obs


def reset(env: Any, seed: int) -> str:
    out = env.reset(seed=seed)
    obs = out[0] if isinstance(out, tuple) else out  # Gymnasium: (obs, info)
    return observation_text(obs, "reset()")


def prompt(cfg: GymEnvConfig, first_observation: str) -> list[ChatMessage]:
    system = [ChatMessage(role="system", content=cfg.system_prompt)] if cfg.system_prompt else []
    return [*system, ChatMessage(role="user", content=first_observation)]


def examples(cfg: GymEnvConfig, split: str = "train", num: int = 0) -> list[Example]:
    """One example per reset seed: `env.num_tasks` for training, `num` held-out ones at seeds of their own."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be train or heldout, not {split!r}")
    first = cfg.seed + (GYM_HELDOUT_SEED_OFFSET if split == "heldout" else 0)
    env = env_factory(cfg)()
    out = []
    try:
        for seed in range(first, first + (cfg.num_tasks if split == "train" else num)):
            out.append(Example(prompt=prompt(cfg, reset(env, seed)), ground_truth="", data_source=f"gym/{cfg.make}",
                               extra_info={"gym_seed": seed}))
    finally:
        if hasattr(env, "close"):
            env.close()
    return out
