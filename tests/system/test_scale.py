"""Elastic producers on a running `rlbus up`: `rlbus scale RUN_DIR N` from outside, 1 -> 3 -> 1, no restart.

    .venv/bin/python -m pytest -q tests/system/test_scale.py

Throughput follows the producers (groups per second while three run against while one runs, from the event log),
the two removed producers drain and produce nothing after they stopped, the change is in the event log, and the
run ends with a clean prompt ledger.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlbus.consumers.event_log import read_entries
from rlbus.schemas.wire import ProducersScaled, RoleStopped
from rlbus.trainer.metrics import read_metrics
from tests.support.runs import ROOT, log_tail, small_run_config, start_role, stop, wait_for_steps, write_config

pytestmark = pytest.mark.slow


def _scale(run_dir: Path, n: int) -> float:
    """`rlbus scale RUN_DIR n --wait`; the wall time it was asked."""
    asked = time.time()
    proc = subprocess.run([sys.executable, "-m", "rlbus.cli", "scale", str(run_dir), str(n), "--wait",
                           "--timeout", "120"], capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"running {n}:" in proc.stdout
    return asked


def _rate(groups: list, start: float, end: float) -> float:
    n = sum(1 for g in groups if start <= g.created_at < end)
    return n / (end - start)


def test_scale_one_three_one_mid_run(tmp_path, tiny_model_dir, run_name):
    run_dir = tmp_path / "run"
    total = 16
    cfg = small_run_config(run_name, run_dir, tiny_model_dir, "", "", "", rollout={"num_producers": 1},
                           trainer={"total_steps": total, "groups_per_step": 3, "max_staleness": 3,
                                    "checkpoint_interval": 4})
    cfg_path = write_config(tmp_path / "run.yaml", cfg)
    up = start_role("up", cfg_path, tmp_path / "logs", name="up")
    try:
        wait_for_steps(run_dir, 3, [up], timeout=300)
        up_at = _scale(run_dir, 3)
        wait_for_steps(run_dir, 10, [up], timeout=300)
        down_at = _scale(run_dir, 1)  # returns once p1 and p2 have drained and exited
        drained_at = time.time()
        assert json.loads((run_dir / "producers.json").read_text())["running"].keys() == {"p0"}
        assert up.wait(timeout=400) == 0, log_tail(up)
    finally:
        stop(up)

    # the launcher announced both changes, and they are in the event log
    scaled = [e.msg for e in read_entries(run_dir, "lifecycle") if isinstance(e.msg, ProducersScaled)]
    assert [(s.previous, s.target, s.added, s.removed) for s in scaled] == [
        (1, 3, ["p1", "p2"], []), (3, 1, [], ["p2", "p1"])]
    stopped = {e.msg.role_id: e.msg.created_at for e in read_entries(run_dir, "lifecycle")
               if isinstance(e.msg, RoleStopped) and e.msg.role == "producer"}
    assert {"p1", "p2"} <= stopped.keys()

    groups = [e.msg for e in read_entries(run_dir, "traj")]
    by = {p: [g for g in groups if g.producer_id == p] for p in ("p0", "p1", "p2")}
    assert all(by[p] for p in by), {p: len(v) for p, v in by.items()}  # all three rolled out
    for p in ("p1", "p2"):  # nothing from a removed producer after it stopped
        assert all(g.created_at <= stopped[p] for g in by[p]), p
        assert all(g.created_at >= up_at for g in by[p]), p
    # throughput follows: groups/s while three ran (from the first group of a new one) against before the change
    first = min(g.created_at for g in groups)
    three_from = min(g.created_at for g in by["p1"] + by["p2"])
    one, three = _rate(groups, first, up_at), _rate(groups, three_from, down_at)
    after = [g for g in groups if g.created_at > drained_at]
    print(f"groups/s: 1 producer {one:.3f}, 3 producers {three:.3f} ({three / one:.2f}x); "
          f"after scaling down {len(after)} groups, all from p0")
    assert three > 1.3 * one, (one, three)
    assert after and {g.producer_id for g in after} == {"p0"}

    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, total + 1))
    proc = subprocess.run([sys.executable, "-m", "rlbus.cli", "events", str(run_dir), "--ledger", "--json"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ledger = json.loads(proc.stdout)
    assert ledger["trained"] == total * 3 and ledger["problems"] == []
