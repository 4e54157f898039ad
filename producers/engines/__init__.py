"""Rollout engines behind one interface (base.RolloutEngine); `make_engine` picks one from `rollout.engine.type`.

Backends are imported only when chosen: the simulated engine needs no torch model, and vLLM is an optional extra
that exists only on GPU machines.
"""

from __future__ import annotations

from rlbus.producers.engines.base import Generation, RolloutEngine, SamplingParams
from rlbus.schemas.config import HFEngineConfig, RunConfig, SimulatedEngineConfig, VLLMEngineConfig
from rlbus.schemas.errors import ConfigError

__all__ = ["Generation", "RolloutEngine", "SamplingParams", "make_engine"]


def make_engine(cfg: RunConfig, *, model_path: str | None = None, version: int = 0,
                instance: str = "") -> RolloutEngine:
    """The engine `cfg.rollout.engine` asks for, loaded from `model_path` (default `cfg.model.path`). `instance`
    names the engine among several built from one config (the producer id): the simulated engine draws its
    lengths from a stream of its own, so producers' long tails do not fall in step."""
    engine_cfg = cfg.rollout.engine
    if isinstance(engine_cfg, SimulatedEngineConfig):
        from rlbus.producers.engines.simulated import SimulatedEngine

        return SimulatedEngine(engine_cfg, version=version, instance=instance)
    path = model_path or cfg.model.path
    if isinstance(engine_cfg, HFEngineConfig):
        from rlbus.producers.engines.hf import HFEngine

        return HFEngine(path, engine_cfg, version=version)
    if isinstance(engine_cfg, VLLMEngineConfig):
        from rlbus.producers.engines.vllm import VLLMEngine

        return VLLMEngine(path, engine_cfg, version=version, trust_remote_code=cfg.model.trust_remote_code)
    raise ConfigError("rollout.engine.type", f"unknown engine {type(engine_cfg).__name__}")
