"""Fixtures for a real local Ray: one loopback head per test session, shared by every test that needs Ray.

    .venv/bin/python -m pytest -q tests/integration/test_transfer_queue.py

The head runs as a child process (`ray start --head --block`, bus.ray_cluster.start_ray_head), so tests can also
connect subprocesses to it (`ray_env` is the environment they need). Only that head's process group is stopped at
the end -- never `ray stop`, which would stop every Ray of this user.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from rlbus.schemas.config import RayConfig


@pytest.fixture(scope="session")
def ray_head():
    from rlbus.bus.ray_cluster import start_ray_head, stop_ray_head

    head = start_ray_head(num_cpus=2, object_store_memory=1024**3)
    try:
        yield head
    finally:
        import ray

        ray.shutdown()
        stop_ray_head(head)


@pytest.fixture(scope="session")
def ray_address(ray_head) -> Iterator[str]:
    """GCS address of the session's Ray; Ray is initialised in the test process against it."""
    from rlbus.bus.ray_cluster import ensure_ray

    os.environ.update(ray_head.env)
    ensure_ray(RayConfig(address=ray_head.address, namespace="rlbus-tests"))
    yield ray_head.address


@pytest.fixture(scope="session")
def ray_env(ray_head, ray_address) -> dict[str, str]:
    """Environment for a subprocess that connects to the session's Ray (pass `ray_address` to it)."""
    return dict(os.environ, **ray_head.env)


@pytest.fixture
def ray_config(ray_address) -> RayConfig:
    """Small capacities so that limits are easy to reach: 2 shards x (8 items, 64 KiB)."""
    return RayConfig(
        address=ray_address,
        namespace="rlbus-tests",
        num_storage_actors=2,
        capacity_items=16,
        capacity_bytes=128 * 1024,
        weight_versions_kept=2,
    )


@pytest.fixture
def run_name(ray_config) -> Iterator[str]:
    """A run name unique to the test; its named actors are killed afterwards."""
    from rlbus.bus.ray_store import teardown

    name = f"t-{uuid.uuid4().hex[:10]}"
    yield name
    teardown(name, ray_config)
