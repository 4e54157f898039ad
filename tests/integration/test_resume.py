"""Restarts: a trainer SIGKILLed between a step and its checkpoint, and `rlbus up` stopped with Ctrl-C and rerun.

    .venv/bin/python -m pytest -q tests/integration/test_resume.py
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys

import pytest

from rlbus.bus.auth import ROLES
from rlbus.bus.client import Bus
from rlbus.schemas.wire import StepCompleted
from rlbus.trainer.checkpoint import checkpoint_name, latest_checkpoint
from rlbus.trainer.metrics import read_metrics
from tests.support.runs import (
    ROOT,
    files_holding,
    small_run_config,
    start_role,
    stop,
    wait_exit,
    wait_for_steps,
    write_config,
)

pytestmark = pytest.mark.slow


async def _step_events(bus_cfg, run: str) -> list[StepCompleted]:
    async with await Bus.connect(bus_cfg, run, name="test") as bus:
        return await bus.snapshot(bus.subjects.event("step"), StepCompleted, deliver="all")


async def _until_step_published(bus_cfg, run: str, step: int, timeout: float = 30.0) -> None:
    """Return once StepCompleted for `step` is on the bus (the trainer publishes it just after the metrics row)."""
    async with await Bus.connect(bus_cfg, run, name="test-watch") as bus:
        async with asyncio.timeout(timeout):
            while not any(e.step >= step for e in await bus.snapshot(bus.subjects.event("step"), StepCompleted,
                                                                      deliver="last")):
                await asyncio.sleep(0.01)


def test_trainer_killed_between_step_and_checkpoint_trains_every_group_once(
        tmp_path, bus_config, run_creds, ray_address, tiny_model_dir, run_name, role_processes):
    run_dir = tmp_path / "run"
    total, per_step = 8, 2
    cfg = small_run_config(run_name, run_dir, tiny_model_dir, bus_config.url, bus_config.creds_file, ray_address,
                           trainer={"total_steps": total, "groups_per_step": per_step, "checkpoint_interval": 3,
                                    "max_staleness": 2})
    cfg_path = write_config(tmp_path / "run.yaml", cfg)
    logs = tmp_path / "logs"
    trainer = start_role("trainer", cfg_path, logs, creds=run_creds)
    producer = start_role("producer", cfg_path, logs, "--id", "p0", name="p0", creds=run_creds)
    role_processes += [trainer, producer]
    # Checkpoints at 3 and 6: kill the moment step 4 is logged and its StepCompleted published (the row is written
    # first: a kill between the two redoes step 4 with one event only, and nothing here would show it superseded).
    wait_for_steps(run_dir, 4, [trainer, producer], poll=0.01)
    asyncio.run(_until_step_published(bus_config, run_name, 4))
    stop(trainer, signal.SIGKILL)
    lost_from = read_metrics(run_dir)[-1]["step"]
    assert latest_checkpoint(run_dir / "checkpoints").name == checkpoint_name(3) and lost_from > 3, \
        "the kill did not land between a step and its checkpoint"
    restarted = start_role("trainer", cfg_path, logs, name="trainer-2", creds=run_creds)
    role_processes.append(restarted)
    assert wait_exit(restarted, timeout=600) == 0
    stop(producer)

    # The ledger: the last StepCompleted of each step number is the one that counts (a step redone after the crash
    # supersedes the lost attempt). Every group trained exactly once, and none of the lost steps' groups skipped.
    events = asyncio.run(_step_events(bus_config, run_name))
    final: dict[int, StepCompleted] = {}
    for e in events:
        final[e.step] = e
    assert sorted(final) == list(range(1, total + 1))
    ledger = [gid for s in sorted(final) for gid in final[s].group_ids]
    assert len(ledger) == len(set(ledger)) == total * per_step, "a group was trained twice"
    superseded = {gid for e in events if final[e.step] is not e for gid in e.group_ids}
    assert superseded, "no step was redone: the kill did not land between a step and its checkpoint"
    assert superseded <= set(ledger), "a group trained only by a lost step was skipped after the restart"
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, total + 1))
    assert [r["version"] for r in rows] == list(range(1, total + 1))


def test_up_stopped_with_ctrl_c_resumes_to_the_end(tmp_path, tiny_model_dir, run_name):
    run_dir = tmp_path / "run"
    total = 60  # long enough that the Ctrl-C lands mid-run on a fast machine (12 finished first)
    cfg = small_run_config(run_name, run_dir, tiny_model_dir, "", "", "",
                           trainer={"total_steps": total, "checkpoint_interval": 4},
                           rollout={"num_producers": 1})
    cfg["logging"].update(plot=True, tensorboard=True)
    cfg_path = write_config(tmp_path / "run.yaml", cfg)
    logs = tmp_path / "logs"
    first = start_role("up", cfg_path, logs, name="up-1")
    try:
        wait_for_steps(run_dir, 2, [first], timeout=400)
        first.send_signal(signal.SIGINT)  # what Ctrl-C does
        code = wait_exit(first, timeout=180)
    finally:
        stop(first, signal.SIGKILL)
    assert code == 130
    stopped_at = read_metrics(run_dir)[-1]["step"]
    assert stopped_at < total
    assert latest_checkpoint(run_dir / "checkpoints").name == checkpoint_name(stopped_at)  # checkpointed on the way out

    second = subprocess.run([sys.executable, "-m", "rlbus.cli", "up", str(cfg_path)], cwd=ROOT, capture_output=True,
                            text=True, timeout=900)
    assert second.returncode == 0, second.stderr[-4000:]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, total + 1))
    assert [r["version"] for r in rows] == list(range(1, total + 1))
    for made in ("config.yaml", "metrics.jsonl", "curves.png", "feeder.json"):
        assert (run_dir / made).is_file(), made
    # Secrets at rest: each role's password sits in its own 0600 file and nowhere else (config, launch.yaml,
    # logs, metrics, the event archive, checkpoints).
    role_files = sorted((run_dir / "bus" / "creds" / run_name).glob("*.json"))
    assert [p.stem for p in role_files] == sorted(ROLES)
    passwords = [json.loads(p.read_text())["password"] for p in role_files]
    assert files_holding([run_dir, logs], passwords, skip=set(role_files)) == []
    assert any((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(run_dir / "final_model")
    AutoTokenizer.from_pretrained(run_dir / "final_model")
