"""The agent loop of a Gymnasium-style text environment (`env.type: gym`): observations in, sampled actions out.

Each sample of a group has its own environment instance, reset with the task's seed (common/envs/gym.py), so the
group's samples begin alike. A turn: the model generates (mask 1, with log-probs and versions); its text, without
the closing eos, is the action of `env.step(action)`; the observation comes back as a user message, tokenized from
the chat template's own rendering (mask 0), and the model's next turn follows. The episode ends when the
environment says terminated or truncated ("stop"), at rollout.max_turns ("max_turns"), or when the response is out
of tokens ("length"). A turn cut off by a token limit is still stepped, as it is, before the episode ends: the
environment sees every action the policy is trained on. The sample's reward is the sum of the rewards `step` paid.
Each sample's episode runs on its own: one game's slow `step` holds no other sample of its group.

A sample restarted for staleness (partial rollout) begins again on a fresh environment, reset with the same seed.
`step` and `reset` run in the producer's bounded pool of worker threads (producers/blocking.py: a Gymnasium env is
synchronous); one that raises or returns a
non-text observation or a non-finite reward fails the task, which the producer gives back or dead-letters with
the reason; one that hangs is cut off by rollout.episode_timeout_s.

    .venv/bin/python -m pytest -q tests/unit/test_env_gym.py
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Mapping

from rlbus.common.envs.gym import EnvProtocolError, env_factory, observation_text, reset
from rlbus.producers.agent_loops.base import AgentLoop, Trajectory
from rlbus.producers.blocking import in_daemon_thread, run_blocking
from rlbus.producers.engines.base import RolloutEngine
from rlbus.producers.rewards.registry import RewardFn
from rlbus.producers.tools.registry import Tool
from rlbus.schemas.config import RolloutConfig
from rlbus.schemas.env import GymEnvConfig
from rlbus.schemas.wire import ChatMessage, PromptTask


@dataclass
class _Episode:
    env: Any
    restarts: int  # the sample's restart count when this env was reset: a restarted sample needs a fresh one


class GymAgentLoop(AgentLoop):
    env_cfg: GymEnvConfig

    def __init__(self, cfg: RolloutConfig, engine: RolloutEngine, tokenizer: Any, tools: Mapping[str, Tool],
                 reward_fn: RewardFn, *, env: GymEnvConfig, seed: int | None = None):
        super().__init__(cfg, engine, tokenizer, tools, reward_fn, seed=seed)
        self.env_cfg = env
        self._make_env = env_factory(env)
        self._seeds: dict[int, int] = {}  # id(trajectory) -> its task's reset seed

    def start(self, task: PromptTask, n: int) -> list[Trajectory]:
        trajs = super().start(task, n)
        seed = task.extra_info.get("gym_seed")
        if not isinstance(seed, int):
            raise EnvProtocolError(f"task {task.task_id} carries no gym_seed: was it released by a gym environment?")
        for traj in trajs:
            self._seeds[id(traj)] = seed
        return trajs

    async def run_episodes(self, task: PromptTask, trajs: list[Trajectory], keep: int | None = None
                           ) -> list[Trajectory]:
        try:
            return await super().run_episodes(task, trajs, keep)
        finally:
            for traj in trajs:
                self._seeds.pop(id(traj), None)

    async def _fresh(self, traj: Trajectory, ep: _Episode | None) -> _Episode:
        """The sample's environment, made and reset anew if it has none yet or the sample restarted since."""
        if ep is not None and ep.restarts == traj.restarts:
            return ep
        if ep is not None:
            in_daemon_thread(_close, ep.env)
        env = await run_blocking(self._make_env)
        first = await run_blocking(reset, env, self._seeds[id(traj)])
        if first != traj.messages[traj.num_prompt_messages - 1].content:
            raise EnvProtocolError(f"reset(seed={self._seeds[id(traj)]}) gives another first observation than the "
                                   "task was released with: the environment is not deterministic in its seed")
        return _Episode(env=env, restarts=traj.restarts)

    async def _episode(self, traj: Trajectory) -> None:
        ep: _Episode | None = None
        try:
            while not traj.done:
                ep = await self._fresh(traj, ep)
                text = await self.generate_turn(traj)
                ep = await self._fresh(traj, ep)  # a sample restarted during the turn acts on a fresh episode
                await self._step(traj, text, ep)
        finally:
            # Not awaited: an env that hung in step() may hang in close() too, and the episode timeout must fire.
            if ep is not None:
                in_daemon_thread(_close, ep.env)

    async def _step(self, traj: Trajectory, action: str, ep: _Episode) -> None:
        """Give the turn to the environment. A turn cut off by a token limit ("length") is stepped as it is: the
        environment sees every action the policy is trained on, and pays for it; the episode then ends there."""
        cut = traj.done
        t0 = time.perf_counter()
        out = await run_blocking(ep.env.step, action)
        traj.tool_time_s += time.perf_counter() - t0  # the environment's time, as a tool call's
        if not isinstance(out, tuple) or len(out) not in (4, 5):
            raise EnvProtocolError(f"step() returned {type(out).__name__}; expected (obs, reward, terminated, "
                                   "truncated, info)")
        obs, reward = out[0], out[1]
        done = bool(out[2]) or (len(out) == 5 and bool(out[3]))
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise EnvProtocolError(f"step() returned reward {reward!r}; expected a finite number")
        traj.env_return += float(reward)
        if cut:
            return
        if done:
            traj.finish_reason = "stop"
            return
        if traj.num_turns >= self.cfg.max_turns:
            traj.finish_reason = "max_turns"
            return
        message = ChatMessage(role="user", content=observation_text(obs, "step()"))
        inserted = self.inserted_ids(traj.messages, [message])
        if len(traj.response_ids) + len(inserted) >= self.cfg.max_response_tokens:
            traj.finish_reason = "length"  # no room left for even one more generated token
            return
        traj.messages.append(message)
        traj.add_inserted(inserted)

    async def score_one(self, task: PromptTask, traj: Trajectory) -> None:
        """The environment scored the episode as it went: the reward is what its steps paid."""
        traj.reward = traj.env_return

def _close(env: Any) -> None:
    if hasattr(env, "close"):
        try:
            env.close()
        except Exception:  # noqa: BLE001 - the episode is over; a failing close() must not fail the task after it
            pass
