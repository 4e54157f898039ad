"""common/model/ensure.py: `model.init_if_missing` copies the model rlbus ships when the config asks for it (the same
bytes on every machine) and builds any other; a model made earlier is used as it is, with a warning when this version
would make it otherwise (its runs are not the ones the README's figures describe).

    .venv/bin/python -m pytest -q tests/unit/test_ensure_model.py
"""

from __future__ import annotations

import hashlib
import json
import logging

import msgspec
import pytest

from rlbus.common.model.ensure import SHIPPED, ensure_model, shipped_model
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
    assert "remove the directory to copy the model rlbus ships" in caplog.text
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
    assert f"this config asks for {WarmStartConfig().steps} steps" in caplog.text
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


#: sha256 of the quickstart model rlbus ships (common/model/shipped/tiny-calculator/model.safetensors): a change to it
#: is a change to every figure the README gives, made on purpose.
SHIPPED_SHA256 = "8332d3bc6200ea0332bb5e15ad2ad0ef56c4a61eba7e26a3688a325cd1ed322b"


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_quickstart_model_is_copied_from_the_package_not_built(tmp_path, monkeypatch, caplog):
    """configs/quickstart.yaml's model (init_if_missing, the default shape and warm start) is the one rlbus ships,
    byte for byte, whatever the CPU: nothing is trained."""
    from rlbus.common.model import init_model as init_module

    monkeypatch.setattr(init_module, "init_model", lambda *a, **k: pytest.fail("the quickstart model was built"))
    cfg = ModelConfig(path=str(tmp_path / "m"), init_if_missing=True)
    shipped = shipped_model(cfg)
    assert shipped == SHIPPED / "tiny-calculator"
    with caplog.at_level(logging.INFO, logger="rlbus.model"):
        assert ensure_model(cfg) == str(tmp_path / "m")
    assert "copied the model rlbus ships" in caplog.text
    assert _sha256(tmp_path / "m" / "model.safetensors") == SHIPPED_SHA256
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == sorted(p.name for p in shipped.iterdir())
    for f in shipped.iterdir():
        assert (tmp_path / "m" / f.name).read_bytes() == f.read_bytes(), f.name
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rlbus.model"):
        ensure_model(cfg)  # the copy is what this version makes: used quietly
    assert caplog.text == ""


def test_the_shipped_model_passes_its_check_here(tmp_path):
    """The check the build runs (teacher-forced copies of call and answer), on this machine's float kernels."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlbus.common.model.warm_start import tool_copy_check

    shipped = SHIPPED / "tiny-calculator"
    report = json.loads((shipped / "warm_start.json").read_text())
    assert report["check_passed"] and report["warm_start"]["check_target"] == WarmStartConfig().check_target
    model = AutoModelForCausalLM.from_pretrained(shipped)
    check = tool_copy_check(model, AutoTokenizer.from_pretrained(shipped))
    assert check.tool_ok >= WarmStartConfig().check_target, check
    assert abs(check.tool_ok - report["checks"][report["kept_attempt"]]["tool_ok"]) < 0.02, (check, report["checks"])
