"""reasoning-gym's procedural tasks as an environment: tasks by name with their generator settings, a held-out split
that shares no question with training, and each task's own `score_answer` as the reward.

    env:
      type: reasoning_gym
      tasks: [{name: gcd, config: {max_value: 200}}, {name: letter_counting, weight: 2}]
      size: 2048

Each task of a composite is its own data set of `size x weight / total` examples, generated with a seed derived
from `env.seed` and the task's position; the examples are interleaved. A released task carries where it came from
(`extra_info`: rg_task, rg_index); the producer generates that entry again from the same settings (generation is
deterministic and cheap) and scores the response with the data set that made it, so nothing but names and numbers
crosses the bus, and a producer whose reasoning-gym generates something else says so instead of scoring nonsense.

The answer is read from the response (its chat control tokens, such as the closing <|im_end|>, removed) as
`env.answer_format` says (the text after the last "Answer:", or the last <answer>...</answer>);
`rollout.format_reward` is added to the score when it is found there. With `env.lenient`, a response with no
answer in that format is scored on its last line from its last "=" or ":" on, with no format reward.

reasoning-gym imports `pycosat` (on PyPI a C extension, no binary wheel) with every task, and one generator,
zebra_puzzles, solves with it. The `reasoning-gym` extra installs rlbus's pure-Python pycosat
(packaging/pycosat/pycosat.py) under that name: every task works, zebra_puzzles included, with the puzzles pycosat
makes. Where no pycosat is installed at all (reasoning-gym installed with --no-deps), `import_reasoning_gym` loads
that file from the clone in its place while reasoning-gym imports.

    .venv/bin/python -m pytest -q tests/unit/test_env_reasoning_gym.py
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import importlib.util
import json
import math
import re
import sys
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Any

from rlbus.common.data.datasets import Example
from rlbus.schemas.env import ReasoningGymEnvConfig, ReasoningGymTask
from rlbus.schemas.errors import ConfigError, RlbusError
from rlbus.schemas.wire import ChatMessage, PromptTask

#: The held-out split's generator seed is the training seed plus this (per task), questions in training removed.
HELDOUT_SEED_OFFSET = 1000
_ANSWER_LINE = re.compile(r"answer\s*:", re.IGNORECASE)
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
#: A chat template's control tokens as text (<|im_end|>, <|endoftext|>, ...): the response is decoded keeping them.
_CONTROL = re.compile(r"<\|[^|<>]{1,40}\|>")
#: rlbus's pure-Python pycosat, the module of the distribution the `reasoning-gym` extra installs as `pycosat`.
STAND_IN = Path(__file__).resolve().parents[2] / "packaging" / "pycosat" / "pycosat.py"


class TaskMismatch(RlbusError):
    """A producer generated a different entry for a released task than the feeder did (reasoning-gym versions
    differ between machines): scoring it would reward the wrong answer."""


def import_reasoning_gym() -> Any:
    """The `reasoning_gym` package; or a ConfigError saying how to install it. Where no pycosat is installed, rlbus's
    pure-Python one (`STAND_IN`) stands for it only while reasoning-gym imports: it is taken out of `sys.modules`
    again once reasoning-gym holds it, so nothing else finds a `pycosat` that is not installed. After this call
    `import reasoning_gym` works anywhere in the process."""
    try:
        return importlib.import_module("reasoning_gym")
    except ModuleNotFoundError as e:
        if e.name == "reasoning_gym":
            raise ConfigError("env.type", "reasoning_gym needs the reasoning-gym package: "
                                          "pip install -e '.[reasoning-gym]' in rlbus's clone "
                                          "(docs/environments.md)") from None
        if e.name != "pycosat":
            raise
    if not STAND_IN.is_file():  # rlbus installed from a wheel, not from its clone
        raise ConfigError("env.type", "reasoning-gym is installed without pycosat: pip install -e "
                                      "'.[reasoning-gym]' in rlbus's clone installs a pure-Python one "
                                      "(docs/environments.md)")
    for name in [m for m in sys.modules if m == "reasoning_gym" or m.startswith("reasoning_gym.")]:
        del sys.modules[name]  # the half-imported package, so that it imports again whole
    sys.modules["pycosat"] = load_stand_in()
    try:
        return importlib.import_module("reasoning_gym")
    finally:
        del sys.modules["pycosat"]


def load_stand_in() -> ModuleType:
    """rlbus's pure-Python pycosat, loaded from its file in the clone (whatever `import pycosat` would find)."""
    spec = importlib.util.spec_from_file_location("pycosat", STAND_IN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _task_sizes(cfg: ReasoningGymEnvConfig, total: int) -> list[int]:
    """Examples per task: `total` split by weight (largest remainders), each task at least one."""
    weights = [t.weight for t in cfg.tasks]
    shares = [total * w / sum(weights) for w in weights]
    sizes = [max(1, math.floor(s)) for s in shares]
    by_remainder = sorted(range(len(sizes)), key=lambda i: shares[i] - math.floor(shares[i]), reverse=True)
    for i in by_remainder[: max(0, total - sum(sizes))]:
        sizes[i] += 1
    return sizes


def _task_seed(cfg: ReasoningGymEnvConfig, position: int, split: str) -> int:
    return cfg.seed + 7919 * position + (HELDOUT_SEED_OFFSET if split == "heldout" else 0)


def task_errors(cfg: ReasoningGymEnvConfig) -> list[ConfigError]:
    """What is wrong with `env.tasks`, each error naming its task by position: a name reasoning-gym does not have,
    a generator setting its task does not take, or settings its config refuses. The config of each task is built
    and validated as `reasoning_gym.create_dataset` does, at the task's own seed and size, without generating a
    question (microseconds); `rlbus config show`, `rlbus up`, the feeder and the scorer all check with it."""
    import_reasoning_gym()
    from reasoning_gym.factory import DATASETS

    errors = []
    for pos, (task, size) in enumerate(zip(cfg.tasks, _task_sizes(cfg, cfg.size))):
        at = f"env.tasks[{pos}]"
        if task.name not in DATASETS:
            near = difflib.get_close_matches(task.name, DATASETS, n=4)
            hint = (f"did you mean {', '.join(near)}?" if near else
                    f"its {len(DATASETS)} tasks include {', '.join(sorted(DATASETS)[:6])}, ...: "
                    "reasoning_gym.factory.DATASETS lists them")
            errors.append(ConfigError(f"{at}.name", f"reasoning-gym has no task {task.name!r} ({hint})"))
            continue
        config_cls = DATASETS[task.name][1]
        settings = sorted(f.name for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size"))
        unknown = [key for key in task.config if key not in settings]
        for key in unknown:
            near = difflib.get_close_matches(key, settings, n=1)
            errors.append(ConfigError(f"{at}.config.{key}", f"{task.name} has no setting {key!r}"
                                      + (f" (did you mean {near[0]}?)" if near else "")
                                      + f"; its settings: {', '.join(settings) or 'none'}"))
        if unknown:
            continue
        try:
            config = config_cls(**task.config, seed=_task_seed(cfg, pos, "train"), size=size)
            if hasattr(config, "validate"):
                config.validate()
        except (TypeError, ValueError, AssertionError) as e:  # a value out of range, of the wrong type
            errors.append(ConfigError(f"{at}.config", f"{task.name}: {type(e).__name__}: {e}"))
    return errors


def check_tasks(cfg: ReasoningGymEnvConfig) -> None:
    """Raise the first of `task_errors(cfg)`."""
    errors = task_errors(cfg)
    if errors:
        raise errors[0]


@lru_cache(maxsize=64)
def _dataset(name: str, config_json: str, seed: int, size: int) -> Any:
    rg = import_reasoning_gym()
    return rg.create_dataset(name, seed=seed, size=size, **json.loads(config_json))


def task_dataset(task: ReasoningGymTask, position: int, seed: int, size: int) -> Any:
    """The reasoning-gym data set of the task at `position` of env.tasks, at `seed` and `size` (its generator
    settings from the config, checked first by `check_tasks`)."""
    try:
        return _dataset(task.name, json.dumps(task.config, sort_keys=True), seed, size)
    except (TypeError, ValueError, AssertionError) as e:  # settings its config takes but its generator refuses
        raise ConfigError(f"env.tasks[{position}].config", f"{task.name}: {type(e).__name__}: {e}") from None


def _prompt(cfg: ReasoningGymEnvConfig, question: str) -> list[ChatMessage]:
    text = f"{question}\n{cfg.instruction}" if cfg.instruction else question
    system = [ChatMessage(role="system", content=cfg.system_prompt)] if cfg.system_prompt else []
    return [*system, ChatMessage(role="user", content=text)]


def _split(cfg: ReasoningGymEnvConfig, split: str, total: int) -> list[tuple[int, list[tuple[int, dict]]]]:
    """Per task, the size its data set is generated at and the (index, entry) pairs of the split."""
    out = []
    for pos, (task, size) in enumerate(zip(cfg.tasks, _task_sizes(cfg, total))):
        ds = task_dataset(task, pos, _task_seed(cfg, pos, split), size)
        out.append((size, [(i, ds[i]) for i in range(size)]))
    return out


def examples(cfg: ReasoningGymEnvConfig, split: str = "train", num: int = 0) -> list[Example]:
    """The training split (`env.size` examples), or up to `num` held-out examples (generated at seeds of their own)
    none of whose questions is in the training split."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be train or heldout, not {split!r}")
    check_tasks(cfg)
    if split == "train":
        per_task = _split(cfg, "train", cfg.size)
    else:
        seen = {entry["question"] for _, entries in _split(cfg, "train", cfg.size) for _, entry in entries}
        per_task = [(size, [(i, e) for i, e in entries if e["question"] not in seen])
                    for size, entries in _split(cfg, "heldout", num)]
        for pos, (task, (size, entries)) in enumerate(zip(cfg.tasks, per_task)):
            if not entries:  # a generator with few distinct questions at these settings: training has them all
                raise ConfigError(f"env.tasks[{pos}].config",
                                  f"{task.name}: no held-out question: all {size} generated for the evaluator are in "
                                  f"the training split (env.size {cfg.size}); widen the generator's settings or lower "
                                  "env.size")
    out: list[Example] = []
    longest = max(len(entries) for _, entries in per_task)
    for k in range(longest):  # interleaved task by task (the feeder shuffles them again)
        for pos, (task, (size, entries)) in enumerate(zip(cfg.tasks, per_task)):
            if k < len(entries):
                index, entry = entries[k]
                out.append(Example(
                    prompt=_prompt(cfg, entry["question"]),
                    ground_truth=str(entry["answer"]),
                    data_source=f"reasoning_gym/{task.name}",
                    extra_info={"rg_task": task.name, "rg_position": pos, "rg_split": split, "rg_index": index,
                                "rg_size": size},
                ))
    return out


def extract_answer(text: str, answer_format: str) -> str | None:
    """The answer a response gives in `answer_format` ("line" or "tag"), or None when it gives none."""
    if answer_format == "tag":
        found = _ANSWER_TAG.findall(text)
        return found[-1].strip() if found else None
    matches = list(_ANSWER_LINE.finditer(text))
    if not matches:
        return None
    return _clean(text[matches[-1].end():].strip().splitlines()[0] if text[matches[-1].end():].strip() else "")


def _clean(answer: str) -> str:
    """What small models wrap an answer in: markdown bold, LaTeX dollars or \\boxed{}, a closing full stop."""
    answer = answer.strip().strip("*").strip()
    boxed = re.fullmatch(r"\\boxed\{(.*)\}", answer.strip("$ "))
    answer = boxed.group(1) if boxed else answer.strip("$").strip()
    return answer[:-1].rstrip() if answer.endswith(".") and not answer[:-1].rstrip().endswith(".") else answer


def last_line(text: str) -> str:
    """The lenient reading: the response's last line, from its last "=" or ":" on ("5 + 8 = 13", "The answer is: 13")."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return ""
    return _clean(re.split(r"[=:]", lines[-1])[-1])


class ReasoningGymScorer:
    """Scores a response to a released reasoning-gym task with the data set that generated it."""

    def __init__(self, cfg: ReasoningGymEnvConfig, format_reward: float = 0.0):
        check_tasks(cfg)  # a producer with a task reasoning-gym does not have fails at start, not at its first score
        self.cfg = cfg
        self.format_reward = format_reward

    def entry(self, task: PromptTask) -> tuple[Any, dict]:
        info = task.extra_info
        try:
            pos, index, size, split = int(info["rg_position"]), int(info["rg_index"]), int(info["rg_size"]), str(
                info["rg_split"])
        except (KeyError, TypeError, ValueError):
            raise TaskMismatch(f"task {task.task_id} carries no reasoning-gym origin (extra_info rg_*): was it "
                               "released by a reasoning_gym environment?") from None
        if not 0 <= pos < len(self.cfg.tasks) or self.cfg.tasks[pos].name != info.get("rg_task"):
            raise TaskMismatch(f"task {task.task_id} is of reasoning-gym task {info.get('rg_task')!r}, which this "
                               "producer's env.tasks does not have at that position (configs differ?)")
        ds = task_dataset(self.cfg.tasks[pos], pos, _task_seed(self.cfg, pos, split), size)
        entry = ds[index]
        if str(entry["answer"]) != task.ground_truth:
            raise TaskMismatch(f"task {task.task_id}: this producer's reasoning-gym generates answer "
                               f"{str(entry['answer'])!r} for it, the feeder's {task.ground_truth!r} (versions differ?)")
        return ds, entry

    def __call__(self, response_text: str, ground_truth: str, *, task: PromptTask) -> float:
        ds, entry = self.entry(task)
        response_text = _CONTROL.sub("", response_text)
        answer = extract_answer(response_text, self.cfg.answer_format)
        bonus = self.format_reward if answer is not None else 0.0
        if answer is None and self.cfg.lenient:
            answer = last_line(response_text)
        score = ds.score_answer(answer, entry) if answer is not None else 0.0
        return float(score) + bonus
