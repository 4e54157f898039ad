"""Fixtures for a real nats-server: one embedded server per test module on a free loopback port.

    def test_x(bus_config, run_name): ...   # BusConfig with the server's URL and credentials; a run of its own

Run with any bus test, e.g. `.venv/bin/python -m pytest -q tests/integration/test_bus.py`.
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path
from typing import Iterator

import pytest

from rlbus.bus.auth import ROLES
from rlbus.bus.server import EmbeddedServer
from rlbus.schemas.config import BusConfig


@pytest.fixture(scope="module")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServer]:
    """An EmbeddedServer (JetStream, file storage, per-role users) on a free 127.0.0.1 port, stopped at module end.

    It serves the run "tests", whose admin (allowed everything) the bus tests use; a test that runs roles with
    their own least-privilege credentials asks for `run_creds`.
    """
    store: Path = tmp_path_factory.mktemp("nats")
    server = EmbeddedServer(store, port=0, host="127.0.0.1", runs=["tests"])
    server.start()
    yield server
    server.stop()


@pytest.fixture
def bus_config(nats_server: EmbeddedServer) -> BusConfig:
    """A BusConfig pointing at the module's server with its admin credentials (short timeouts for tests)."""
    return BusConfig(url=nats_server.url, creds_file=str(nats_server.creds_file("admin")), connect_timeout_s=5.0)


@pytest.fixture
def run_creds(nats_server: EmbeddedServer, run_name: str) -> dict[str, str]:
    """role -> credentials file of `run_name` on the module's server (its users are added on the fly)."""
    nats_server.add_run(run_name)
    return {role: str(nats_server.creds_file(role, run_name)) for role in ROLES}


def unique_run_name(label: str = "t") -> str:
    """A run name nobody else uses, so tests never share streams or consumers."""
    clean = re.sub(r"[^A-Za-z0-9_-]", "_", label)[:40]
    return f"{clean}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def run_name(request: pytest.FixtureRequest) -> str:
    """A unique run name derived from the test's name."""
    return unique_run_name(request.node.name)
