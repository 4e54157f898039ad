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
    return sum(1 for g in groups if start <= g.created_at < end) / (end - start)


def test_scale_one_three_one_mid_run(tmp_path, tiny_model_dir, run_name):
    run_dir = tmp_path / "run"
    total, groups_per_step, window = 40, 2, 12.0
    # The simulated engine sleeps for its generation time instead of computing (as in tests/integration/
    # test_pipeline.py): producers then add throughput the way GPU producers do, rather than fighting the trainer
    # for this machine's cores. One task in flight per producer: each producer is then one unit of throughput, and
    # the test measures what adding producers adds (a producer sizing its own in-flight limit would fill the
    # trainer alone, and there would be nothing left for the other two to add).
    engine = {"type": "simulated", "mean_tokens": 24, "tail_alpha": 3.0, "seconds_per_token": 0.03}
    cfg = small_run_config(run_name, run_dir, tiny_model_dir, "", "", "",
                           rollout={"num_producers": 1, "max_inflight_tasks": 1, "n": 4, "max_new_tokens": 48,
                                    "max_response_tokens": 48, "agent_loop": "single_turn", "engine": engine},
                           trainer={"total_steps": total, "groups_per_step": groups_per_step, "max_staleness": 3,
                                    "checkpoint_interval": 5})
    cfg_path = write_config(tmp_path / "run.yaml", cfg)
    up = start_role("up", cfg_path, tmp_path / "logs", name="up")
    try:
        wait_for_steps(run_dir, 2, [up], timeout=300)
        one_window = (time.time(), time.time() + window)
        time.sleep(window)
        up_at = _scale(run_dir, 3)  # returns once p1 and p2 have announced RoleStarted
        three_window = (time.time(), time.time() + window)
        time.sleep(window)
        assert read_metrics(run_dir)[-1]["step"] < total - 4, "the run outpaced the test: give it more steps"
        down_at = _scale(run_dir, 1)  # returns once p1 and p2 have drained and exited
        drained_at = time.time()
        assert json.loads((run_dir / "producers.json").read_text())["running"].keys() == {"p0"}
        assert up.wait(timeout=400) == 0, log_tail(up)
    finally:
        stop(up)

    # the launcher announced both changes, and they are in the event log
    lifecycle = [e.msg for e in read_entries(run_dir, "lifecycle")]
    scaled = [m for m in lifecycle if isinstance(m, ProducersScaled)]
    assert [(m.previous, m.target, m.added, m.removed) for m in scaled] == [
        (1, 3, ["p1", "p2"], []), (3, 1, [], ["p2", "p1"])]
    stopped = {m.role_id: m.created_at for m in lifecycle if isinstance(m, RoleStopped) and m.role == "producer"}
    assert {"p1", "p2"} <= stopped.keys(), lifecycle

    groups = [e.msg for e in read_entries(run_dir, "traj")]
    by = {p: [g for g in groups if g.producer_id == p] for p in ("p0", "p1", "p2")}
    assert all(by.values()), {p: len(v) for p, v in by.items()}  # all three rolled out
    for p in ("p1", "p2"):  # only between being added and being removed
        assert all(up_at <= g.created_at <= stopped[p] <= drained_at for g in by[p]), p
    after = [g for g in groups if g.created_at > drained_at]
    assert after and {g.producer_id for g in after} == {"p0"}
    # throughput follows the producers
    one, three = _rate(groups, *one_window), _rate(groups, *three_window)
    print(f"groups/s: 1 producer {one:.3f}, 3 producers {three:.3f} ({three / one:.2f}x); "
          f"{len(after)} groups after scaling back to 1, all from p0; down at {down_at - up_at:.0f}s after up")
    assert three > 1.5 * one, (one, three)

    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, total + 1))
    proc = subprocess.run([sys.executable, "-m", "rlbus.cli", "events", str(run_dir), "--ledger", "--json"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ledger = json.loads(proc.stdout)
    assert ledger["trained"] == total * groups_per_step and ledger["problems"] == []
