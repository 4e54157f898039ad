"""bus/proc.py's `state`: what /proc says of a process, or of one thread of it, through its life."""

import os
import signal
import subprocess
import sys
import time

from rlbus.bus.proc import state


def _until(pid: int, want: str) -> str:
    deadline = time.monotonic() + 10
    while (got := state(pid)) != want and time.monotonic() < deadline:
        time.sleep(0.01)
    return got


def test_state_follows_a_child_from_sleeping_to_stopped_to_zombie_to_gone():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert _until(child.pid, "S") == "S"
        assert state(child.pid, child.pid) == "S"  # its main thread, read from /proc/<pid>/task/<tid>
        os.kill(child.pid, signal.SIGSTOP)
        assert _until(child.pid, "T") == "T"
        os.kill(child.pid, signal.SIGKILL)
        assert _until(child.pid, "Z") == "Z"  # dead, not yet reaped
    finally:
        child.kill()
        child.wait()
    assert state(child.pid) == "gone"
    assert state(os.getpid()) == "R"  # this process, reading its own state
