"""The embedded nats-server: auth is required, credentials are private, `rlbus bus up` works, data survives a restart.

    .venv/bin/python -m pytest -q tests/integration/test_embedded_server.py
"""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from rlbus.bus.client import Bus
from rlbus.bus.auth import ROLES, load_creds
from rlbus.bus.server import EmbeddedServer
from rlbus.schemas.config import BusConfig
from rlbus.schemas.errors import BusError
from rlbus.schemas.wire import TrajectoryGroup
from tests.support.nats_server import unique_run_name

REPO = Path(__file__).resolve().parents[2]


async def test_client_without_credentials_is_refused(nats_server: EmbeddedServer) -> None:
    with pytest.raises(BusError, match=nats_server.url):
        await Bus.connect(BusConfig(url=nats_server.url, connect_timeout_s=3.0), "r")


async def test_client_with_wrong_password_is_refused(nats_server: EmbeddedServer) -> None:
    user = load_creds(nats_server.creds_file("trainer"))["user"]
    cfg = BusConfig(url=nats_server.url, user=user, password="not-the-password", connect_timeout_s=3.0)
    with pytest.raises(BusError, match="refused"):
        await Bus.connect(cfg, "r")


async def test_client_with_creds_file_connects(bus_config: BusConfig, run_name: str) -> None:
    async with await Bus.connect(bus_config, run_name) as bus:
        await bus.ensure_streams()
        assert await bus.stream_msgs(bus.subjects.traj_stream) == 0


def test_creds_files_are_private(nats_server: EmbeddedServer) -> None:
    for role in ROLES:
        mode = stat.S_IMODE(os.stat(nats_server.creds_file(role)).st_mode)
        assert mode == 0o600, (role, oct(mode))
        creds = load_creds(nats_server.creds_file(role))
        assert creds["url"] == nats_server.url and len(creds["password"]) >= 24
    # The server config holds bcrypt hashes only, and is private all the same.
    assert stat.S_IMODE(os.stat(nats_server.store_dir / "nats-server.conf").st_mode) == 0o600


def test_server_binds_loopback_only(nats_server: EmbeddedServer) -> None:
    assert nats_server.url.startswith("nats://127.0.0.1:")
    assert nats_server.is_running() and nats_server.pid


def _read_lines_until(proc: subprocess.Popen[str], marker: str, timeout: float) -> list[str]:
    lines: queue.Queue[str | None] = queue.Queue()

    def reader() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    threading.Thread(target=reader, daemon=True).start()
    seen: list[str] = []
    while True:
        line = lines.get(timeout=timeout)
        if line is None:
            raise AssertionError(f"`rlbus bus up` exited early; output: {seen}")
        seen.append(line)
        if line.startswith(marker):
            return seen


async def test_rlbus_bus_up_serves_until_sigterm(tmp_path: Path) -> None:
    store = tmp_path / "bus"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlbus.cli", "bus", "up", "--dir", str(store), "--port", "0", "--run", "cli"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out = _read_lines_until(proc, "  observer: ", timeout=30)
        (url,) = [line.split(": ", 1)[1] for line in out if line.startswith("url: ")]
        assert url.startswith("nats://127.0.0.1:")
        for role in ROLES:  # one line per role, each naming only that role's file
            path = store / "creds" / "cli" / f"{role}.json"
            assert f"  {role}: bus.url={url} bus.creds_file={path}" in out
        creds_file = str(store / "creds" / "cli" / "admin.json")
        (running,) = [line for line in out if line.startswith("nats-server running (pid ")]
        server_pid = int(running.split("pid ")[1].rstrip(")"))

        async with await Bus.connect(BusConfig(url=url, creds_file=creds_file), "cli") as bus:
            await bus.ensure_streams()
            await bus.publish(bus.subjects.traj, TrajectoryGroup(group_id="g", task_id="g", producer_id="p", samples=[]))
            assert await bus.stream_msgs(bus.subjects.traj_stream) == 1

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        # The nats-server child went down with it.
        with pytest.raises(ProcessLookupError):
            os.kill(server_pid, 0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_restarted_server_keeps_jetstream_data_and_credentials(tmp_path: Path) -> None:
    run = unique_run_name("restart")
    with EmbeddedServer(tmp_path / "bus") as first:
        password = load_creds(first.creds_file("admin"))["password"]
        cfg = BusConfig(url=first.url, creds_file=str(first.creds_file("admin")))
        async with await Bus.connect(cfg, run) as bus:
            await bus.ensure_streams()
            group = TrajectoryGroup(group_id="g1", task_id="g1", producer_id="p", samples=[], created_at=1.0)
            await bus.publish(bus.subjects.traj, group, msg_id="g1")
    assert not first.is_running()

    with EmbeddedServer(tmp_path / "bus") as second:
        assert load_creds(second.creds_file("admin"))["password"] == password
        # Clients configured with the creds file (and the new URL, as the port was picked afresh) get back in.
        cfg = BusConfig(url=second.url, creds_file=str(second.creds_file("admin")))
        async with await Bus.connect(cfg, run) as bus:
            await bus.ensure_streams()
            assert await bus.stream_msgs(bus.subjects.traj_stream) == 1
            (d,) = await bus.fetch(bus.subjects.traj, bus.subjects.traj_consumer, TrajectoryGroup, timeout=2.0)
            assert d.data == group and d.msg_id == "g1"
            await d.ack()


async def test_client_reconnects_after_server_restart(tmp_path: Path) -> None:
    run = unique_run_name("reconnect")
    first = EmbeddedServer(tmp_path / "bus").start()
    port = int(first.url.rsplit(":", 1)[1])
    # Only the creds file: the URL is read from it.
    cfg = BusConfig(creds_file=str(first.creds_file("admin")), reconnect_wait_s=0.05, max_reconnect_wait_s=0.2)
    second: EmbeddedServer | None = None
    try:
        async with await Bus.connect(cfg, run) as bus:
            await bus.ensure_streams()
            await bus.publish(bus.subjects.traj, TrajectoryGroup(group_id="a", task_id="a", producer_id="p", samples=[]))
            first.stop()
            await asyncio.sleep(0.5)  # several failed reconnect attempts with backoff
            second = EmbeddedServer(tmp_path / "bus", port=port).start()
            # The same connection carries on: the publish waits out the reconnect (retrying on ack timeout).
            await bus.publish(bus.subjects.traj, TrajectoryGroup(group_id="b", task_id="b", producer_id="p", samples=[]))
            assert await bus.stream_msgs(bus.subjects.traj_stream) == 2
            assert bus.nc.stats["reconnects"] >= 1
    finally:
        first.stop()
        if second is not None:
            second.stop()
