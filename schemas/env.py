"""The `env` section: where a run's tasks come from, how an episode runs and how it is scored.

An environment supplies tasks (a prompt and what scores it), runs an episode of model turns and environment
observations, and scores it. Producers run it on their engine and own capture, masks and versions whatever the
environment is; the feeder releases its tasks and the evaluator scores its held-out split. `env.type` picks one:

    data           prompts from the `data` section, turns by rollout.agent_loop (tools: rollout.tools), scored by
                   rollout.reward: the built-in calculator task (data.type: synthetic) and any JSONL / Parquet set
    reasoning_gym  reasoning-gym's procedural tasks by name, with their generator settings and their own scorers
    verifiers      a `verifiers` environment, its rollout driven through the producer's OpenAI endpoint
    gym            a Gymnasium-style text environment (reset / step): observations in, sampled actions out

    rlbus config show configs/gcd_smollm2.yaml     # docs/environments.md has one example of each
"""

from __future__ import annotations

from typing import Any, Literal, Union

import msgspec

from rlbus.schemas.sections import _need, _Section

#: reasoning_gym's default instruction: the answer on a line of its own, after "Answer:" (a format a small chat
#: model already writes now and then, so the format reward has something to reinforce from the first step).
ANSWER_INSTRUCTION = "End your reply with the line: Answer: <answer>"


class DataEnvConfig(_Section, tag="data", tag_field="type"):
    """Prompts from `data`, turns by rollout.agent_loop, scored by rollout.reward (the default)."""


class ReasoningGymTask(_Section):
    name: str  # a reasoning-gym data set: gcd, letter_counting, chain_sum, ... (reasoning_gym.factory.DATASETS)
    weight: float = 1.0  # share of the examples when several tasks make a composite
    config: dict[str, Any] = msgspec.field(default_factory=dict)  # the generator's own settings (difficulty knobs)

    def __post_init__(self) -> None:
        _need(bool(self.name), "name", "must name a reasoning-gym data set")
        _need(self.weight > 0, "weight", "must be > 0")
        for key in ("seed", "size"):
            _need(key not in self.config, f"config.{key}", f"is set by env.{key}, not per task")


class ReasoningGymEnvConfig(_Section, tag="reasoning_gym", tag_field="type"):
    """reasoning-gym tasks (`pip install 'rlbus[reasoning-gym]'`), each scored by its own `score_answer`."""

    tasks: list[ReasoningGymTask] = msgspec.field(default_factory=list)  # one task, or several weighted (a composite)
    size: int = 2048  # training examples, all tasks together (split by weight)
    seed: int = 0  # generator seed of the training split; the held-out split is seed + 1000, overlaps removed
    system_prompt: str = ""  # a system message before every question ("" = none)
    instruction: str = ANSWER_INSTRUCTION  # appended to every question: how to give the answer ("" = nothing)
    answer_format: Literal["line", "tag"] = "line"  # line: text after the last "Answer:"; tag: <answer>...</answer>
    lenient: bool = True  # no answer in that format: score the response's last line instead (format reward not paid)

    def __post_init__(self) -> None:
        _need(bool(self.tasks), "tasks", "needs at least one task: [{name: gcd}]")
        _need(len({t.name for t in self.tasks}) == len(self.tasks), "tasks", "names a task twice")
        _need(self.size >= 1, "size", "must be >= 1")


class VerifiersEnvConfig(_Section, tag="verifiers", tag_field="type"):
    """A `verifiers` environment (`pip install 'rlbus[verifiers]'`), its rubric as the reward."""

    load: str = ""  # "pkg.module:fn" returning the environment (called with `args`), or the environment object
    args: dict[str, Any] = msgspec.field(default_factory=dict)  # keyword arguments of that function
    num_heldout: int = 0  # rows kept out of training for the evaluator (0: the environment's own eval split, if any)

    def __post_init__(self) -> None:
        _need(":" in self.load, "load", "must be an import path 'pkg.module:fn'")
        _need(self.num_heldout >= 0, "num_heldout", "must be >= 0")


class GymEnvConfig(_Section, tag="gym", tag_field="type"):
    """A Gymnasium-style text environment: `reset(seed=)` gives the first observation, `step(text)` the next."""

    make: str = ""  # "pkg.module:fn" returning a fresh env (called with `kwargs`), or a registered gymnasium id
    kwargs: dict[str, Any] = msgspec.field(default_factory=dict)  # keyword arguments of `make`
    num_tasks: int = 1024  # training episodes: reset seeds seed .. seed + num_tasks - 1
    seed: int = 0  # first reset seed; the held-out episodes use seeds from seed + 1_000_000
    system_prompt: str = ""  # a system message before the first observation ("" = none)

    def __post_init__(self) -> None:
        _need(bool(self.make), "make", "must name the environment: 'pkg.module:fn' or a gymnasium id")
        _need(self.num_tasks >= 1, "num_tasks", "must be >= 1")


EnvConfig = Union[DataEnvConfig, ReasoningGymEnvConfig, VerifiersEnvConfig, GymEnvConfig]
EnvType = Literal["data", "reasoning_gym", "verifiers", "gym"]

#: Held-out seeds of the gym environment start this far past the training seed.
GYM_HELDOUT_SEED_OFFSET = 1_000_000
