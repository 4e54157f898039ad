"""Weights & Biases beside metrics.jsonl: offline mode writes the run under <run_dir>/wandb with no network, a
resumed run logs into the same W&B run, and a config that asks for wandb without the package fails naming the field.

    .venv/bin/python -m pytest -q tests/unit/test_metrics_wandb.py
"""

from __future__ import annotations

import sys
import time

import pytest

from rlbus.schemas.config import LoggingConfig
from rlbus.schemas.errors import ConfigError
from rlbus.trainer.metrics import WANDB_ID_FILE, MetricsLog, read_metrics, require_wandb


@pytest.fixture
def wandb_home(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    return tmp_path


def test_offline_wandb_records_every_step_beside_metrics_jsonl(wandb_home):
    run_dir = wandb_home / "run"
    cfg = LoggingConfig(wandb=True, wandb_mode="offline", wandb_project="rlbus-test")
    log = MetricsLog(run_dir, tensorboard=False, logging=cfg, run_name="t", config={"trainer": {"lr": 1e-5}})
    for step in (1, 2, 3):
        log.append({"step": step, "reward/mean": 0.25 * step, "perf/tokens_per_s": 100.0 + step, "flag": True})
    log.close()
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3]
    run_id = (run_dir / WANDB_ID_FILE).read_text().strip()
    files = list((run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(files) == 1, list((run_dir / "wandb").rglob("*"))
    # wandb's service process may still be writing its transaction log when finish() returns: give it a moment
    deadline = time.monotonic() + 30
    while b"perf/tokens_per_s" not in (data := files[0].read_bytes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert b"reward/mean" in data and b"perf/tokens_per_s" in data and b"rlbus-test" in data

    # a resumed run (the trainer restarted from step 2) continues the same W&B run
    log = MetricsLog(run_dir, tensorboard=False, resume_step=2, logging=cfg, run_name="t")
    log.append({"step": 3, "reward/mean": 0.5})
    log.close()
    assert (run_dir / WANDB_ID_FILE).read_text().strip() == run_id
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3]
    assert len(list((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))) >= 1


def test_wandb_asked_for_but_not_installed_names_the_field(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError
    with pytest.raises(ConfigError, match=r"^logging\.wandb: .*pip install 'rlbus\[wandb\]'"):
        MetricsLog(tmp_path, tensorboard=False, logging=LoggingConfig(wandb=True))
    assert require_wandb(LoggingConfig(wandb=False)) is None  # not asked for: never imported


def test_online_wandb_without_a_login_names_the_mode(wandb_home, monkeypatch):
    monkeypatch.setenv("HOME", str(wandb_home))  # no ~/.netrc holding a key
    monkeypatch.setenv("NETRC", str(wandb_home / "no-netrc"))
    online = LoggingConfig(wandb=True, wandb_mode="online")
    with pytest.raises(ConfigError, match=r"^logging\.wandb_mode: is online .*logging\.wandb_mode=offline"):
        require_wandb(online, check_login=True)
    with pytest.raises(ConfigError, match=r"^logging\.wandb_mode: "):
        MetricsLog(wandb_home / "run", tensorboard=False, logging=online)
