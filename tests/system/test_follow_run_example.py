"""examples/follow_run.py, a client written from docs/wire.md alone, follows a live `rlbus up` run (which also logs
to Weights & Biases in offline mode when wandb is installed: the trainer's real path, no network).

    .venv/bin/python -m pytest -q tests/system/test_follow_run_example.py
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import time

import pytest

from rlbus.trainer.metrics import read_metrics
from tests.support.runs import ROOT, log_tail, small_run_config, start_role, stop, write_config

pytestmark = pytest.mark.slow


def test_example_client_follows_a_live_run(tmp_path, tiny_model_dir, run_name, monkeypatch):
    run_dir = tmp_path / "run"
    total = 3
    wandb = importlib.util.find_spec("wandb") is not None
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    cfg = small_run_config(run_name, run_dir, tiny_model_dir, "", "", "", rollout={"num_producers": 1},
                           trainer={"total_steps": total}, logging={"wandb": wandb, "wandb_mode": "offline"})
    up = start_role("up", write_config(tmp_path / "run.yaml", cfg), tmp_path / "logs", name="up")
    creds = run_dir / "bus" / "creds" / run_name / "observer.json"
    try:
        deadline = time.monotonic() + 120
        while not creds.is_file():
            assert up.poll() is None and time.monotonic() < deadline, log_tail(up)
            time.sleep(0.2)
        # no rlbus import in the example: it runs with only nats-py and msgspec
        follow = subprocess.run([sys.executable, str(ROOT / "examples" / "follow_run.py"), str(creds), "--from-start",
                                 "--until-step", str(total), "--timeout", "300"],
                                capture_output=True, text=True, timeout=360, cwd=tmp_path)
        assert follow.returncode == 0, follow.stdout + follow.stderr + log_tail(up)
        assert up.wait(timeout=300) == 0, log_tail(up)
    finally:
        stop(up)
    out = follow.stdout.splitlines()
    rows = {r["step"]: r for r in read_metrics(run_dir)}
    steps = [line for line in out if line.startswith("step ")]
    assert [int(s.split()[1]) for s in steps] == list(range(1, total + 1)), out
    for s in steps:  # what the client decoded is what the trainer recorded
        step = int(s.split()[1])
        assert s.endswith(f"reward {rows[step]['reward/mean']:.3f}"), (s, rows[step]["reward/mean"])
        assert f"version {rows[step]['version']} " in s
    assert any(re.fullmatch(r"weights v\d+ step \d+ \d+ bytes [0-9a-f]{12}", line) for line in out), out
    assert any(line.startswith("heartbeat p0 version ") for line in out), out
    groups = [line for line in out if line.startswith("group ")]
    assert groups and all(" from p0 rewards [" in g for g in groups), groups
    assert any(line.startswith("role_started trainer") for line in out), out
    if wandb:  # every step went to the offline W&B run too
        run_id = (run_dir / "wandb_id").read_text().strip()
        (record,) = (run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
        deadline = time.monotonic() + 30  # wandb's service process may still be writing it
        while b"reward/mean" not in record.read_bytes() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert b"reward/mean" in record.read_bytes()
    imports = [ln for ln in (ROOT / "examples" / "follow_run.py").read_text().splitlines()
               if ln.startswith(("import ", "from "))]
    assert not [ln for ln in imports if "rlbus" in ln], imports
