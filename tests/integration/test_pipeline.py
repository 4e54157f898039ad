"""The whole pipeline as separate processes: bus, Ray, trainer, producers started and stopped at will.

    .venv/bin/python -m pytest -q tests/integration/test_pipeline.py

Real nats-server, real Ray, real trainer and producer processes (`python -m rlbus.cli ...`), a tiny real model in
the trainer; the producers' engine is the simulated one (generation time without the compute), so that what is
measured is the pipeline, not two cores shared by three processes.
"""

from __future__ import annotations

import asyncio
import re
import signal
import time

import msgspec
import pytest

from rlbus.bus.client import Bus
from rlbus.cli.status import gather_status
from rlbus.schemas.config import BusConfig
from rlbus.schemas.config_io import load_config
from rlbus.schemas.wire import ProducerHeartbeat, StepCompleted, TrajectoryGroup
from tests.support.runs import (
    log_tail,
    small_run_config,
    start_role,
    stop,
    wait_for_steps,
    write_config,
)
from rlbus.trainer.metrics import read_metrics

pytestmark = pytest.mark.slow


async def _collect(bus_cfg: BusConfig, run: str, subject_kind: str, typ, deliver: str = "all") -> list:
    async with await Bus.connect(bus_cfg, run, name="test") as bus:
        return await bus.snapshot(bus.subjects.event(subject_kind), typ, deliver=deliver)


async def _counts(bus_cfg: BusConfig, run: str) -> dict[str, int]:
    async with await Bus.connect(bus_cfg, run, name="test") as bus:
        s = bus.subjects
        return {
            "traj": await bus.stream_msgs(s.traj_stream),
            "prompts": await bus.stream_msgs(s.prompts_stream),
            "dead_letters": len(await _drain_dead(bus)),
        }


async def _drain_dead(bus: Bus) -> list:
    from rlbus.schemas.wire import DeadLetter

    return await bus.snapshot(bus.subjects.dead_letter, DeadLetter, deliver="all")


def _kill_mid_rollout(proc) -> str:
    """SIGKILL `proc` right after its log shows it began rolling out a task; return that task's id."""
    path = proc.log_path
    seen = len(path.read_text(errors="replace").splitlines())
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        lines = path.read_text(errors="replace").splitlines()
        for line in lines[seen:]:
            m = re.search(r"task (\S+): rolling out", line)
            if m:
                proc.kill()
                proc.wait()
                return m.group(1)
        seen = len(lines)
        time.sleep(0.01)
    pytest.fail(f"{path} showed no new rollout within 120 s")


def _group_by(bus_cfg: BusConfig, run: str, group_id: str):
    async def read():
        async with await Bus.connect(bus_cfg, run, name="test") as bus:
            groups = await bus.snapshot(bus.subjects.traj, TrajectoryGroup)
        return next((g for g in groups if g.group_id == group_id), None)

    return asyncio.run(read())


def _groups_published(bus_cfg: BusConfig, run: str) -> int:
    return asyncio.run(_counts(bus_cfg, run))["traj"]


def test_producers_join_and_die_while_the_run_goes_on(tmp_path, bus_config, run_creds, ray_address, tiny_model_dir,
                                                      run_name, role_processes):
    run_dir = tmp_path / "run"
    # The simulated engine sleeps for its generation time instead of computing: producers then scale the way
    # GPU producers do, rather than fighting the trainer for this machine's two cores.
    engine = {"type": "simulated", "mean_tokens": 24, "tail_alpha": 3.0, "seconds_per_token": 0.03}
    cfg = small_run_config(run_name, run_dir, tiny_model_dir, bus_config.url, bus_config.creds_file, ray_address,
                           # More steps than the test needs: it stops the trainer itself once the kill is
                           # recovered, so timing on a slow machine cannot end the run early.
                           trainer={"total_steps": 100_000, "groups_per_step": 2, "max_staleness": 2,
                                    "checkpoint_interval": 4},
                           rollout={"n": 4, "max_new_tokens": 48, "max_response_tokens": 48,
                                    "agent_loop": "single_turn", "engine": engine})
    cfg_path = write_config(tmp_path / "run.yaml", cfg)
    logs = tmp_path / "logs"
    trainer = start_role("trainer", cfg_path, logs, creds=run_creds)
    p0 = start_role("producer", cfg_path, logs, "--id", "p0", name="p0", creds=run_creds)
    role_processes += [trainer, p0]
    wait_for_steps(run_dir, 2, [trainer, p0])

    # Throughput with one producer, then with two.
    window = 20.0
    before = _groups_published(bus_config, run_name)
    time.sleep(window)
    one = (_groups_published(bus_config, run_name) - before) / window
    p1 = start_role("producer", cfg_path, logs, "--id", "p1", name="p1", creds=run_creds)
    role_processes.append(p1)
    beats = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not any(b.producer_id == "p1" and b.groups_done for b in beats):
        beats = asyncio.run(_collect(bus_config, run_name, "heartbeat.*", ProducerHeartbeat, "last_per_subject"))
        time.sleep(1.0)
    status = asyncio.run(gather_status(load_config(cfg_path)))  # what `rlbus status` shows, read from the bus
    assert {"p0", "p1"} <= {hb.producer_id for hb in status["heartbeats"]}
    assert status["step"] is not None and status["weights"].version >= 1
    before = _groups_published(bus_config, run_name)
    time.sleep(window)
    two = (_groups_published(bus_config, run_name) - before) / window
    assert two > one, f"groups/s with two producers {two:.3f} not above one producer's {one:.3f}"

    # SIGKILL the first producer mid-rollout: the moment its log says it started a task (a rollout takes far
    # longer than this poll). Its task must come back after ack_wait and be finished by the second producer.
    task_id = _kill_mid_rollout(p0)
    killed_at = read_metrics(run_dir)[-1]["step"]
    deadline = time.monotonic() + 180  # ack_wait is 8 s: the task comes back and p1 finishes it
    while not (done := _group_by(bus_config, run_name, task_id)):
        assert time.monotonic() < deadline, f"the killed producer's task {task_id} was never finished"
        assert trainer.poll() is None, log_tail(trainer)
        time.sleep(1.0)
    assert done.producer_id == "p1"
    assert re.search(rf"task {re.escape(task_id)}: rolling out \(delivery [2-9]", p1.log_path.read_text()), \
        "p1 finished the task without it being a redelivery"
    wait_for_steps(run_dir, killed_at + 4, [trainer, p1])  # and the run goes on with p1 alone
    assert stop(trainer, signal.SIGTERM) == 0  # a clean stop: checkpoint, then exit 0
    stop(p1, signal.SIGTERM)

    rows = read_metrics(run_dir)
    last = rows[-1]["step"]
    assert [r["step"] for r in rows] == list(range(1, last + 1))
    for r in rows:
        assert r["staleness/max"] <= 2, f"step {r['step']} trained a group beyond max_staleness: {r}"
    steps = asyncio.run(_collect(bus_config, run_name, "step", StepCompleted))
    trained = [gid for s in steps for gid in s.group_ids]
    assert len(trained) == len(set(trained)) == last * 2, "a group was trained twice"

    # Conservation: every task the feeder released is a published group or still waits in the prompts queue.
    counts = asyncio.run(_counts(bus_config, run_name))
    feeder = msgspec.json.decode((run_dir / "feeder.json").read_bytes())
    assert counts["dead_letters"] == 0
    assert feeder["released"] == counts["traj"] + counts["prompts"], (feeder, counts)
