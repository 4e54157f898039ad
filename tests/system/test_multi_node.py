"""Several machines, simulated on loopback addresses of this one (127.0.0.2, 127.0.0.3, ...), as the README's
multi-machine recipes start them:

- a Ray head and a second node joined by `ray start --address` (bus/ray_cluster.py), the TransferQueue shards
  spread over both; the second node SIGKILLed mid-run under a real `rlbus up`, and the run finishes;
- one short job across all of it: a three-server NATS cluster, the trainer under `torchrun` with two ranks (PPO
  with a critic, two updates a step), producers pinned to the second Ray node; then `rlbus replay` of the recorded
  run on one process;
- the same short job twice, full fine-tuning and LoRA, the trainer on the head node and the producers on the second:
  the bytes that cross to the second "machine" per weight version, from the kernel's TCP counters
  (tests/support/netbytes.py).

    .venv/bin/python -m pytest -q tests/system/test_multi_node.py

Every process signalled was started by the test, and is signalled by pid (a node: its own process group).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from rlbus.bus.ray_cluster import free_port, start_ray_head, start_ray_node, stop_ray_head
from rlbus.bus.server import EmbeddedServer
from rlbus.consumers.event_log import read_entries
from rlbus.schemas.wire import WeightsPublished
from tests.support.nats_cluster import cluster, wait_for_meta_leader
from tests.support.netbytes import crossed, snapshot
from tests.support.runs import ROOT, check_ledger, small_run_config, start_role, stop, wait_for_steps, write_config

pytestmark = pytest.mark.slow

HEAD_IP, NODE_IP = "127.0.0.2", "127.0.0.3"


@pytest.fixture
def two_ray_nodes(monkeypatch):
    head = start_ray_head(num_cpus=2, node_ip=HEAD_IP, object_store_memory=300 * 1024**2)
    node = None
    try:
        node = start_ray_node(head, NODE_IP, num_cpus=1, resources={"second_node": 1},
                              object_store_memory=300 * 1024**2)
        for k, v in head.env.items():  # what every process of the run needs to join (token auth)
            monkeypatch.setenv(k, v)
        monkeypatch.delenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", raising=False)
        yield head, node
    finally:
        if node is not None:
            stop_ray_head(node)
        stop_ray_head(head)
        # Loopback only: nothing Ray wrote names another address of this machine.
        leaks = subprocess.run(["grep", "-rlE", r"\b(192|10|172)\.[0-9]+\.[0-9]+\.[0-9]+:[0-9]+", head.temp_dir],
                               capture_output=True, text=True).stdout
        assert not leaks, leaks


def _shard_nodes(run: str, ray_address: str, create: bool = False) -> dict[str, str]:
    """Node IP of each of the run's TransferQueue shards, asked from a fresh driver (Ray's GCS actor table); with
    `create`, that driver first creates them as the run's trainer would (2 shards)."""
    code = (
        "import json, ray, sys\n"
        "from rlbus.bus.ray_cluster import ensure_ray\n"
        "from rlbus.bus.transfer_queue import TransferQueue\n"
        "from rlbus.schemas.config import RayConfig\n"
        f"cfg = RayConfig(address={ray_address!r}, num_storage_actors=2, capacity_bytes=256 * 1024**2)\n"
        "ensure_ray(cfg)\n"
        f"if {create}: TransferQueue.connect({run!r}, cfg)\n"
        "ips = {n['NodeID']: n['NodeManagerAddress'] for n in ray.nodes()}\n"
        "print('SHARDS', json.dumps({a['Name']: ips.get(a['Address']['NodeID'], '?')"
        " for a in ray._private.state.actors().values()"
        f" if a['Name'].startswith('rlbus-{run}-tq-') and a['State'] == 'ALIVE'}}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    # Ray may print its own lines (a node marked dead, ...) to stdout too.
    return json.loads(next(line for line in out.stdout.splitlines() if line.startswith("SHARDS "))[len("SHARDS "):])


def test_second_ray_node_sigkilled_mid_run_loses_only_what_it_held(tmp_path, tiny_model_dir, run_name, two_ray_nodes):
    head, node = two_ray_nodes
    with EmbeddedServer(tmp_path / "bus", runs=[run_name]) as server:
        run_dir = tmp_path / "run"
        cfg = small_run_config(run_name, run_dir, tiny_model_dir, server.url, str(server.creds_file("admin")),
                               head.address, ray={"num_storage_actors": 2},
                               trainer={"total_steps": 300, "checkpoint_interval": 5}, rollout={"num_producers": 2})
        # The shards as the trainer makes them (it attaches to these): one on each node.
        assert sorted(_shard_nodes(run_name, head.address, create=True).values()) == [HEAD_IP, NODE_IP]
        up = start_role("up", write_config(tmp_path / "run.yaml", cfg), tmp_path / "logs", name="up")
        try:
            wait_for_steps(run_dir, 2, [up], timeout=400)
            os.killpg(node.pid, signal.SIGKILL)  # the second "machine": the node this test started, all of it
            # Ray restarted the lost shard (empty) on the node that is left, and the run goes on.
            deadline = time.monotonic() + 120  # Ray declares the node dead after its health checks fail
            while (placed := sorted(_shard_nodes(run_name, head.address).values())) != [HEAD_IP, HEAD_IP]:
                assert time.monotonic() < deadline and up.poll() is None, placed
                time.sleep(2)
            assert up.wait(timeout=600) == 0
        finally:
            stop(up, signal.SIGKILL)
        check_ledger(run_dir, cfg)
        assert _shard_nodes(run_name, head.address) == {}  # the finished run took its actors out of our cluster


def test_a_job_across_a_nats_cluster_two_ray_nodes_and_torchrun(tmp_path, tiny_model_dir, run_name, two_ray_nodes):
    head, _ = two_ray_nodes
    servers = cluster(tmp_path, run_name)
    procs: list[subprocess.Popen] = []
    try:
        admin = servers[0].creds_file("admin", run_name)
        wait_for_meta_leader(admin)
        creds = {role: str(servers[0].creds_file(role, run_name)) for role in ("trainer", "producer", "observer")}
        urls = ",".join(s.url for s in servers)
        run_dir = tmp_path / "run"
        cfg = small_run_config(run_name, run_dir, tiny_model_dir, urls, "", head.address,
                               bus={"replicas": 3}, ray={"num_storage_actors": 2},
                               trainer={"total_steps": 4, "num_ranks": 2, "checkpoint_interval": 2,
                                        "groups_per_step": 2, "micro_batch_size": 2, "mini_batches": 2},
                               algorithm={"adv_estimator": "gae", "gamma": 1.0, "lam": 0.95},
                               critic={"lr": 1e-3})
        cfg_path = write_config(tmp_path / "run.yaml", cfg)
        logs = tmp_path / "logs"
        logs.mkdir()
        # The trainer "machine": torchrun with two ranks, its rendezvous on a free loopback port (the README's
        # command gives --master-addr and --master-port; torchrun's default port is fixed).
        log = open(logs / "trainer.log", "wb")
        trainer = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
             "--master-port", str(free_port()), "-m", "rlbus.cli", "trainer", str(cfg_path),
             f"bus.creds_file={creds['trainer']}", f"ray.node_ip_address={HEAD_IP}"],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo"))
        log.close()
        trainer.log_path = logs / "trainer.log"  # type: ignore[attr-defined]
        procs.append(trainer)
        # The rollout "machine": producers attached to the second Ray node.
        for i in range(2):
            procs.append(start_role("producer", cfg_path, logs, f"ray.node_ip_address={NODE_IP}", "--id", f"p{i}",
                                    name=f"producer-{i}", creds=creds))
        wait_for_steps(run_dir, 4, procs, timeout=500)
        assert trainer.wait(timeout=180) == 0, (logs / "trainer.log").read_text()[-3000:]
        for p in procs[1:]:
            stop(p)
        trainer_log = (logs / "trainer.log").read_text()
        assert trainer_log.count(f"attached to node {HEAD_IP}") == 2  # both ranks
        for i in range(2):
            assert f"attached to node {NODE_IP}" in (logs / f"producer-{i}.log").read_text()
        check_ledger(run_dir, cfg)
        # The recorded run replays on one process from its two ranks' checkpoint, as a user debugging it would:
        # each of the two updates a step trains every rank's own mini-batch (trainer/replay.py), actor and critic.
        out = tmp_path / "replay.json"
        replayed = subprocess.run([sys.executable, "-m", "rlbus.cli", "replay", str(run_dir), "--from-step", "3",
                                   "--steps", "2", "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                                  timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"), check=False)
        assert replayed.returncode == 0, replayed.stdout[-3000:] + replayed.stderr[-3000:]
        diffs = json.loads(out.read_text())
        assert diffs["from_checkpoint"] == 2 and diffs["steps"] == [3, 4]
        compared = {(d["step"], d["metric"]): d for d in diffs["diffs"]}
        for step in (3, 4):
            for name in ("actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm",
                         "critic/values_mean", "critic/returns_mean"):
                d = compared[step, name]
                assert d["replayed"] == pytest.approx(d["recorded"], rel=2e-4, abs=1e-6), (step, name, d)
    finally:
        for p in procs:
            stop(p, signal.SIGKILL, timeout=10)
        for s in servers:
            s.stop()


def _job_across_nodes(tmp_path, model_dir, run: str, server: EmbeddedServer, head, node, **sections) -> dict:
    """The trainer attached to the head node, two producers to the second, 4 steps; what crossed to the second
    node's processes from the head's (Ray's object transfers and calls; the bus is a machine of its own)."""
    run_dir = tmp_path / run
    cfg = small_run_config(run, run_dir, model_dir, server.url, "", head.address,
                           trainer={"total_steps": 4, "checkpoint_interval": 4}, **sections)
    cfg_path = write_config(tmp_path / f"{run}.yaml", cfg)
    creds = {role: str(server.creds_file(role, run)) for role in ("trainer", "producer")}
    logs = tmp_path / f"{run}-logs"
    before = snapshot()
    procs = [start_role("trainer", cfg_path, logs, f"ray.node_ip_address={HEAD_IP}", creds=creds)]
    try:
        for i in range(2):
            procs.append(start_role("producer", cfg_path, logs, f"ray.node_ip_address={NODE_IP}", "--id", f"p{i}",
                                    name=f"producer-{i}", creds=creds))
        wait_for_steps(run_dir, 4, procs, timeout=400)
        assert procs[0].wait(timeout=180) == 0, (logs / "trainer.log").read_text()[-3000:]
        after = snapshot()
    finally:
        for p in procs:
            stop(p, signal.SIGKILL, timeout=10)
    check_ledger(run_dir, cfg)
    loaded = {int(v) for i in range(2)
              for v in re.findall(r"loaded weights v(\d+)", (logs / f"producer-{i}.log").read_text())}
    receivers = {node.pid, *(p.pid for p in procs[1:])}  # a Ray node, a role: each its own process group
    senders = {head.pid, procs[0].pid}
    published = [e.msg for e in read_entries(run_dir, "weights") if isinstance(e.msg, WeightsPublished)]
    return {"bytes": crossed(before, after, receivers=receivers, senders=senders), "versions": len(loaded),
            "version_bytes": max(w.num_bytes for w in published), "encoding": {w.encoding for w in published}}


def test_lora_sends_the_second_node_a_fraction_of_full_syncs_bytes(tmp_path, tiny_model_dir, run_name,
                                                                     two_ray_nodes):
    """Per weight version the producers on the second node loaded, the bytes that crossed to it: a LoRA job's
    adapter-only versions against full fine-tuning's whole copies, the same job otherwise."""
    pytest.importorskip("peft")
    head, node = two_ray_nodes
    runs = [f"{run_name}-full", f"{run_name}-lora"]
    with EmbeddedServer(tmp_path / "bus", runs=runs) as server:
        full = _job_across_nodes(tmp_path, tiny_model_dir, runs[0], server, head, node)
        lora = _job_across_nodes(tmp_path, tiny_model_dir, runs[1], server, head, node,
                                 model={"lora": {"rank": 4, "alpha": 8.0}})
    assert full["encoding"] == {"full"} and lora["encoding"] == {"adapter"}
    assert full["versions"] >= 2 and lora["versions"] >= 2
    per_full, per_lora = full["bytes"] / full["versions"], lora["bytes"] / lora["versions"]
    print(f"\ncrossed to the second node per version loaded: full {per_full / 1e6:.2f} MB "
          f"({full['bytes']} B, {full['versions']} versions of {full['version_bytes']} B), "
          f"LoRA {per_lora / 1e6:.3f} MB ({lora['bytes']} B, {lora['versions']} versions of "
          f"{lora['version_bytes']} B): {per_lora / per_full:.1%}")
    assert per_full >= 0.9 * full["version_bytes"]  # every loaded version crossed (the counters see the weights)
    assert per_lora < 0.25 * per_full
