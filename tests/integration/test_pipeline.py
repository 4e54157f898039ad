"""The whole pipeline as separate processes: bus, Ray, trainer, producers started and stopped at will.

    .venv/bin/python -m pytest -q tests/integration/test_pipeline.py

Real nats-server, real Ray, real trainer and producer processes (`python -m rlbus.cli ...`), a tiny real model.
"""

from __future__ import annotations

import asyncio
import signal
import time

import msgspec
import pytest

from bus.client import Bus
from schemas.config import BusConfig
from schemas.wire import ProducerHeartbeat, StepCompleted
from tests.support.runs import (
    log_tail,
    small_run_config,
    start_role,
    stop,
    wait_for_steps,
    write_config,
)
from trainer.metrics import read_metrics

pytestmark = pytest.mark.slow


async def _collect(bus_cfg: BusConfig, run: str, subject_kind: str, typ, deliver: str = "all") -> list:
    async with await Bus.connect(bus_cfg, run, name="test") as bus:
        return await bus.snapshot(bus.subjects.event(subject_kind), typ, deliver=deliver)


async def _counts(bus_cfg: BusConfig, run: str) -> dict[str, int]:
    async with await Bus.connect(bus_cfg, run, name="test") as bus:
        s = bus.subjects
        info = await bus.js.consumer_info(s.prompts_stream, s.prompts_consumer)
        return {
            "traj": await bus.stream_msgs(s.traj_stream),
            "prompts": await bus.stream_msgs(s.prompts_stream),
            "redelivered": int(info.num_redelivered or 0),
            "dead_letters": len(await _drain_dead(bus)),
        }


async def _drain_dead(bus: Bus) -> list:
    from schemas.wire import DeadLetter

    return await bus.snapshot(bus.subjects.dead_letter, DeadLetter, deliver="all")


def _groups_published(bus_cfg: BusConfig, run: str) -> int:
    return asyncio.run(_counts(bus_cfg, run))["traj"]


def test_producers_join_and_die_while_the_run_goes_on(tmp_path, bus_config, ray_address, tiny_model_dir, run_name,
                                                      role_processes):
    run_dir = tmp_path / "run"
    cfg = small_run_config(run_name, run_dir, tiny_model_dir, bus_config.url, bus_config.creds_file, ray_address,
                           # More steps than the test needs: it stops the trainer itself once the kill is
                           # recovered, so timing on a slow machine cannot end the run early.
                           trainer={"total_steps": 100_000, "groups_per_step": 2, "max_staleness": 2,
                                    "checkpoint_interval": 4},
                           rollout={"n": 4, "max_new_tokens": 24, "max_response_tokens": 64})
    cfg_path = write_config(tmp_path / "run.yaml", cfg)
    logs = tmp_path / "logs"
    trainer = start_role("trainer", cfg_path, logs)
    p0 = start_role("producer", cfg_path, logs, "--id", "p0", name="p0")
    role_processes += [trainer, p0]
    wait_for_steps(run_dir, 2, [trainer, p0])

    # Throughput with one producer, then with two.
    window = 20.0
    before = _groups_published(bus_config, run_name)
    time.sleep(window)
    one = (_groups_published(bus_config, run_name) - before) / window
    p1 = start_role("producer", cfg_path, logs, "--id", "p1", name="p1")
    role_processes.append(p1)
    beats = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not any(b.producer_id == "p1" and b.groups_done for b in beats):
        beats = asyncio.run(_collect(bus_config, run_name, "heartbeat.*", ProducerHeartbeat, "last_per_subject"))
        time.sleep(1.0)
    before = _groups_published(bus_config, run_name)
    time.sleep(window)
    two = (_groups_published(bus_config, run_name) - before) / window
    assert two > one, f"groups/s with two producers {two:.3f} not above one producer's {one:.3f}"

    # SIGKILL the first producer mid-rollout: its task comes back after ack_wait and the second one finishes it.
    last = {b.producer_id: b for b in asyncio.run(
        _collect(bus_config, run_name, "heartbeat.*", ProducerHeartbeat, "last_per_subject"))}
    assert last["p0"].inflight >= 1, "p0 held no task when killed; the test would prove nothing"
    stop(p0, signal.SIGKILL)
    killed_at = read_metrics(run_dir)[-1]["step"]
    deadline = time.monotonic() + 180  # ack_wait is 8 s: the task comes back and p1 finishes it
    while asyncio.run(_counts(bus_config, run_name))["redelivered"] < 1:
        assert time.monotonic() < deadline, "the killed producer's task was never redelivered"
        assert trainer.poll() is None, log_tail(trainer)
        time.sleep(1.0)
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
