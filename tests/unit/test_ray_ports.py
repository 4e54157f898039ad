"""The ports of a Ray start rlbus makes are drawn in one go, so no two of its components can get the same one.

    .venv/bin/python -m pytest -q tests/unit/test_ray_ports.py

A full `make test` once failed on a Ray head refusing to start: its GCS port and its runtime-env agent's port were
the same, drawn in two batches, the first released before the second (the OS may hand a released port back at
once). The fake here is that OS at its worst: every draw starts again from the same port.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from rlbus.bus import ray_cluster


class _Launched(Exception):
    pass


@pytest.fixture
def worst_os(monkeypatch, tmp_path: Path) -> list[list[str]]:
    """free_ports that returns ports 40000.. on every call, and a Popen that records the command and stops there."""
    commands: list[list[str]] = []

    def popen(cmd, **kwargs):
        commands.append(list(cmd))
        raise _Launched

    monkeypatch.setattr(ray_cluster, "free_ports", lambda n: list(range(40000, 40000 + n)))
    monkeypatch.setattr(subprocess, "Popen", popen)
    (tmp_path / "ray").mkdir()
    return commands


def _ports(cmd: list[str]) -> dict[str, int]:
    return {m[1]: int(m[2]) for a in cmd if (m := re.fullmatch(r"--([a-z-]*port)=(\d+)", a))}


def test_a_head_start_gives_each_component_its_own_port(worst_os, tmp_path: Path):
    with pytest.raises(_Launched):
        ray_cluster.start_ray_head(wait=False, temp_dir=str(tmp_path / "ray"))
    ports = _ports(worst_os[0])
    assert set(ports) >= {"port", "dashboard-port", *ray_cluster.NODE_PORTS}, ports
    assert len(set(ports.values())) == len(ports), ports  # no port twice
