"""A three-server NATS cluster on loopback for system tests (each server an EmbeddedServer with `cluster=`, all
sharing one credentials store), and what tests ask of it: its meta leader, a stream's leader.

    servers = cluster(tmp_path, run_name); wait_for_meta_leader(servers[0].creds_file("admin", run_name))
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import nats

from rlbus.bus.auth import load_creds
from rlbus.bus.ray_cluster import free_ports
from rlbus.bus.server import Cluster, EmbeddedServer



def cluster(tmp_path: Path, run: str) -> list[EmbeddedServer]:
    route_ports = free_ports(3)
    servers = []
    for i, port in enumerate(route_ports):
        peers = [f"127.0.0.1:{p}" for p in route_ports if p != port]
        servers.append(EmbeddedServer(tmp_path / f"nats-{i}", runs=[run], cluster=Cluster("rlbus-test", port, peers),
                                      creds_store=tmp_path / "bus-creds").start())
    return servers


async def _until(admin_file: Path, ask, timeout: float):
    """Ask the cluster (as the run's admin) `ask(js)` until it answers something truthy; errors count as "not yet"
    until `timeout`."""
    creds = load_creds(admin_file)
    nc = await nats.connect(creds["url"].split(","), user=creds["user"], password=creds["password"],
                            inbox_prefix=creds["inbox_prefix"])
    try:
        js = nc.jetstream()
        deadline = time.monotonic() + timeout
        while True:
            try:
                answer = await ask(js)
                if answer:
                    return answer
            except Exception:
                if time.monotonic() > deadline:
                    raise
            if time.monotonic() > deadline:
                raise TimeoutError(f"no answer from the cluster within {timeout}s")
            await asyncio.sleep(0.3)
    finally:
        await nc.close()


async def stream_leader(admin_file: Path, stream: str, timeout: float = 60.0) -> str:
    """The server name of `stream`'s leader, once the cluster has one (JetStream needs a meta leader first)."""
    async def leader(js):
        info = await js.stream_info(stream)
        return info.cluster.leader if info.cluster else None

    return await _until(admin_file, leader, timeout)


def server_named(servers: list[EmbeddedServer], name: str) -> EmbeddedServer:
    return next(s for s in servers if s._server_name == name)


def wait_for_meta_leader(admin_file: Path, timeout: float = 60.0) -> None:
    """Block until JetStream answers on the cluster (a meta leader is elected)."""
    async def ask(js):
        await js.account_info()
        return True

    asyncio.run(_until(admin_file, ask, timeout))
