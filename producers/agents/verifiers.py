"""A `verifiers` environment (verifiers 0.4, `verifiers.v1`) as the agent of an OpenAI agent loop
(`env.type: verifiers`; producers/agent_loops/registry.py builds the loop with this agent).

    agent, name = verifiers_agent(cfg)        # loads the environment once per producer
    reward = await agent(client, task)        # one episode of the task's row, through the producer's endpoint

Each rollout is one `Env.run_episode` of the row the task names (common/envs/verifiers.py), with the run's model:
the environment drives the turns -- its harness program sends every model call to verifiers' interception server,
which forwards it to the producer's endpoint under this rollout's key; its tools are its own (MCP servers of its
tasks, called on the endpoint's OpenAI tool_calls); a multi-turn environment answers the model between turns from
its own `run()`. The episode is then scored by the environment's rubric (the task's @vf.reward functions, its
judges and what `run()` / `finalize()` record), and that score is the sample's reward. What trains is what the
endpoint captured, token by token: what the environment inserted is context (mask 0).

The sampling the environment may ask for is the run's: every call goes out at rollout.temperature / top_p / top_k
and at most rollout.max_new_tokens (verifiers imposes a run's sampling on its harness's requests; the endpoint
refuses any other, since the trainer recomputes log-probs at the run's). A seat that pins another is refused at
load, naming the seat.

Offline, on the producer: every seat must run in verifiers' `subprocess` runtime with a harness that needs no
container (`null`, `bash`). Those harnesses run verifiers' bundled chat program as a uv script, which uv would
build by downloading its dependencies; here it runs with the producer's own Python, where verifiers' dependencies
(the program's) are installed already (`_offline_chat_program`).

    .venv/bin/python -m pytest -q tests/integration/test_env_verifiers.py
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import secrets
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rlbus.common.envs.verifiers import SPLITS, import_verifiers, load_environment, rows
from rlbus.producers.agent_loops.openai_agent import AgentFn
from rlbus.schemas.config import RunConfig
from rlbus.schemas.env import VerifiersEnvConfig
from rlbus.schemas.errors import ConfigError, RlbusError
from rlbus.schemas.wire import PromptTask


class EpisodeFailed(RlbusError):
    """A verifiers episode ended in an error, ran no single policy trace, or its rubric gave no finite reward."""


def _offline_chat_program() -> None:
    """Run verifiers' bundled chat program (the `null` and `bash` harnesses' loop) with this Python.

    The harness prepares it with `Runtime.prepare_uv_script`: `uv sync --script` downloads the script's declared
    dependencies into an environment of its own, once per script, and the runtime keeps the interpreter it found.
    There is no network here, and the dependencies (openai, mcp, httpx, httpx2, tenacity, certifi) are verifiers'
    own, so this producer's interpreter already has them: the script is written where the subprocess runtime
    keeps it and its interpreter recorded as this one, so the runtime never calls uv. verifiers 0.4's
    SubprocessRuntime (the one runtime rlbus allows) keeps that record in the class-level `_interpreters`."""
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
    from verifiers.v1.runtimes.subprocess import SubprocessRuntime

    data = CHAT_PROGRAM_SOURCE.encode()
    path = Path(SubprocessRuntime.scripts_dir) / f"{hashlib.sha256(data).hexdigest()}.py"
    if not path.is_file() or path.read_bytes() != data:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(data)
        tmp.replace(path)
    SubprocessRuntime._interpreters.setdefault(str(path), sys.executable)


def _check_runnable(env: Any, cfg: RunConfig) -> None:
    """The environment runs here: one seat, offline, at the run's sampling, one run per rollout."""
    from verifiers.v1.configs.agent import agent_config_fields
    from verifiers.v1.utils.loaders import harness_class

    rollout, harnesses, seats = cfg.rollout, env.config.agent_harnesses(), agent_config_fields(env.config)
    if len(seats) != 1:
        raise ConfigError("env.load", f"{env.config.env_id!r} has seats {sorted(seats)}; rlbus trains one agent per "
                                      "episode (multi-agent environments are not supported)")
    if env.taskset.toolsets(env.taskset.config):
        raise ConfigError("env.load", f"{env.config.env_id!r}: its taskset serves shared tools (Taskset.toolsets), "
                                      "which rlbus does not start; give them per task (Task.toolsets)")
    for name, seat in seats.items():
        at, harness = f"{env.config.env_id!r}, seat {name!r}", harnesses[name]
        if harness_class(harness.id).NEEDS_CONTAINER:
            raise ConfigError("env.load", f"{at} plays harness {harness.id!r}, a program that needs a container; "
                                          "rlbus runs environments on the producer, offline: use harness null or bash")
        if seat.runtime.type != "subprocess":
            raise ConfigError("env.load", f"{at} runs in runtime {seat.runtime.type!r} (a sandbox elsewhere); rlbus "
                                          "runs environments on the producer, offline: runtime {type: subprocess}")
        if seat.retries.max_retries:
            raise ConfigError("env.load", f"{at} retries its rollouts; an abandoned attempt's model calls would be "
                                          "trained with the retry's reward: retries.max_retries must be 0")
        asked = seat.sampling.model_dump(exclude_none=True) if seat.sampling is not None else {}
        for key in ("temperature", "top_p", "top_k"):
            run = getattr(rollout, key)
            if key in asked and asked[key] != run:
                raise ConfigError("env.load", f"{at} samples at {key}={asked[key]}, the run at rollout.{key}={run}: "
                                              "the trainer recomputes log-probs at the run's; leave it out of the "
                                              "seat's sampling or set rollout's to it")
        if asked.get("max_tokens", 0) > rollout.max_new_tokens:
            raise ConfigError("env.load", f"{at} asks max_tokens={asked['max_tokens']}, over rollout.max_new_tokens="
                                          f"{rollout.max_new_tokens}")


@contextlib.contextmanager
def _key_variable(key: str) -> Iterator[str]:
    """An environment variable holding this rollout's endpoint key, for the rollout's time.

    verifiers' client reads its API key from the variable its config names (never from the config itself); one
    variable per rollout keeps concurrent rollouts' keys apart. Its name holds API_KEY, which verifiers' subprocess
    runtime leaves out of the harness program's environment (the program gets the interception's own secret)."""
    name = f"RLBUS_VF_API_KEY_{secrets.token_hex(8)}"
    os.environ[name] = key
    try:
        yield name
    finally:
        os.environ.pop(name, None)


class VerifiersAgent:
    """The agent function of a verifiers environment: finds a task's row, runs its episode, returns its reward."""

    cfg: RunConfig
    env_cfg: VerifiersEnvConfig
    sampling: Any  # vf.SamplingConfig: the run's sampling, imposed on every model call of an episode
    _splits: dict[str, tuple[Any, list[Any]]]  # "train" / "eval" -> (environment, its rows)

    def __init__(self, cfg: RunConfig):
        vf = import_verifiers()
        if not isinstance(cfg.env, VerifiersEnvConfig):
            raise ConfigError("env.type", f"is {type(cfg.env).__name__}, not verifiers")
        self.cfg, self.env_cfg = cfg, cfg.env
        rollout = cfg.rollout
        self.sampling = vf.SamplingConfig(temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k,
                                          max_tokens=rollout.max_new_tokens)
        self._splits = {}
        # verifiers logs each episode's interception server and rollout at INFO, and its relay (aiohttp, httpx)
        # each request: some six lines an episode in a producer's log. Warnings still show; a level set stays.
        for noisy in ("verifiers", "aiohttp.access", "httpx"):
            if logging.getLogger(noisy).level == logging.NOTSET:
                logging.getLogger(noisy).setLevel(logging.WARNING)
        _offline_chat_program()
        self._split("train")  # loaded now: a bad environment fails the producer's start, not its first task

    def _split(self, split: str) -> tuple[Any, list[Any]]:
        if split not in self._splits:
            env = load_environment(self.env_cfg, split)
            _check_runnable(env, self.cfg)
            self._splits[split] = (env, rows(env))
        return self._splits[split]

    def row(self, task: PromptTask) -> tuple[Any, Any]:
        """The environment and the verifiers task a released task names (its extra_info vf_split / vf_idx)."""
        info = task.extra_info
        split, index, key = info.get("vf_split"), info.get("vf_idx"), info.get("vf_key")
        if split not in SPLITS or not isinstance(index, int) or isinstance(index, bool):
            raise EpisodeFailed("the task names no verifiers row (extra_info vf_split, vf_idx): was it released by a "
                                "verifiers environment?")
        env, tasks = self._split(str(split))
        if not 0 <= index < len(tasks) or tasks[index].key != key:
            raise EpisodeFailed(f"row {index} of {env.config.env_id!r} ({split}) is not the row the feeder released "
                                "(the environment differs between machines?)")
        return env, tasks[index]

    async def __call__(self, client: Any, task: PromptTask) -> float:
        vf = import_verifiers()
        env, row = self.row(task)
        with _key_variable(client.api_key) as variable:
            endpoint = vf.EvalClientConfig(base_url=str(client.base_url), api_key_var=variable)
            ctx = vf.ModelContext(model=self.cfg.rollout.openai.model, client=endpoint, sampling=self.sampling)
            episode = await env.run_episode(row, ctx)
        return self.reward(env, episode)

    @staticmethod
    def reward(env: Any, episode: Any) -> float:
        """The episode's reward: its one trace's rubric score, which must be finite. (The agent loop's error names
        the task.)"""
        name = env.config.env_id
        if not episode.ok:
            errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
            last = errors[-1] if errors else None
            what = f"{last.type}: {last.message}" if last is not None else "it did not complete"
            raise EpisodeFailed(f"the episode of {name!r} failed: {what}")
        if len(episode.traces) != 1:
            raise EpisodeFailed(f"{name!r} ran {len(episode.traces)} agent runs in one episode; "
                                "rlbus trains one agent per episode (multi-agent environments are not supported)")
        [trace] = episode.traces
        rubric = f"the rubric of {name!r} ({', '.join(trace.rewards) or 'no rewards'})"
        if not trace.rewards:
            raise EpisodeFailed(f"{rubric} recorded no reward (a task @vf.reward, a judge, or "
                                "trace.record_reward in the environment's run)")
        reward = trace.reward
        if not math.isfinite(reward):
            raise EpisodeFailed(f"{rubric} scored {reward!r}; a reward must be finite")
        return float(reward)


def verifiers_agent(cfg: RunConfig) -> tuple[AgentFn, str]:
    """The agent function of `cfg.env` (a verifiers environment, loaded here once) and its name for errors."""
    return VerifiersAgent(cfg), f"verifiers environment {cfg.env.load}"
