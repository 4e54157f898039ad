"""`rlbus up` with a model-based reward: the launcher starts the run's judge role, producers score through it, and
a judge SIGKILLed mid-run is restarted and costs retries, not the run (every released prompt trained once).

    .venv/bin/python -m pytest -q tests/system/test_agentic.py
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from rlbus.bus.proc import command_line, descendants
from tests.support.runs import check_ledger, small_run_config, start_role, stop, wait_for_steps, write_config

pytestmark = pytest.mark.slow


def _judge_pid(launcher, timeout: float = 120.0) -> int:
    """The live `rlbus judge` process under the launcher (`python -m rlbus.cli judge ...`, or its forked title)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in descendants(launcher.pid):
            argv = command_line(pid)
            if len(argv) > 3 and argv[3].endswith("judge"):
                return pid
        time.sleep(0.2)
    pytest.fail(f"no judge under the launcher within {timeout}s")


def test_rlbus_up_serves_the_judge_and_a_killed_judge_costs_retries_not_the_run(tmp_path, tiny_model_dir, run_name):
    run_dir = tmp_path / "run"
    cfg = small_run_config(
        run_name, run_dir, tiny_model_dir, "", "", "",
        rollout={"reward": "rlbus.producers.rewards.judge:judge_reward", "num_producers": 1},
        # The tiny model grades nonsense (unparsed replies score 0): the plumbing is under test, not the grades.
        judge={"model": str(tiny_model_dir), "max_new_tokens": 3, "retries": 12, "backoff_s": 0.25,
               "max_backoff_s": 2.0, "timeout_s": 20.0},
    )
    cfg["trainer"].update(total_steps=8)
    cfg_path = write_config(tmp_path / "run.yaml", cfg)
    up = start_role("up", cfg_path, tmp_path / "logs", name="up")
    try:
        wait_for_steps(run_dir, 2, [up], timeout=300)
        victim = _judge_pid(up)
        os.kill(victim, signal.SIGKILL)  # a process under the launcher this test started, by its pid
        assert up.wait(timeout=600) == 0, (tmp_path / "logs" / "up.log").read_text()[-4000:]
    finally:
        stop(up, signal.SIGKILL)
    check_ledger(run_dir, cfg)
    launcher_log = (tmp_path / "logs" / "up.log").read_text()
    assert "judge exited with code" in launcher_log and "restarting" in launcher_log
    judge_log = (run_dir / "logs" / "judge.log").read_text()
    assert judge_log.count("serving on http://127.0.0.1:") >= 2  # the first judge and its successor
    assert "judge stopped" in judge_log  # the successor stopped cleanly with the run
