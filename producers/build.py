"""The rollout stack of a producer -- model, tokenizer, tools, reward, engine, agent loop -- built in one place.

The producer service (`rlbus producer`) and the dry run (`rlbus rollout`) both call `build_rollout`, so what a dry
run shows is what a producer runs.

    stack = build_rollout(cfg)
    group = await stack.agent_loop.rollout_group(task, cfg.rollout.n)
    await stack.engine.close()
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from rlbus.common.model.ensure import ensure_model
from rlbus.producers.agent_loops import AgentLoop, make_agent_loop
from rlbus.producers.blocking import configure as configure_blocking
from rlbus.producers.engines import RolloutEngine, make_engine
from rlbus.producers.rewards import env_reward
from rlbus.producers.tools import Tool, load_tools
from rlbus.schemas.config import RunConfig


@dataclass(frozen=True)
class RolloutStack:
    model_path: str  # the local model directory the engine was built from
    tokenizer: PreTrainedTokenizerBase  # the model's tokenizer, with its chat template
    tools: dict[str, Tool]
    engine: RolloutEngine
    agent_loop: AgentLoop


def build_rollout(cfg: RunConfig, *, seed: int | None = None, instance: str = "") -> RolloutStack:
    """Everything `cfg.model`, `cfg.env` and `cfg.rollout` describe, ready to roll out (the model is built first if the config
    asks for it). `seed` makes the agent loop's sampling reproducible (the dry run); None leaves it random.
    `instance` (the producer id) tells apart the random streams of engines built from one config."""
    configure_blocking(cfg.rollout.blocking_slots)
    model_path = ensure_model(cfg.model)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tools = load_tools(cfg.rollout.tools)
    engine = make_engine(cfg, model_path=model_path, instance=instance)
    agent_loop = make_agent_loop(cfg, engine, tokenizer, tools, env_reward(cfg), seed=seed)
    return RolloutStack(model_path=model_path, tokenizer=tokenizer, tools=tools, engine=engine,
                        agent_loop=agent_loop)
