"""Agent loops: turn a PromptTask into a group of scored trajectories on a rollout engine."""

from rlbus.producers.agent_loops.base import AgentLoop, Trajectory
from rlbus.producers.agent_loops.registry import make_agent_loop

__all__ = ["AgentLoop", "Trajectory", "make_agent_loop"]
