"""Roles forked from `rlbus up`'s fork server (cli/preload.py) are processes of their own, as exec'd ones are.

    .venv/bin/python -m pytest -q tests/integration/test_preload.py
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from rlbus.bus.proc import command_line, descendants
from rlbus.cli.main import main
from rlbus.cli.preload import RoleServer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server() -> RoleServer:
    return RoleServer(["rlbus.cli.main", "torch"], main)


def _wait_for(path: Path, text: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = path.read_text(errors="replace") if path.is_file() else ""
        if text in seen:
            return seen
        time.sleep(0.05)
    raise AssertionError(f"{text!r} not in {path} within {timeout}s: {seen[-2000:]!r}")


def _stat(pid: int) -> list[str]:
    text = Path(f"/proc/{pid}/stat").read_text()
    return text[text.rindex(")") + 2 :].split()  # state, ppid, pgrp, session, ...


def test_a_forked_role_runs_the_command_with_its_log_and_exit_code(server, tmp_path):
    log = tmp_path / "show.log"
    role = server.start(["config", "show", str(REPO / "configs" / "quickstart.yaml"), "trainer.lr=0.125"],
                        dict(os.environ), log)
    assert role.wait(timeout=60) == 0
    assert "lr: 0.125" in log.read_text()  # its stdout went to its log, all of it (flushed at exit)

    bad = server.start(["config", "show", str(tmp_path / "missing.yaml")], dict(os.environ), tmp_path / "bad.log")
    assert bad.wait(timeout=60) not in (0, None)
    assert "missing.yaml" in (tmp_path / "bad.log").read_text()  # the error, in its log


def test_a_forked_role_is_its_own_session_titled_with_its_command_and_killed_by_pid(server, tmp_path):
    log = tmp_path / "bus.log"
    argv = ["bus", "up", "--dir", str(tmp_path / "store"), "--port", "0", "--run", "forked"]
    role = server.start(argv, dict(os.environ), log)
    try:
        _wait_for(log, "nats-server running (pid ")
        assert command_line(role.pid) == [sys.executable, "-m", "rlbus.cli", *argv]  # what `ps` shows
        state, ppid, _pgrp, session = _stat(role.pid)[:4]
        assert int(session) == role.pid  # its own session: a terminal's Ctrl-C does not reach it
        assert int(ppid) != os.getpid() and role.pid in descendants(os.getpid())  # forked by our server
        assert role.poll() is None
        role.send_signal(signal.SIGTERM)  # `rlbus bus up` stops its nats-server and exits 0 on SIGTERM
        assert role.wait(timeout=30) == 0
    finally:
        role.kill()

    again = server.start(argv, dict(os.environ), tmp_path / "again.log")  # the server forks again after a role ended
    try:
        _wait_for(tmp_path / "again.log", "nats-server running (pid ")
        again.kill()
        assert again.wait(timeout=30) == -signal.SIGKILL
    finally:
        again.kill()


# Run in a fresh interpreter: this test process may have drawn from Ray's ID generator already.
_FORK_IDS = """
import importlib, os
from rlbus.cli.preload import ENGINE_MODULES, ROLE_MODULES
for m in (*ROLE_MODULES, *ENGINE_MODULES.values(), "rlbus.producers.evaluator"):
    importlib.import_module(m)
from ray._raylet import ObjectID
for _ in range(2):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(w, ObjectID.from_random().hex().encode())
        os._exit(0)
    os.waitpid(pid, 0)
    print(os.read(r, 200).decode())
"""


def test_roles_forked_from_the_server_draw_different_ray_ids():
    # Everything the fork server may import leaves Ray's ID generator undrawn, so each forked role seeds its own:
    # a draw before the fork (a module-level ray.remote did one) gave sibling roles the same "random" object IDs,
    # and two producers starting together then collided on the object store's warm-up object.
    import subprocess

    out = subprocess.run([sys.executable, "-c", _FORK_IDS], capture_output=True, text=True, timeout=120, check=True)
    ids = out.stdout.split()
    assert len(ids) == 2 and ids[0] != ids[1], out.stdout
