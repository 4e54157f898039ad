"""What rlbus's local processes listen on: loopback only (tests/support/listeners.py reads /proc).

    .venv/bin/python -m pytest -q tests/integration/test_listeners.py

- a two-rank gloo group from trainer.dist.spawn_local: the rendezvous store (served by the parent on 127.0.0.1;
  torch's own TCPStore would bind [::]) and gloo's pair sockets (GLOO_SOCKET_IFNAME=lo);
- a Ray head from bus.ray_cluster.start_ray_head (the session's) with a driver and an actor's worker: GCS, raylet
  (node manager, object manager), the Ray client server, the runtime-env agent, every core worker's gRPC server.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from tests.support.listeners import is_loopback, listening_sockets, process_tree
from tests.support.ray_cluster import head_env, ray_driver


def _report_listeners() -> dict:
    from rlbus.trainer.dist import barrier, destroy_distributed, init_distributed

    init_distributed("cpu")
    pids = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())  # a collective: gloo's pairs are connected by now
    found = []
    if dist.get_rank() == 0:  # the parent (its store), every rank, and whatever they started
        found = [(s.pid, s.name, s.address, s.port) for s in listening_sockets([os.getppid(), *process_tree(*pids)])]
    barrier()  # nobody leaves (and closes its sockets) before rank 0 has looked
    out = {"pids": pids, "parent": os.getppid(), "store_port": int(os.environ["MASTER_PORT"]), "found": found}
    destroy_distributed()
    return out


def test_spawn_local_listens_on_loopback_only():
    from rlbus.trainer.dist import spawn_local

    out = spawn_local(2, _report_listeners)[0]
    found = out["found"]
    bad = [s for s in found if not is_loopback(s[2])]
    assert not bad, f"listening beyond loopback: {bad}"
    # the check saw what it is about: the store (in this process) and a gloo pair socket in each rank
    assert (out["parent"], out["store_port"]) in {(pid, port) for pid, _, _, port in found}, found
    assert {pid for pid, *_ in found} >= set(out["pids"]), found


def test_ray_head_listens_on_loopback_only(ray_head):
    with ray_driver(ray_head.address, head_env(ray_head), name="listeners") as driver:
        pids = process_tree(ray_head.pid, driver.pid)
        assert driver.actor_pid in pids
        found = listening_sockets(pids)
    bad = [str(s) for s in found if not is_loopback(s.address)]
    assert not bad, f"listening beyond loopback: {bad}"
    names = {s.name for s in found}
    assert {"gcs_server", "raylet"} <= names, [str(s) for s in found]
    assert {driver.pid, driver.actor_pid} <= {s.pid for s in found}, [str(s) for s in found]
    gcs_port = int(ray_head.address.rsplit(":", 1)[1])
    assert any(s.name == "gcs_server" and s.port == gcs_port for s in found)
