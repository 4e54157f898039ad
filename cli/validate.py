"""Every error a run config can hold beyond its schema, found before anything starts.

The schema (schemas/) checks types, ranges and how fields fit together; what it cannot know is whether the names a
config gives exist: a reasoning-gym task and its generator settings, a gymnasium id or `env.make`, a verifiers
`env.load`, the `rollout.reward` / `rollout.tools` / `rollout.openai.function` import paths, a model directory
(or the GGUF file or `init_if_missing` that makes one), the judge's, the critic's and the distillation teacher's
models (the teacher's tokenizer against the student's), the W&B package.
`config_errors(cfg)` checks them all, with the functions the roles check them with where they meet them (so a
role started alone says the same), and nothing heavier: no model is built or loaded, no data set generated, no
environment constructed, and a verifiers environment is found in its source rather than imported (verifiers
takes ~10 s to import). Import paths resolve as the roles resolve them, the current directory on the path.

    rlbus config show configs/quickstart.yaml env.type=reasoning_gym 'env.tasks=[{name: gcd}]'   # exit 2 on error
    rlbus up ...        # checks first: a config error exits 2 before the bus, Ray or any role starts

The roles do not run the whole check again: each checks what it uses, where it uses it (a producer on another
machine need not hold the trainer's critic, nor the trainer the producers' tools). A role that exits with
CONFIG_ERROR_EXIT refused its config; `rlbus up` stops the run then instead of restarting it (cli/launcher.py).

    .venv/bin/python -m pytest -q tests/unit/test_validate.py
"""

from __future__ import annotations

import ast
import difflib
import importlib.machinery
import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlbus.common.imports import cwd_on_path
from rlbus.schemas.config import RunConfig
from rlbus.schemas.env import DataEnvConfig, GymEnvConfig, ReasoningGymEnvConfig, VerifiersEnvConfig
from rlbus.schemas.errors import ConfigError

#: The exit status of a command or role that refused its config (`rlbus: config error: ...`); argparse's too.
CONFIG_ERROR_EXIT = 2


class ConfigInvalid(ConfigError):
    """Several errors of one config; the message lists each on its own line."""

    errors: list[ConfigError]

    def __init__(self, errors: list[ConfigError]):
        self.errors = list(errors)
        super().__init__("", f"{len(self.errors)} errors:\n" + "\n".join(f"  {e}" for e in self.errors))


def check_config(cfg: RunConfig) -> None:
    """Raise what `config_errors(cfg)` finds: the one ConfigError, or a ConfigInvalid listing them all."""
    errors = config_errors(cfg)
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise ConfigInvalid(errors)


def config_errors(cfg: RunConfig) -> list[ConfigError]:
    """Every error of `cfg` beyond its schema, each naming its field; [] when there is none."""
    return [*_model_errors(cfg), *_env_errors(cfg), *_rollout_errors(cfg), *_logging_errors(cfg), *_sft_errors(cfg)]


def _sft_errors(cfg: RunConfig) -> list[ConfigError]:
    """trainer.sft's conversation files exist (what the trainer's load_conversations would refuse at start)."""
    sft = cfg.trainer.sft
    return [ConfigError(f"trainer.sft.{field}", f"{path} does not exist")
            for field, path in (("data", sft.data), ("eval_data", sft.eval_data)) if path and not Path(path).is_file()]


def _caught(check: Callable[[], Any]) -> list[ConfigError]:
    try:
        check()
    except ConfigError as e:
        return [e]
    return []


# ------------------------------------------------------------------------------------------------- models


def _model_dir(field: str, path: str, gguf: str, gguf_field: str, *, init_if_missing: bool,
               how: str) -> list[ConfigError]:
    """A model directory is ready, or will be made: from a GGUF file that exists, or by init_if_missing."""
    from rlbus.common.model.ensure import model_ready

    if model_ready(Path(path)):
        return []
    if gguf:
        from rlbus.common.model.gguf import GGUFImportError, resolve_gguf

        try:
            resolve_gguf(gguf)
        except GGUFImportError as e:
            return [ConfigError(gguf_field, str(e))]
        return []
    if init_if_missing:
        return []
    return [ConfigError(field, f"{path} holds no model (config.json + *.safetensors); {how}")]


def _model_errors(cfg: RunConfig) -> list[ConfigError]:
    from rlbus.common.model.ensure import model_ready

    m = cfg.model
    errors = _model_dir("model.path", m.path, m.gguf, "model.gguf", init_if_missing=m.init_if_missing,
                        how="run `rlbus init-model DIR` or set model.init_if_missing=true (or model.gguf)")
    if cfg.judge.model and not cfg.judge.url:  # `rlbus up` serves the judge from this directory (`rlbus judge`)
        errors += _model_dir("judge.model", cfg.judge.model, cfg.judge.gguf, "judge.gguf", init_if_missing=False,
                             how="give judge.gguf to import one there, or `rlbus init-model` it")
    c = cfg.critic
    if cfg.algorithm.adv_estimator == "gae" and c.backbone == "separate" and c.path:
        errors += _model_dir("critic.path", c.path, "", "", init_if_missing=False,
                             how="give the critic's initial weights, or leave critic.path empty for model.path's")
    if cfg.algorithm.distill.enabled:  # a student not built yet: its producers compare the tokenizers once it is
        from rlbus.common.teacher import check_teacher

        student = m.path if model_ready(Path(m.path)) else None
        errors += _caught(lambda: check_teacher(cfg.algorithm.distill.teacher, student))
    return errors


# ------------------------------------------------------------------------------------------------- environments


def _env_errors(cfg: RunConfig) -> list[ConfigError]:
    env = cfg.env
    if isinstance(env, DataEnvConfig):
        data = cfg.data
        if data.type != "synthetic" and not Path(data.path).is_file():  # what load_dataset refuses
            return [ConfigError("data.path", f"{data.path} does not exist (data.type={data.type})")]
        return []
    if isinstance(env, ReasoningGymEnvConfig):
        from rlbus.common.envs.reasoning_gym import import_reasoning_gym, task_errors

        return _caught(import_reasoning_gym) or task_errors(env)
    if isinstance(env, GymEnvConfig):
        from rlbus.common.envs.gym import env_factory

        return _caught(lambda: env_factory(env))  # the import path or gymnasium id, and env.kwargs fit it
    if isinstance(env, VerifiersEnvConfig):
        from rlbus.common.envs.verifiers import INSTALL

        if importlib.util.find_spec("verifiers") is None:
            return [ConfigError("env.load", f"env.type verifiers needs the verifiers package: {INSTALL}")]
        return _caught(lambda: find_object(env.load, "env.load"))
    return []


def _module_spec(module_name: str) -> importlib.machinery.ModuleSpec | None:
    """The spec of a module, found without importing it or its parent packages (find_spec would import those)."""
    parts = module_name.split(".")
    spec = importlib.util.find_spec(parts[0])
    for i in range(1, len(parts)):
        if spec is None or spec.submodule_search_locations is None:
            return None
        spec = _submodule_spec(".".join(parts[: i + 1]), list(spec.submodule_search_locations))
    return spec


def _submodule_spec(name: str, locations: list[str]) -> importlib.machinery.ModuleSpec | None:
    """`name`'s spec in its package's `locations`, as the path finder finds it, but for a namespace package (a
    folder without __init__.py, such as a project's tests/fixtures) too: the path finder needs the parent imported
    to describe one of those."""
    part = name.rsplit(".", 1)[-1]
    portions = []
    for location in locations:
        base = Path(location) / part
        if (base / "__init__.py").is_file():
            return importlib.util.spec_from_file_location(name, base / "__init__.py",
                                                          submodule_search_locations=[str(base)])
        if base.with_suffix(".py").is_file():
            return importlib.util.spec_from_file_location(name, base.with_suffix(".py"))
        if base.is_dir():
            portions.append(str(base))
    if portions:
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = portions
        return spec
    return importlib.machinery.PathFinder.find_spec(name, locations)  # compiled modules, zip imports, ...


def _top_level_names(tree: ast.Module) -> set[str] | None:
    """Names a module binds at its top level (under if / try / with too); None when it may bind others unseen
    (a star import, a module __getattr__)."""
    names: set[str] = set()
    body = list(tree.body)
    while body:
        node = body.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any(a.name == "*" for a in node.names):
                return None
            names |= {a.asname or a.name.split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            body += node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
            body += [s for h in getattr(node, "handlers", []) for s in h.body]
    return None if "__getattr__" in names else names


def find_object(path: str, field: str) -> None:
    """Check that "pkg.module:attr" names a module that exists and binds `attr`, without importing it (for code
    whose import is slow: a verifiers environment's imports verifiers). What cannot be seen in the source (a star
    import, a module __getattr__, a compiled module) passes; `import_object` then says it when the role imports it."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(field, f"{path!r} is not an import path 'pkg.module:attr'")
    cwd_on_path()
    try:
        spec = _module_spec(module_name)
    except (ImportError, ValueError):  # a parent already imported oddly: leave it to the import
        return
    if spec is None:
        raise ConfigError(field, f"cannot import module {module_name!r} for {path!r}: no such module on the path "
                                 "(the current directory, PYTHONPATH, installed packages)")
    if not spec.origin or not spec.origin.endswith(".py"):
        return
    names = _top_level_names(ast.parse(Path(spec.origin).read_text(), filename=spec.origin))
    first = attr.split(".")[0]
    if names is None or first in names:
        return
    if spec.submodule_search_locations and _submodule_spec(f"{module_name}.{first}",
                                                           list(spec.submodule_search_locations)):
        return  # a submodule of the package
    near = difflib.get_close_matches(first, sorted(names), n=1)
    raise ConfigError(field, f"{path!r}: {module_name!r} has no attribute {first!r}"
                             + (f" (did you mean {near[0]}?)" if near else ""))


# ------------------------------------------------------------------------------------------------- rollout


def _rollout_errors(cfg: RunConfig) -> list[ConfigError]:
    """The reward, the tools and the OpenAI agent function, loaded as a producer loads them (no engine, no model)."""
    from rlbus.producers.rewards.registry import load_reward
    from rlbus.producers.tools.registry import load_tools

    r = cfg.rollout
    errors = []
    if not isinstance(cfg.env, ReasoningGymEnvConfig):  # reasoning-gym scores with its tasks' own scorers
        errors += _caught(lambda: load_reward(r, cfg))  # a judge reward bound to the run: judge.* checked too
    errors += _caught(lambda: load_tools(r.tools))  # every producer loads them
    if isinstance(cfg.env, (DataEnvConfig, ReasoningGymEnvConfig)) and r.agent_loop == "openai" and r.openai.function:
        from rlbus.producers.agent_loops.openai_agent import load_agent

        errors += _caught(lambda: load_agent(r.openai.function))
    return errors


def _logging_errors(cfg: RunConfig) -> list[ConfigError]:
    from rlbus.trainer.metrics import require_wandb

    # The package; whether online mode has a credential is `rlbus up`'s to check (W&B may ask for one).
    return _caught(lambda: require_wandb(cfg.logging))


__all__ = ["CONFIG_ERROR_EXIT", "ConfigInvalid", "check_config", "config_errors", "find_object"]
