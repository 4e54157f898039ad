"""One `rlbus up` per run directory, and none while the roles of an earlier one still run.

The launcher holds `RUN_DIR/.lock` for as long as it runs, and every role it starts holds the same file shared
(`RLBUS_RUN_LOCK` in the role's environment names it; cli/main.py takes it before the role starts). A new `rlbus up`
asks for the lock exclusively: it gets it only once the previous launcher *and all its roles* are gone -- a
SIGKILLed launcher's roles take a while to checkpoint and give their tasks back -- then shares it with its own roles.
The kernel drops a process's flock when it dies, however it dies, so a crash never leaves a stale lock.

    lock = RunLock.acquire(run_dir, wait_s=300, on_wait=print)   # the launcher
    hold_inherited()                                             # a role, from cli/main.py
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Callable
from pathlib import Path

LOCK_NAME = ".lock"
ENV = "RLBUS_RUN_LOCK"

_held: list[int] = []  # fds this process keeps open (and so locked) until it exits


class RunDirBusy(RuntimeError):
    """Another `rlbus up`, or the roles of one, still run in this run directory."""


class RunLock:
    path: Path
    fd: int

    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd

    @classmethod
    def acquire(cls, run_dir: Path, *, wait_s: float, on_wait: Callable[[str], None] | None = None,
                poll_s: float = 0.5) -> RunLock:
        """Take the run directory's lock exclusively (waiting up to `wait_s` for earlier holders to exit), then
        keep it shared, so the roles this launcher starts may share it. Raises RunDirBusy after `wait_s`."""
        path = run_dir / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        deadline = time.monotonic() + wait_s
        told = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise RunDirBusy(f"{run_dir} is still in use by another rlbus up or its roles after {wait_s:.0f}s "
                                     f"(they hold {path}); stop them, or give this run another logging.run_dir")
                if not told and on_wait is not None:
                    on_wait(f"waiting for the roles of an earlier rlbus up of {run_dir} to exit")
                    told = True
                time.sleep(poll_s)
        # Shared from here on: a second launcher still cannot get it exclusively, the roles can join.
        fcntl.flock(fd, fcntl.LOCK_SH)
        return cls(path, fd)

    def env(self) -> dict[str, str]:
        """What a role's environment needs to hold this lock too."""
        return {ENV: str(self.path)}

    def release(self) -> None:
        os.close(self.fd)


def hold_inherited() -> None:
    """In a role started by `rlbus up`: hold the launcher's run lock shared until this process exits."""
    path = os.environ.get(ENV)
    if not path:
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return  # the run directory was removed under us; nothing to guard
    fcntl.flock(fd, fcntl.LOCK_SH)
    _held.append(fd)
