"""The single-turn agent loop: one assistant turn per sample, then the reward (no tools).

`rollout.agent_loop: single_turn`. The n samples of a group are generated in one batched engine call.

    .venv/bin/python -m pytest -q tests/unit/test_agent_loop.py -k single_turn
"""

from __future__ import annotations

from rlbus.producers.agent_loops.base import AgentLoop, Trajectory
from rlbus.schemas.wire import PromptTask


class SingleTurnAgentLoop(AgentLoop):
    async def rollout_group(self, task: PromptTask, n: int) -> list[Trajectory]:
        trajs = self.start(task, n)
        await self.generate_turn(trajs)
        for traj in trajs:
            if not traj.done:
                traj.finish_reason = "stop"
        await self.score(task, trajs)
        return trajs
