"""The single-turn agent loop: one assistant turn per sample, then the reward (no tools).

`rollout.agent_loop: single_turn`. The n samples of a group are generated in one batched engine call.

    .venv/bin/python -m pytest -q tests/unit/test_agent_loop.py -k single_turn
"""

from __future__ import annotations

from rlbus.producers.agent_loops.base import AgentLoop, Trajectory


class SingleTurnAgentLoop(AgentLoop):
    async def _episodes(self, trajs: list[Trajectory]) -> None:
        await self.generate_turn(trajs)
        for traj in trajs:
            if not traj.done:
                traj.finish_reason = "stop"
