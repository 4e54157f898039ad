"""A three-server NATS cluster on loopback (JetStream, `bus.replicas=3`), as `rlbus bus up --cluster-port` makes it,
under a real `rlbus up`; one server after another is SIGKILLed mid-run -- first the one leading the `prompts` stream
(the feeder publishes there, producers pull from it; on this cluster it often leads the advisories stream too), then,
once it rejoined, the one leading `traj` (the stream the trainer consumes) -- and the run reaches total_steps with a
clean ledger.

    .venv/bin/python -m pytest -q tests/system/test_nats_cluster.py

Only the servers this test started are killed, by pid.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from rlbus.bus.auth import load_creds
from rlbus.bus.server import EmbeddedServer
from rlbus.schemas.subjects import Subjects
from tests.support.nats_cluster import cluster, free_ports, server_named, stream_leader, wait_for_meta_leader
from tests.support.runs import check_ledger, small_run_config, start_role, stop, wait_for_steps, write_config

pytestmark = pytest.mark.slow


def test_rlbus_bus_up_forms_a_cluster_from_the_command_line(tmp_path, run_name):
    # The same cluster through the CLI a user runs on each machine: three `rlbus bus up`, one shared creds store.
    ports = free_ports(6)  # one draw: two could hand the same port back twice
    route_ports, client_ports = ports[:3], ports[3:]
    procs = []
    try:
        for i in range(3):
            routes = ",".join(f"127.0.0.1:{p}" for p in route_ports if p != route_ports[i])
            log = open(tmp_path / f"bus-{i}.log", "wb")
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "rlbus.cli", "bus", "up", "--dir", str(tmp_path / f"nats-{i}"),
                 "--port", str(client_ports[i]), "--run", run_name, "--cluster-port", str(route_ports[i]),
                 "--routes", routes, "--creds-store", str(tmp_path / "creds")],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
            log.close()
            admin = tmp_path / "creds" / "creds" / run_name / "admin.json"
            deadline = time.monotonic() + 30
            while str(client_ports[i]) not in (load_creds(admin)["url"] if admin.is_file() else ""):
                assert procs[-1].poll() is None, (tmp_path / f"bus-{i}.log").read_text()
                assert time.monotonic() < deadline, (tmp_path / f"bus-{i}.log").read_text()
                time.sleep(0.2)
        creds = json.loads(admin.read_text())
        assert sorted(creds["url"].split(",")) == sorted(f"nats://127.0.0.1:{p}" for p in client_ports)
        wait_for_meta_leader(admin)
        assert oct((tmp_path / "creds" / "creds" / "cluster.json").stat().st_mode & 0o777) == "0o600"
    finally:
        for p in procs:
            stop(p)


def test_a_run_on_a_three_server_cluster_survives_each_server_sigkilled(tmp_path, tiny_model_dir, run_name):
    servers = cluster(tmp_path, run_name)
    try:
        admin = servers[0].creds_file("admin", run_name)
        wait_for_meta_leader(admin)
        urls = load_creds(admin)["url"]
        assert len(urls.split(",")) == 3
        run_dir = tmp_path / "run"
        cfg = small_run_config(run_name, run_dir, tiny_model_dir, urls, str(admin), "",
                               bus={"replicas": 3}, trainer={"total_steps": 12, "checkpoint_interval": 3},
                               rollout={"num_producers": 2})
        up = start_role("up", write_config(tmp_path / "run.yaml", cfg), tmp_path / "logs", name="up")
        subjects = Subjects.for_run(run_name)
        killed: list[EmbeddedServer] = []
        try:
            for at_step, stream in ((3, subjects.prompts_stream), (7, subjects.traj_stream)):
                wait_for_steps(run_dir, at_step, [up], timeout=400)
                victim = server_named(servers, asyncio.run(stream_leader(admin, stream)))
                assert victim.pid is not None
                os.kill(victim.pid, signal.SIGKILL)  # a server this test started, by pid
                victim.stop()  # reap it
                killed.append(victim)
                if len(killed) == 1:
                    wait_for_steps(run_dir, at_step + 2, [up], timeout=400)
                    victim.restart()  # back on its store: it rejoins and catches up before the next kill
                    wait_for_meta_leader(admin)
            assert up.wait(timeout=600) == 0
        finally:
            stop(up, signal.SIGKILL)
        log = (tmp_path / "logs" / "up.log").read_text()
        assert "disconnected; reconnecting" in log or "retrying" in log  # the faults did reach the roles
        check_ledger(run_dir, cfg)
    finally:
        for s in servers:
            s.stop()
