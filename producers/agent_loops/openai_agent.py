"""The agent loop for agents written against the OpenAI API: each sample is one run of the user's agent function
with a client that points at the producer's own endpoint (producers/endpoint.py) under the sample's own key.

    rollout:
      agent_loop: openai
      openai: {function: rlbus.producers.agents.calculator:rollout}

    async def rollout(client: openai.AsyncOpenAI, task: PromptTask) -> float | None: ...

A group of n samples is n concurrent runs of the function (their calls are batched by the engine as the built-in
loops' are). Every sequence a run's calls form (producers/capture.py: usually one; more when the agent rewrites its
history, or asks for n > 1 itself) is a sample of the group, with the run's reward: the number the function
returns, or, when it returns None, the task's reward function (`rollout.reward`) applied to the sequence's
response text, as the built-in loops score. A run that raises (its agent failed, a request was refused) fails the
task, which the producer gives back or dead-letters as any failed task; the engine's own failure is re-raised as
itself. Partial rollout does not restart samples here (the agent owns the conversation); the producer's check of
the whole group before publishing still applies.

An agent in another process (any language): `rollout.openai.command: [argv...]` instead of `function`. Each rollout
runs the command once, with the rollout's own key and the endpoint in the variables the `openai` clients read:

    OPENAI_BASE_URL=http://127.0.0.1:<port>/v1   OPENAI_API_KEY=rlbus-<this rollout's key>   RLBUS_MODEL=policy

and the task on stdin as one JSON object (PromptTask's fields: task_id, prompt [{role, content}], ground_truth,
data_source, extra_info, n, index, epoch, attempt, released_version, created_at). The last non-empty line of its
stdout is the reward: a JSON number, or `null` (or no output) for the task's reward function. A non-zero exit fails
the rollout (stderr's tail is in the error); past `rollout.openai.timeout_s`, or when the rollout is cancelled, the
process is killed. The key dies when the command's rollout ends, and the process dies with its producer: the kernel
SIGTERMs it when the producer ends without killing it (a SIGKILLed producer; bus/proc.py's die_with_parent).

    .venv/bin/python -m pytest -q tests/integration/test_endpoint.py
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import msgspec

from rlbus.bus.proc import die_with_parent
from rlbus.producers.agent_loops.base import AgentLoop, Trajectory
from rlbus.producers.endpoint import Endpoint, model_context
from rlbus.producers.engines.base import RolloutEngine
from rlbus.producers.rewards.registry import RewardFn
from rlbus.common.imports import import_object
from rlbus.producers.tools.registry import Tool
from rlbus.schemas.config import RolloutConfig
from rlbus.schemas.errors import ConfigError, RlbusError
from rlbus.schemas.wire import PromptTask

AgentFn = Callable[[Any, PromptTask], Awaitable["float | None"]]


class AgentFailed(RlbusError):
    """The agent function raised, or made no call to the model (there is nothing to train on)."""


def load_agent(path: str) -> AgentFn:
    fn = import_object(path, "rollout.openai.function")
    if not inspect.iscoroutinefunction(fn):
        raise ConfigError("rollout.openai.function", f"{path!r} must be an async function (client, task)")
    return fn


def command_agent(argv: list[str], model: str) -> AgentFn:
    """The agent function that runs `argv` as its own process for one rollout (the module docstring's contract)."""

    async def rollout(client: Any, task: PromptTask) -> float | None:
        env = dict(
            os.environ,
            OPENAI_BASE_URL=str(client.base_url).rstrip("/"),
            OPENAI_API_KEY=client.api_key,
            RLBUS_MODEL=model,
        )
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
            preexec_fn=die_with_parent,  # the event loop runs on the producer's main thread: tied to its life
        )
        try:
            out, err = await proc.communicate(msgspec.json.encode(task))
        except BaseException:  # cancelled or timed out: the process ends with its rollout
            if proc.returncode is None:
                proc.kill()
                await asyncio.shield(proc.wait())
            raise
        if proc.returncode != 0:
            tail = err.decode(errors="replace").strip().splitlines()[-5:]
            raise RuntimeError(f"{argv[0]} exited with code {proc.returncode}: " + " | ".join(tail))
        lines = [line for line in out.decode(errors="replace").splitlines() if line.strip()]
        if not lines:
            return None
        try:
            reward = json.loads(lines[-1])
        except json.JSONDecodeError:
            raise RuntimeError(f"{argv[0]}'s last line {lines[-1][:80]!r} is not a reward (a number or null)") from None
        return reward

    return rollout


class OpenAIAgentLoop(AgentLoop):
    """Runs the configured agent function once per sample against the endpoint; captures what the engine sampled."""

    agent: AgentFn
    agent_name: str  # the function's import path, or the command line
    endpoint: Endpoint
    _http: Any  # one httpx.AsyncClient under every rollout's openai client (making one costs ~30 ms of CPU)
    _started: asyncio.Lock

    def __init__(
        self,
        cfg: RolloutConfig,
        engine: RolloutEngine,
        tokenizer: Any,
        tools: Mapping[str, Tool],
        reward_fn: RewardFn,
        *,
        seed: int | None = None,
        agent: AgentFn | None = None,
        agent_name: str = "",
    ):
        """`agent` (named `agent_name`) is an environment's own agent function (producers/agents/verifiers.py);
        without one, the agent is what rollout.openai names."""
        super().__init__(cfg, engine, tokenizer, tools, reward_fn, seed=seed)
        if agent is not None:
            self.agent, self.agent_name = agent, agent_name or getattr(agent, "__qualname__", "agent")
        elif cfg.openai.command:
            self.agent = command_agent(list(cfg.openai.command), cfg.openai.model)
            self.agent_name = " ".join(cfg.openai.command)
        else:
            self.agent = load_agent(cfg.openai.function)
            self.agent_name = cfg.openai.function
        # An engine may take less than the model's positions (vLLM's max_model_len): the smaller is the context.
        engine_len = getattr(cfg.engine, "max_model_len", 0) or 0
        context = min(model_context(tokenizer), engine_len) if engine_len > 0 else 0
        self.endpoint = Endpoint(engine, tokenizer, cfg, context_len=context)
        self._http = None
        self._started = asyncio.Lock()

    async def _episode(self, traj: Trajectory) -> None:
        raise NotImplementedError("the agent function drives its own turns (rollout_many)")

    async def _ensure_started(self) -> None:
        async with self._started:
            if not self.endpoint.base_url:
                import openai  # here, so that a config without this loop never imports the client

                await self.endpoint.start()
                self._http = openai.DefaultAsyncHttpxClient(timeout=self.cfg.openai.timeout_s)

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        await self.endpoint.close()

    async def rollout_many(self, tasks: list[PromptTask], n: int, *, spare: int = 0) -> list[list[Trajectory]]:
        if spare:  # the config check refuses it: a run of the agent may make several trajectories
            raise ValueError("rollout.redundant_samples: not supported with agent_loop: openai")
        await self._ensure_started()
        runs = await asyncio.gather(*(self._run(task) for task in tasks for _ in range(n)))
        return [[t for run in runs[i * n : (i + 1) * n] for t in run] for i in range(len(tasks))]

    async def _run(self, task: PromptTask) -> list[Trajectory]:
        import openai

        with self.endpoint.conversation() as session:
            # A client per rollout (its own key) over the shared connection pool; closing it would close the pool.
            client = openai.AsyncOpenAI(
                base_url=self.endpoint.base_url,
                api_key=session.key,
                max_retries=0,
                timeout=self.cfg.openai.timeout_s,
                http_client=self._http,
            )
            try:
                reward = await asyncio.wait_for(self.agent(client, task), self.cfg.openai.timeout_s)
            except Exception as e:
                if session.capture.failure is not None:  # the engine failed under the agent: that is the error
                    raise session.capture.failure from e
                raise AgentFailed(
                    f"task {task.task_id}: the agent {self.agent_name} raised {type(e).__name__}: {e}"
                ) from e
        trajs = session.capture.trajectories()
        if not trajs:
            raise AgentFailed(f"task {task.task_id}: the agent {self.agent_name} made no model call")
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))):
            raise AgentFailed(f"task {task.task_id}: the agent returned {reward!r}, not a number or None")
        for traj in trajs:
            t0 = time.perf_counter()
            if reward is None:
                traj.reward = await self.reward_fn(self.decode(traj.response_ids), task.ground_truth, task=task)
            else:
                traj.reward = float(reward)
            traj.reward_time_s = time.perf_counter() - t0
        return trajs
