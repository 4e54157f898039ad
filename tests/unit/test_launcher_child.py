"""cli/child.py's Child: a role's leftovers end with it.

A role runs in its own session; what it started and did not take down with it (a vLLM engine core whose producer
was killed while starting it) must not outlive it: the launcher SIGKILLs the rest of the role's process group when
it stops the role and before it starts the role again. Only processes this test started are involved.

    .venv/bin/python -m pytest -q tests/unit/test_launcher_child.py
"""

from __future__ import annotations

import os
import sys
import time

from rlbus.cli.child import Child

#: A role that starts a long-lived child of its own (in its process group), writes the child's pid, and then waits
#: (or, with "exit", exits at once without taking the child down).
ROLE = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(sys.argv[1], "w").write(str(child.pid))
if sys.argv[2] == "wait":
    time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, its parent gone or not reaping yet) counts as gone.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _gone(pid: int, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def _leftover(tmp_path, how: str) -> tuple[Child, int]:
    pid_file = tmp_path / f"{how}.pid"
    child = Child("role", [sys.executable, "-c", ROLE, str(pid_file), how], tmp_path / f"{how}.log")
    child.start()
    deadline = time.monotonic() + 30
    while not (pid_file.is_file() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return child, int(pid_file.read_text())


async def test_stopping_a_role_ends_what_it_left_running(tmp_path):
    child, grandchild = _leftover(tmp_path, "wait")
    try:
        assert _alive(grandchild)
        await child.stop(timeout=5)
        assert _gone(grandchild)
    finally:
        child.reap_group()


def test_a_restart_ends_what_the_dead_role_left_running(tmp_path):
    child, grandchild = _leftover(tmp_path, "exit")
    try:
        deadline = time.monotonic() + 10
        while child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert child.poll() == 0 and _alive(grandchild)  # the role is gone, its child lives on
        child.reap_group()  # what start() does first when the launcher restarts the role
        assert _gone(grandchild)
    finally:
        child.reap_group()
