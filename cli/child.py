"""One role process `rlbus up` supervises: started (a fresh python, or forked from the role server), polled,
signalled, stopped within a timeout, its process group's leftovers reaped, its log's tail read.

    child = Child("trainer", [sys.executable, "-m", "rlbus.cli", "trainer", "launch.yaml"], log_path)
    child.start(); ...; await child.stop()

    .venv/bin/python -m pytest -q tests/unit/test_launcher_child.py
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import IO

from rlbus.bus.proc import die_with_parent
from rlbus.cli.preload import ForkedRole, RoleServer

#: Seconds a stopping child gets before SIGKILL.
STOP_TIMEOUT_S = 60.0


class Child:
    """One supervised role process."""

    name: str
    role_id: str  # "trainer", or the producer id its RoleStarted carries
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen | ForkedRole | None
    server: RoleServer | None  # forks the role with its modules imported (launcher.preload); None: a fresh python
    start_failures: int  # deaths in a row before the process got going
    restarts: int  # every restart, for the record
    started_at: float  # wall time of the last start
    _log: IO[bytes] | None

    def __init__(self, name: str, argv: list[str], log_path: Path, role_id: str = "", server: RoleServer | None = None):
        self.name, self.argv, self.log_path, self.role_id = name, argv, log_path, role_id or name
        self.server = server
        self.proc, self.start_failures, self.restarts, self._log = None, 0, 0, None
        self.started_at = 0.0

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def reap_group(self) -> None:
        """SIGKILL whatever is left of this role's process group once the role has exited: it runs in its own
        session, so the group holds only what the role started and did not take down with it (a vLLM engine core
        whose producer or evaluator was killed while starting it lives on otherwise, its parent gone). The group's
        id stays taken while any member lives, so this reaches no one else."""
        if self.proc is None or self.proc.poll() is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # nothing left

    def start(self) -> None:
        self.reap_group()  # the leftovers of the run before this restart
        self.started_at = time.time()
        if self._log is not None:
            self._log.close()
            self._log = None
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        # Its own session keeps a terminal's Ctrl-C for the launcher, which stops every child at once; if the
        # launcher dies without doing so, the kernel SIGTERMs the child (the trainer checkpoints, producers give
        # their tasks back), so a launcher started again meets no leftover roles. A role forked from the server
        # (cli/preload.py) is set up the same way there.
        if self.server is not None:
            self.proc = self.server.start(self.argv[3:], env, self.log_path)
            return
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, preexec_fn=die_with_parent)

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)  # only our own child, by pid

    async def stop(self, timeout: float = STOP_TIMEOUT_S) -> int | None:
        if self.proc is None:
            return None
        self.signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.reap_group()
        if self._log is not None:
            self._log.close()
        return self.proc.returncode

    def log_tail(self, lines: int = 40) -> str:
        if not self.log_path.is_file():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def config_error(self) -> str:
        """The config error the role's log ends with (`rlbus: config error: ...` and the lines it lists below), or
        the log's last lines when it holds none."""
        lines = self.log_tail(400).splitlines()
        starts = [i for i, line in enumerate(lines) if line.startswith("rlbus: config error:")]
        if not starts:
            return "\n".join(lines[-20:])
        end = starts[-1] + 1
        while end < len(lines) and lines[end].startswith("  "):  # ConfigInvalid: one error a line, indented
            end += 1
        return "\n".join(lines[starts[-1]:end])
