"""An environment's tasks, for the roles that release and evaluate them (the feeder, the evaluator, the dry run).

    dataset = load_tasks(cfg, tokenizer)                    # what the feeder releases
    heldout = load_heldout_tasks(cfg, 64, tokenizer)        # what the evaluator scores, none of it in training

`env.type: data` reads the `data` section (common/data); the other types build their examples from the library
they adapt (reasoning_gym.py, gym.py, verifiers.py). Either way the result is a `PromptDataset` of `Example`s, with
prompts over data.max_prompt_tokens skipped, so everything downstream of it is one path.

    .venv/bin/python -m pytest -q tests/unit/test_env_reasoning_gym.py tests/unit/test_env_gym.py
"""

from __future__ import annotations

import importlib
from typing import Any

from rlbus.common.data.datasets import Example, PromptDataset, drop_long, load_dataset, load_heldout
from rlbus.schemas.config import RunConfig

#: env.type -> the module (of this package) whose `examples(env_cfg, split, num)` builds that environment's tasks.
_ADAPTERS = {"reasoning_gym": "reasoning_gym", "gym": "gym", "verifiers": "verifiers"}


def env_type(cfg: RunConfig) -> str:
    return cfg.env.__struct_config__.tag


def _examples(cfg: RunConfig, split: str, num: int) -> list[Example]:
    module = importlib.import_module(f"rlbus.common.envs.{_ADAPTERS[env_type(cfg)]}")
    return module.examples(cfg.env, split, num)


def _dataset(examples: list[Example], name: str, cfg: RunConfig, tokenizer: Any) -> PromptDataset:
    if tokenizer is not None:
        examples = drop_long(examples, cfg.data.max_prompt_tokens, tokenizer, name)
    for i, ex in enumerate(examples):
        ex.index = i
    return PromptDataset(examples, name)


def load_tasks(cfg: RunConfig, tokenizer: Any = None) -> PromptDataset:
    """The training tasks of the run's environment."""
    if env_type(cfg) == "data":
        return load_dataset(cfg.data, tokenizer)
    return _dataset(_examples(cfg, "train", 0), f"{env_type(cfg)} train", cfg, tokenizer)


def load_heldout_tasks(cfg: RunConfig, num_examples: int, tokenizer: Any = None) -> PromptDataset:
    """Up to `num_examples` evaluation tasks of the run's environment, none of them a training task."""
    if env_type(cfg) == "data":
        return load_heldout(cfg.data, num_examples, tokenizer)
    return _dataset(_examples(cfg, "heldout", num_examples), f"{env_type(cfg)} held-out", cfg, tokenizer)


__all__ = ["env_type", "load_heldout_tasks", "load_tasks"]
