"""Faults injected from outside a real `rlbus up`, each run ending with the ledger check (tests/support/ledger.py).

    .venv/bin/python -m pytest -q tests/system/test_faults.py

Only processes this test started are signalled, by pid: the launcher, and its trainer child found through /proc.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlbus.trainer.checkpoint import latest_checkpoint
from rlbus.trainer.metrics import read_metrics
from tests.support.ledger import read_ledger
from tests.support.runs import ROOT, small_run_config, start_role, stop, wait_for_steps, write_config

pytestmark = pytest.mark.slow


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _child_running(launcher: subprocess.Popen, role: str, timeout: float = 60.0) -> int:
    """The pid of the launcher's child whose command line runs `role`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in _children(launcher.pid):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if role.encode() in argv[3:4]:
                return pid
        time.sleep(0.2)
    pytest.fail(f"no {role} child of the launcher within {timeout}s")


def test_trainer_sigkilled_then_the_same_rlbus_up_again_finishes(tmp_path, tiny_model_dir, run_name):
    # The checkpoint is at step 3; the trainer dies at step 5. Resumed at once -- well inside JetStream's
    # duplicate window -- it republishes version 3, producers must follow it down, and steps 4-5 are redone.
    run_dir = tmp_path / "run"
    total = 8
    cfg = small_run_config(run_name, run_dir, tiny_model_dir, "", "", "",
                           trainer={"total_steps": total, "checkpoint_interval": 3}, rollout={"num_producers": 2})
    cfg_path = write_config(tmp_path / "run.yaml", cfg)
    logs = tmp_path / "logs"
    first = start_role("up", cfg_path, logs, name="up-1")
    try:
        trainer = _child_running(first, "trainer")
        wait_for_steps(run_dir, 5, [first], timeout=400)
        os.kill(trainer, signal.SIGKILL)  # our launcher's own child, by pid
        code = first.wait(timeout=180)  # a dead trainer stops the run
    finally:
        stop(first, signal.SIGKILL)
    assert code != 0
    assert latest_checkpoint(run_dir / "checkpoints").name.endswith("3")
    lost_at = read_metrics(run_dir)[-1]["step"]
    assert lost_at >= 5

    second = subprocess.run([sys.executable, "-m", "rlbus.cli", "up", str(cfg_path)], cwd=ROOT, capture_output=True,
                            text=True, timeout=900)
    assert second.returncode == 0, second.stderr[-4000:] + second.stdout[-4000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, total + 1))
    assert [r["version"] for r in rows] == list(range(1, total + 1))  # versions follow the checkpoint
    ledger = read_ledger(run_dir)
    groups_per_step = cfg["trainer"]["groups_per_step"]
    assert len(ledger.trained) == total * groups_per_step
    max_in_flight = (cfg["trainer"]["max_staleness"] + 2) * groups_per_step
    assert ledger.problems(max_in_flight) == [], ledger
