"""Which agent loop runs a run's episodes: the environment's own (gym, verifiers), else `rollout.agent_loop`.

Kept apart from the loops themselves so that the base class never imports its subclasses; each loop is imported
only when a run asks for it (a config without vLLM or the OpenAI client never imports them).

    loop = make_agent_loop(cfg, engine, tokenizer, tools, reward_fn)
"""

from __future__ import annotations

from typing import Any, Mapping

from rlbus.producers.agent_loops.base import AgentLoop
from rlbus.producers.engines.base import RolloutEngine
from rlbus.producers.rewards.registry import RewardFn
from rlbus.producers.tools.registry import Tool
from rlbus.schemas.config import RunConfig
from rlbus.schemas.env import GymEnvConfig, VerifiersEnvConfig


def make_agent_loop(cfg: RunConfig, engine: RolloutEngine, tokenizer: Any, tools: Mapping[str, Tool],
                    reward_fn: RewardFn, *, seed: int | None = None) -> AgentLoop:
    """The agent loop of `cfg.env` (gym, verifiers) or, for tasks from data and reasoning-gym, `rollout.agent_loop`."""
    args = (cfg.rollout, engine, tokenizer, tools, reward_fn)
    if isinstance(cfg.env, GymEnvConfig):
        from rlbus.producers.agent_loops.gym import GymAgentLoop

        return GymAgentLoop(*args, env=cfg.env, seed=seed)
    if isinstance(cfg.env, VerifiersEnvConfig):
        from rlbus.producers.agent_loops.openai_agent import OpenAIAgentLoop
        from rlbus.producers.agents.verifiers import verifiers_agent

        agent, name = verifiers_agent(cfg)
        return OpenAIAgentLoop(*args, seed=seed, agent=agent, agent_name=name)
    if cfg.rollout.agent_loop == "openai":
        from rlbus.producers.agent_loops.openai_agent import OpenAIAgentLoop

        return OpenAIAgentLoop(*args, seed=seed)
    if cfg.rollout.agent_loop == "single_turn":
        from rlbus.producers.agent_loops.single_turn import SingleTurnAgentLoop

        return SingleTurnAgentLoop(*args, seed=seed)
    from rlbus.producers.agent_loops.tool import ToolAgentLoop

    return ToolAgentLoop(*args, seed=seed)
