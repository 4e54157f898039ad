"""`verifiers` environments (verifiers 0.4, its `verifiers.v1` stack) as rlbus tasks: the rows of the environment's
taskset become examples; a producer finds the row again and runs the environment's own episode on it
(producers/agents/verifiers.py).

    env:
      type: verifiers
      load: my_envs:load          # a function returning a verifiers.v1.Env, called with `args`
      args: {num_tasks: 1000}
      num_heldout: 64             # the last 64 rows are the evaluator's, never trained (0: the env's eval split)

A released task carries where its row is (`extra_info`: vf_split, vf_idx, and vf_key, the row's verifiers
`Task.key`), nothing else of the environment: a producer loads the same environment and refuses a row whose key
differs (the environment changed between machines). The example's prompt is the row's system prompt and prompt,
for the feeder's log and length filter; the prompt the model sees is the one the environment's harness sends.

Held-out rows: with `num_heldout`, the last `num_heldout` rows of the taskset, which training then leaves out;
without, the environment's own eval split: a load function with a `split` parameter is called with
split="train" for training and split="eval" for the evaluator (verifiers 0.4 has no split of its own). Either
way a held-out row with a training row's content (its task data but the position) is dropped: verifiers' own key
holds the position, so it alone would let a row in at another index.

    .venv/bin/python -m pytest -q tests/integration/test_env_verifiers.py
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from rlbus.common.data.datasets import Example
from rlbus.common.imports import import_object
from rlbus.schemas.env import VerifiersEnvConfig
from rlbus.schemas.errors import ConfigError
from rlbus.schemas.wire import ChatMessage

INSTALL = "pip install 'rlbus[verifiers]'"
SPLITS = ("train", "eval")  # what extra_info's vf_split names: the environment a row comes from


def import_verifiers() -> Any:
    """`verifiers.v1`, or a ConfigError saying how to install it."""
    try:
        return importlib.import_module("verifiers.v1")
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] == "verifiers":
            raise ConfigError("env.load", f"env.type verifiers needs the verifiers package: {INSTALL}") from None
        raise


def _parameters(fn: Any) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin or a class without a signature
        return set()


def load_environment(cfg: VerifiersEnvConfig, split: str = "train") -> Any:
    """The environment `env.load` returns (its `split` when it has eval rows of its own), its taskset bounded."""
    vf = import_verifiers()
    obj = import_object(cfg.load, "env.load")
    if not isinstance(obj, vf.Env):
        if not callable(obj):
            raise ConfigError("env.load", f"{cfg.load!r} is neither a function nor a verifiers environment")
        args = dict(cfg.args)
        if "split" in _parameters(obj):
            if "split" in args:
                raise ConfigError("env.args.split", "is rlbus's to set: 'train' for training, 'eval' for held-out")
            args["split"] = split
        elif split != "train":
            raise ConfigError("env.num_heldout", f"{cfg.load!r} has no eval split (no `split` parameter): set "
                                                 "env.num_heldout to keep rows of its taskset out of training")
        try:
            obj = obj(**args)
        except TypeError as e:  # an argument the function does not take
            raise ConfigError("env.args", f"{cfg.load!r}: {e}") from None
    if not isinstance(obj, vf.Env):
        raise ConfigError("env.load", f"{cfg.load!r} gave a {type(obj).__name__}, not a verifiers environment "
                                      "(verifiers.v1.Env, e.g. from vf.load_environment)")
    if not obj.taskset.bounded:
        raise ConfigError("env.load", f"{cfg.load!r}: the taskset of {obj.config.env_id!r} is infinite; bound it "
                                      "in the load function (env.taskset = env.taskset.take(n))")
    return obj


def rows(env: Any) -> list[Any]:
    """The environment's tasks (verifiers `Task`s), in taskset order: a row's index is its position here."""
    return list(env.taskset)


def _content(task: Any) -> str:
    """A row's identity apart from its position: the hash of its task data without `idx`."""
    from verifiers.v1.task import task_key

    return task_key(task.data.model_dump(mode="json", exclude_none=True, exclude={"idx"}))


def _prompt(data: Any) -> list[ChatMessage]:
    from verifiers.v1.types import content_text

    out = [ChatMessage(role="system", content=data.system_prompt)] if data.system_prompt else []
    if isinstance(data.prompt, str):
        out.append(ChatMessage(role="user", content=data.prompt))
    else:
        out += [ChatMessage(role=m.role, content=content_text(m.content)) for m in data.prompt or []]
    return out


def _example(env: Any, split: str, index: int, task: Any) -> Example:
    answer = getattr(task.data, "answer", None)
    return Example(
        prompt=_prompt(task.data),
        ground_truth="" if answer is None else str(answer),
        data_source=f"verifiers/{env.config.env_id}",
        extra_info={"vf_split": split, "vf_idx": index, "vf_key": task.key},
    )


def examples(cfg: VerifiersEnvConfig, split: str = "train", num: int = 0) -> list[Example]:
    """The training rows (all but the last env.num_heldout), or up to `num` held-out rows (0: all of them)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be train or heldout, not {split!r}")
    env = load_environment(cfg, "train")
    train = rows(env)
    if cfg.num_heldout and cfg.num_heldout >= len(train):
        raise ConfigError("env.num_heldout", f"is {cfg.num_heldout}, but {env.config.env_id!r} has {len(train)} "
                                             "rows: none would be left to train on")
    kept = len(train) - cfg.num_heldout
    if split == "train":
        return [_example(env, "train", i, task) for i, task in enumerate(train[:kept])]
    seen = {_content(task) for task in train[:kept]}
    if cfg.num_heldout:
        held = [_example(env, "train", i, task) for i, task in enumerate(train)
                if i >= kept and _content(task) not in seen]
    else:
        eval_env = load_environment(cfg, "eval")
        held = [_example(eval_env, "eval", i, task) for i, task in enumerate(rows(eval_env))
                if _content(task) not in seen]
    return held[:num] if num > 0 else held
