"""cli/run_lock.py: one `rlbus up` per run directory, and none while an earlier one's roles still run (real flock
between real processes)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from rlbus.cli.run_lock import ENV, RunDirBusy, RunLock

TRY = "from pathlib import Path; from rlbus.cli.run_lock import RunLock; RunLock.acquire(Path({d!r}), wait_s={w})"


def _try_acquire(run_dir, wait_s: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", TRY.format(d=str(run_dir), w=wait_s)], capture_output=True,
                          text=True, timeout=60)


def test_a_second_launcher_is_refused_while_the_first_runs(tmp_path):
    lock = RunLock.acquire(tmp_path, wait_s=0)
    try:
        out = _try_acquire(tmp_path, 0.5)
        assert out.returncode != 0 and "RunDirBusy" in out.stderr and "still in use" in out.stderr
    finally:
        lock.release()
    assert _try_acquire(tmp_path, 0.5).returncode == 0  # and it is free once the first is gone


def test_a_dead_launchers_roles_keep_the_run_directory_until_they_exit(tmp_path):
    lock = RunLock.acquire(tmp_path, wait_s=0)
    # A role as `rlbus up` starts it: it takes the lock shared through the environment.
    role = subprocess.Popen([sys.executable, "-c", "from rlbus.cli.run_lock import hold_inherited; import time; "
                             "hold_inherited(); print('held', flush=True); time.sleep(60)"],
                            env=dict(os.environ, **lock.env()), stdout=subprocess.PIPE, text=True)
    try:
        assert role.stdout.readline().strip() == "held"
        lock.release()  # the launcher is gone; its role is not
        with pytest.raises(RunDirBusy):
            RunLock.acquire(tmp_path, wait_s=0.5)
        role.kill()  # the role exits (however it exits, the kernel drops its lock)
        role.wait()
        t = time.monotonic()
        waited = []
        RunLock.acquire(tmp_path, wait_s=10, on_wait=waited.append).release()
        assert time.monotonic() - t < 5
    finally:
        if role.poll() is None:
            role.kill()
            role.wait()


def test_roles_started_by_hand_take_no_lock(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    from rlbus.cli.run_lock import hold_inherited

    hold_inherited()  # nothing named: nothing held, nothing raised
    RunLock.acquire(tmp_path, wait_s=0).release()
