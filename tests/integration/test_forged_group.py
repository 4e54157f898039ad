"""A producer credential cannot steer the feeder: trajectory groups forged with it -- naming real prompts in flight
but payload keys no producer put, or a prompt never released -- are dead-lettered with the reason, and no prompt is
re-issued for them while its real group may still come (trainer/feeder.py `vouch`, consumers/batcher.py). Once
`feeder.orphan_grace_s` has passed with no group of it, such a prompt is re-issued: none stays in flight for good.

    .venv/bin/python -m pytest -q tests/integration/test_forged_group.py

Real nats-server (the producer's own least-privilege credential), real Ray, a real trainer; no producer runs until
the forged groups are judged, so the prompts they name are certainly in flight, not trained. Then one producer
finishes the run, and the ledger is checked.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from rlbus.bus.client import Bus
from rlbus.consumers.ledger import read_ledger
from rlbus.schemas.config import BusConfig
from rlbus.schemas.wire import DeadLetter, SampleMeta, TrajectoryGroup, TypedDecoder
from tests.support.runs import check_ledger, log_tail, small_run_config, start_role, wait_exit, write_config

pytestmark = pytest.mark.slow


def _forged(task: str, index: int, version: int = 0) -> TrajectoryGroup:
    samples = [SampleMeta(key=f"{task}/d9/{j}", prompt_len=4, response_len=8, reward=float(j), min_version=version,
                          max_version=version) for j in range(2)]  # fmt: skip
    return TrajectoryGroup(group_id=task, task_id=task, producer_id="p-forger", samples=samples, index=index)


async def _publish_forged(cfg: BusConfig, run: str) -> None:
    async with await Bus.connect(cfg, run, name="forger") as bus:
        # No Nats-Msg-Id: the real producer's group for the same task must still get through afterwards.
        for task, index in (("e0-i0-a0", 0), ("e0-i1-a0", 1), ("e0-i200-a0", 200)):
            await bus.publish(bus.subjects.traj, _forged(task, index))
        # Made by weights the trainer (at version 0) never had: judged, it would be dropped and its prompt re-issued.
        await bus.publish(bus.subjects.traj, _forged("e0-i2-a0", 2, version=7))


async def _dead_letters(cfg: BusConfig, run: str) -> list[DeadLetter]:
    async with await Bus.connect(cfg, run, name="test") as bus:
        return await bus.snapshot(bus.subjects.dead_letter, DeadLetter)


@pytest.mark.parametrize("grace", [600.0, 3.0])
def test_groups_forged_with_a_producer_credential_steer_nothing(
    tmp_path, bus_config, run_creds, ray_address, tiny_model_dir, run_name, role_processes, grace
):
    run_dir = tmp_path / "run"
    engine = {"type": "simulated", "mean_tokens": 16, "tail_alpha": 3.0, "seconds_per_token": 0.005}
    cfg = small_run_config(run_name, run_dir, tiny_model_dir, bus_config.url, bus_config.creds_file, ray_address,
                           trainer={"total_steps": 4, "groups_per_step": 2, "checkpoint_interval": 2},
                           feeder={"shuffle": False, "orphan_grace_s": grace},
                           # the bound on a producer's put-to-publish time, which the never-put check adds 10 s to
                           bus={"retry_s": 2.0},
                           rollout={"agent_loop": "single_turn", "engine": engine})  # fmt: skip
    cfg_path = write_config(tmp_path / "run.yaml", cfg)
    logs = tmp_path / "logs"
    trainer = start_role("trainer", cfg_path, logs, creds=run_creds)
    role_processes.append(trainer)
    deadline = time.monotonic() + 240
    feeder = run_dir / "feeder.json"  # e0-i0..e0-i2 released (no shuffle): in the queue, nobody to take them
    while not (feeder.is_file() and json.loads(feeder.read_text())["released"] >= 3):
        assert time.monotonic() < deadline and trainer.poll() is None, log_tail(trainer)
        time.sleep(0.5)
    time.sleep(13)  # the TransferQueue's shards have run well past the producers' put-to-publish bound (12 s)
    producer = BusConfig(url=bus_config.url, creds_file=run_creds["producer"], connect_timeout_s=5.0)
    asyncio.run(_publish_forged(producer, run_name))

    reasons: dict[str, str] = {}
    decoder = TypedDecoder(TrajectoryGroup)
    while len(reasons) < 4:
        assert time.monotonic() < deadline and trainer.poll() is None, (reasons, log_tail(trainer))
        time.sleep(1.0)
        letters = asyncio.run(_dead_letters(bus_config, run_name))
        reasons = {decoder.decode(x.payload).task_id: x.reason for x in letters if x.original_subject.endswith(".traj")}
    assert all("never put" in reasons[t] for t in ("e0-i0-a0", "e0-i1-a0", "e0-i2-a0")), reasons
    assert "never released" in reasons["e0-i200-a0"], reasons
    if grace > 100:
        state = json.loads(feeder.read_text())
        assert state["reissues"] == [] and state["abandoned"] == 0 and state["attempts"] == {}, state
    else:  # no group of e0-i0..e0-i2 came within the grace: each released again as attempt 1
        while json.loads(feeder.read_text())["attempts"] != {"e0-i0": 1, "e0-i1": 1, "e0-i2": 1}:
            assert time.monotonic() < deadline and trainer.poll() is None, (json.loads(feeder.read_text()),
                                                                             log_tail(trainer))  # fmt: skip
            time.sleep(0.5)
        assert sorted(json.loads(feeder.read_text())["orphans_handled"]) == ["e0-i0-a0", "e0-i1-a0", "e0-i2-a0"]

    # The producer rolls out what is in the queue, and the run finishes clean: within the grace the real prompts
    # were never re-issued; after it, their re-issues are trained and the first releases' groups are superseded.
    p0 = start_role("producer", cfg_path, logs, "--id", "p0", name="p0", creds=run_creds)
    role_processes.append(p0)
    assert wait_exit(trainer, 300) == 0, log_tail(trainer)
    check_ledger(run_dir, cfg)
    ledger = read_ledger(run_dir)
    first, again = {"e0-i0-a0", "e0-i1-a0", "e0-i2-a0"}, {"e0-i0-a1", "e0-i1-a1", "e0-i2-a1"}
    if grace > 100:
        assert first <= set(ledger.trained) and not (again | {"e0-i200-a0"}) & set(ledger.released)
    else:
        assert again <= set(ledger.trained) and not first & set(ledger.trained) and first <= ledger.reissued
        assert "e0-i200-a0" not in ledger.released
