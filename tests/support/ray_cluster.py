"""Fixtures for a real local Ray: one loopback head per test session, shared by every test that needs Ray.

    .venv/bin/python -m pytest -q tests/integration/test_transfer_queue.py

The head runs as a child process (`ray start --head --block`, bus.ray_cluster.start_ray_head), so tests can also
connect subprocesses to it (`ray_env` is the environment they need: token auth is on, see `head_env`). Only that
head's process group is stopped at the end -- never `ray stop`, which would stop every Ray of this user.
`ray_driver` runs a driver subprocess that holds a named actor until the test is done with it.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import tempfile
import textwrap
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

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

    ray_head.apply_env()  # token auth: RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH
    ensure_ray(RayConfig(address=ray_head.address, namespace="rlbus-tests"))
    yield ray_head.address


@pytest.fixture(scope="session")
def ray_env(ray_head, ray_address) -> dict[str, str]:
    """Environment for a subprocess that connects to the session's Ray (pass `ray_address` to it)."""
    return head_env(ray_head)


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


def head_env(head, base: dict[str, str] | None = None) -> dict[str, str]:
    """`base` (default os.environ) with what a process needs to join `head` (RAY_AUTH_MODE, RAY_AUTH_TOKEN_PATH)."""
    env = dict(os.environ if base is None else base)
    head.apply_env(env)
    return env


_DRIVER = textwrap.dedent("""
    import json, os, sys
    import ray
    from rlbus.bus.ray_cluster import ensure_ray
    from rlbus.schemas.config import RayConfig

    address, namespace, name = sys.argv[1:4]
    ensure_ray(RayConfig(address=address, namespace=namespace))

    @ray.remote(num_cpus=0)
    class Echo:
        def pid(self):
            return os.getpid()

    actor = Echo.options(name=name).remote()
    actor_pid = ray.get(ray.get_actor(name).pid.remote(), timeout=60)  # found again by its name
    print(json.dumps({"pid": os.getpid(), "actor_pid": actor_pid, "named": ray.util.list_named_actors()}), flush=True)
    sys.stdin.read()  # hold the actor (and its worker) until the test closes our stdin
""")


@dataclass
class Driver:
    proc: subprocess.Popen
    pid: int  # the driver's own pid
    actor_pid: int  # the worker process that runs its named actor
    named: list[str]  # ray.util.list_named_actors() as the driver saw it


@contextlib.contextmanager
def ray_driver(address: str, env: dict[str, str], name: str = "echo", timeout_s: float = 90.0) -> Iterator[Driver]:
    """A driver subprocess connected (through ensure_ray) to `address` holding a named actor, until the block ends."""
    with tempfile.TemporaryFile("w+") as err:  # a file, not a pipe: Ray's warnings cannot fill it and block the driver
        proc = subprocess.Popen(
            [sys.executable, "-c", _DRIVER, address, "rlbus-tests", name],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
        )  # fmt: skip
        try:
            ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
            line = proc.stdout.readline() if ready else ""
            if not line:
                proc.kill()
                proc.wait()
                err.seek(0)
                raise AssertionError(f"driver not ready in {timeout_s}s (rc {proc.returncode}):\n{err.read()[-3000:]}")
            info = json.loads(line)
            yield Driver(proc, info["pid"], info["actor_pid"], info["named"])
        finally:
            if proc.poll() is None:
                proc.stdin.close()  # the driver exits; its (non-detached) actor goes with it
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            proc.stdout.close()
