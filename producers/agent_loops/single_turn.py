"""The single-turn agent loop: one assistant turn per sample, then the reward (no tools).

`rollout.agent_loop: single_turn`. Each sample is its own engine call; the engine batches the group's calls (they
are ready together) with whatever else is ready.

    .venv/bin/python -m pytest -q tests/unit/test_agent_loop.py -k single_turn
"""

from __future__ import annotations

from rlbus.producers.agent_loops.base import AgentLoop, Trajectory


class SingleTurnAgentLoop(AgentLoop):
    async def _episode(self, traj: Trajectory) -> None:
        await self.generate_turn(traj)
        if not traj.done:
            traj.finish_reason = "stop"
