"""common/model/ensure.py: a model `model.init_if_missing` built earlier is used as it is, with a warning when this
version would build it otherwise (its runs are not the ones the README's figures describe).

    .venv/bin/python -m pytest -q tests/unit/test_ensure_model.py
"""

from __future__ import annotations

import json
import logging

import msgspec
import pytest

from rlbus.common.model.ensure import ensure_model
from rlbus.common.model.tiny import TinyModelSpec
from rlbus.common.model.warm_start import WarmStartConfig
from rlbus.schemas.config import ModelConfig

PASSED = {"checks": [{"call": 0.999, "answer": 0.996, "tool_ok": 0.995}], "kept_attempt": 0, "check_passed": True}


def _built(path, *, steps: int, spec: TinyModelSpec, check: dict | None = PASSED,
           lr: float = WarmStartConfig().lr) -> None:
    path.mkdir()
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"")
    (path / "warm_start.json").write_text(json.dumps({"spec": msgspec.to_builtins(spec),
                                                      "warm_start": {"steps": steps, "lr": lr}, **(check or {})}))


def test_a_model_built_with_another_warm_start_is_used_with_a_warning(tmp_path, caplog):
    _built(tmp_path / "old", steps=WarmStartConfig().steps - 600, spec=TinyModelSpec())
    with caplog.at_level(logging.WARNING, logger="rlbus.model"):
        assert ensure_model(ModelConfig(path=str(tmp_path / "old"), init_if_missing=True)) == str(tmp_path / "old")
    assert "remove the directory to rebuild it" in caplog.text
    assert f"{WarmStartConfig().steps - 600} steps" in caplog.text


def test_a_model_built_without_the_check_or_below_it_is_used_with_a_warning(tmp_path, caplog):
    steps = WarmStartConfig().steps
    _built(tmp_path / "unchecked", steps=steps, spec=TinyModelSpec(), check=None)
    _built(tmp_path / "missed", steps=steps, spec=TinyModelSpec(), check={
        "checks": [{"call": 0.5, "answer": 0.986, "tool_ok": 0.49}, {"call": 0.6, "answer": 0.9, "tool_ok": 0.54}],
        "kept_attempt": 1, "check_passed": False})
    with caplog.at_level(logging.WARNING, logger="rlbus.model"):
        ensure_model(ModelConfig(path=str(tmp_path / "unchecked"), init_if_missing=True))
        assert "before the warm start checked its copies" in caplog.text and "rlbus.producers.evaluate" in caplog.text
        caplog.clear()
        ensure_model(ModelConfig(path=str(tmp_path / "missed"), init_if_missing=True))
        assert "missed its warm-start check (tool_ok 0.540 at best of 2 attempts)" in caplog.text


def test_a_model_built_as_this_version_would_is_used_quietly(tmp_path, caplog):
    _built(tmp_path / "same", steps=WarmStartConfig().steps, spec=TinyModelSpec())
    _built(tmp_path / "wide", steps=WarmStartConfig().steps, spec=TinyModelSpec.with_head_dim(32))
    with caplog.at_level(logging.WARNING, logger="rlbus.model"):
        ensure_model(ModelConfig(path=str(tmp_path / "same"), init_if_missing=True))
        ensure_model(ModelConfig(path=str(tmp_path / "wide"), init_if_missing=True, init_head_dim=32))
        # A model the user made (no init_if_missing) is theirs: never compared.
        _built(tmp_path / "mine", steps=5, spec=TinyModelSpec())
        ensure_model(ModelConfig(path=str(tmp_path / "mine")))
    assert caplog.text == ""


def test_the_configs_warm_start_steps_build_the_model(tmp_path, monkeypatch, caplog):
    """model.init_steps reaches the build (configs/quickstart_vllm.yaml asks for more than the default: its wider
    model copies tool results reliably only later), and a model built with other steps is named in a warning."""
    from rlbus.common.model import init_model as init_module

    assert ModelConfig(path="x").init_steps == WarmStartConfig().steps  # one default, stated twice across layers
    seen = {}
    monkeypatch.setattr(init_module, "init_model",
                        lambda out, *, spec, steps, warm: seen.update(steps=steps, head_dim=spec.head_dim) or
                        _built(out, steps=steps, spec=spec, lr=warm.lr))
    ensure_model(ModelConfig(path=str(tmp_path / "m"), init_if_missing=True, init_head_dim=32, init_steps=3000))
    assert seen == {"steps": 3000, "head_dim": 32}
    with caplog.at_level(logging.WARNING, logger="rlbus.model"):
        ensure_model(ModelConfig(path=str(tmp_path / "m"), init_if_missing=True, init_head_dim=32, init_steps=3000))
        assert caplog.text == ""
        ensure_model(ModelConfig(path=str(tmp_path / "m"), init_if_missing=True, init_head_dim=32))
    assert "warm start of 3000 steps" in caplog.text
    assert f"this config builds {WarmStartConfig().steps} steps" in caplog.text
    with pytest.raises(ValueError, match="init_steps"):  # the loader names it model.init_steps
        ModelConfig(path="x", init_steps=-1)


def test_the_configs_warm_start_lr_builds_the_model(tmp_path, monkeypatch, caplog):
    """model.init_lr reaches the warm start (configs/quickstart_vllm.yaml's wider model passes its check only at
    half the default LR on some CPUs), and a model built at another LR is named in a warning; the rest of the warm
    start keeps its defaults."""
    from rlbus.common.model import init_model as init_module

    assert ModelConfig(path="x").init_lr == WarmStartConfig().lr  # one default, stated twice across layers
    seen = {}
    monkeypatch.setattr(init_module, "init_model",
                        lambda out, *, spec, steps, warm: seen.update(warm=warm) or
                        _built(out, steps=steps, spec=spec, lr=warm.lr))
    cfg = ModelConfig(path=str(tmp_path / "m"), init_if_missing=True, init_head_dim=32, init_steps=3000, init_lr=5e-3)
    ensure_model(cfg)
    assert seen["warm"] == msgspec.structs.replace(WarmStartConfig(), lr=5e-3)
    with caplog.at_level(logging.WARNING, logger="rlbus.model"):
        ensure_model(cfg)
        assert caplog.text == ""
        ensure_model(msgspec.structs.replace(cfg, init_lr=1e-2))
    assert "3000 steps at lr 0.005" in caplog.text and "3000 steps at lr 0.01 " in caplog.text
    for bad in (0.0, -1e-3):
        with pytest.raises(ValueError, match="init_lr"):
            ModelConfig(path="x", init_lr=bad)
