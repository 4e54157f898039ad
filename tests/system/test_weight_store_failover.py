"""The weight store survives the loss of its node mid-publish: two Ray nodes on loopback (127.0.0.2 head,
127.0.0.3 node), the store placed on the second, that node SIGKILLed while versions are being put. Ray restarts the
store (empty) on the head; the put that meets the restart is retried (bus/ray_store.py `retried`) or held by Ray
until the store is back, so the publisher sees no error, and every later version is stored and read back with its
checksum.

    .venv/bin/python -m pytest -q tests/system/test_weight_store_failover.py

The publisher is a driver subprocess (this module run with -m), as a trainer would be: the test process may be
attached to another Ray already.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
import uuid

import pytest

from tests.support.runs import ROOT
from tests.system.test_multi_node import HEAD_IP, NODE_IP, two_ray_nodes  # noqa: F401 (the fixture)

pytestmark = pytest.mark.slow

#: Versions the publisher puts after the store is back on the head, before it stops.
AFTER_RESTART = 3


def test_the_node_holding_the_weight_store_killed_mid_publish(two_ray_nodes, tmp_path) -> None:  # noqa: F811
    head, node = two_ray_nodes
    run = f"ws-{uuid.uuid4().hex[:8]}"
    err_path = tmp_path / "publisher.err"  # a file, not a pipe: Ray's warnings cannot fill it and block the publisher
    with open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", __name__, head.address, run], stdout=subprocess.PIPE,
                                stderr=err, text=True, cwd=ROOT)  # fmt: skip
    lines: list[dict] = []
    try:
        deadline = time.monotonic() + 150
        while True:
            assert time.monotonic() < deadline and proc.poll() is None, (lines[-3:], _tail(proc, err_path))
            ready, _, _ = select.select([proc.stdout], [], [], 1.0)
            if not ready:
                continue
            text = proc.stdout.readline()
            assert text, _tail(proc, err_path)  # the publisher exited
            if not text.startswith("{"):
                continue  # Ray may print lines of its own
            line = json.loads(text)
            lines.append(line)
            if line.get("put") == 3 and line["node"] == NODE_IP:
                os.killpg(node.pid, signal.SIGKILL)  # the second "machine": the node this test started, all of it
            if "done" in line:
                break
        assert proc.wait(timeout=60) == 0, _tail(proc, err_path)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    done = lines[-1]
    assert done["done"] and done["node"] == HEAD_IP, lines  # restarted on the node that is left
    puts = [ln for ln in lines if "put" in ln]
    assert [p["put"] for p in puts] == list(range(1, len(puts) + 1))  # no version failed, none skipped
    assert done["versions"][-1] == puts[-1]["put"]
    # A put after the kill met the store's loss in one of two ways, by timing: sent while the store was
    # unreachable, Ray raised ActorUnavailableError into it and `retried` sent it again (a warning names the store);
    # sent once Ray had marked the store RESTARTING, Ray held it until the store was up on the head. Either way it
    # waited out the restart (a new worker process on the head) and did not fail.
    met = max(puts[3:], key=lambda p: p["s"])
    log_text = err_path.read_text()
    retried = "weight store rlbus-" in log_text and "actor unavailable" in log_text
    assert retried or met["s"] >= 0.5, (puts, log_text[-2000:])
    print(f"{len(puts)} versions; put {met['put']} met the node's loss and took {met['s']:.1f}s; retried: {retried}")


def _tail(proc: subprocess.Popen, err_path) -> str:  # type: ignore[no-untyped-def]
    return err_path.read_text()[-3000:] + ("" if proc.poll() is not None else "\n(still running)")


def _publish(address: str, run: str) -> None:
    """The trainer's side: put version after version (checking each put's checksum) until the store, restarted on
    the head, has taken AFTER_RESTART more; then read the last back against its checksum."""
    import ray
    import torch
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from rlbus.bus.ray_cluster import ensure_ray
    from rlbus.bus.ray_store import actor_name, teardown
    from rlbus.bus.weight_store import WeightStore, state_dict_checksum, weight_store_actor
    from rlbus.schemas.config import RayConfig

    cfg = RayConfig(address=address, namespace="rlbus-tests", weight_versions_kept=2)
    name = actor_name(run, "weights")
    ensure_ray(cfg)

    def store_node() -> str:
        ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        for a in ray._private.state.actors().values():
            if a["Name"] == name and a["State"] == "ALIVE":
                return ips.get(a["Address"]["NodeID"], "?")
        return ""

    try:
        second = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == NODE_IP)
        # The store as WeightStore.connect makes it, but placed on the second node (softly: Ray may restart it
        # elsewhere); connect() then attaches to it by name. Soft affinity may also place it on the head from the
        # start (a node still settling on a busy machine): then it is made again, for the test to mean anything.
        for _attempt in range(5):
            actor = weight_store_actor().options(
                name=name, namespace=cfg.namespace, lifetime="detached",
                scheduling_strategy=NodeAffinitySchedulingStrategy(second, soft=True),
            ).remote(cfg.weight_versions_kept, name)  # fmt: skip
            ray.get(actor.list_versions.remote())
            if store_node() == NODE_IP:
                break
            ray.kill(actor, no_restart=True)
            while _named(name, cfg.namespace):  # its name is free once Ray has it dead
                time.sleep(0.2)
        assert store_node() == NODE_IP, f"the weight store was placed on {store_node()}, not on {NODE_IP}, 5 times"
        store = WeightStore.connect(run, cfg)
        version, on_head, checksum = 0, 0, ""
        while on_head < AFTER_RESTART:
            version += 1
            sd = {"w": torch.full((256, 1024), float(version)), "b": torch.arange(version, version + 64.0)}
            t = time.monotonic()
            checksum = store.put_sync(version, sd).checksum
            took = time.monotonic() - t
            assert checksum == state_dict_checksum(sd)
            where = store_node()
            on_head += where == HEAD_IP
            print(json.dumps({"put": version, "s": round(took, 2), "node": where}), flush=True)
            time.sleep(0.2)
        got = store.get_sync(version, expect=checksum)
        assert float(got["w"][0, 0]) == float(version)
        print(json.dumps({"done": True, "node": store_node(), "versions": store.versions_sync()}), flush=True)
    finally:
        teardown(run, cfg)


def _named(name: str, namespace: str) -> bool:
    import ray

    try:
        ray.get_actor(name, namespace=namespace)
    except ValueError:
        return False
    return True


if __name__ == "__main__":
    _publish(*sys.argv[1:3])
