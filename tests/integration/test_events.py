"""The event log: the recorder archives the bus (real nats-server) and resumes after a restart without gaps or
duplicates; step records are cut back on resume; `rlbus events` filters, decodes and exports a recorded run.

    .venv/bin/python -m pytest -q tests/integration/test_events.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rlbus.consumers.event_log import read_entries, read_steps
from rlbus.consumers.recorder import Recorder
from rlbus.schemas.config import BusConfig
from rlbus.schemas.wire import DeadLetter, ProducerHeartbeat, PromptTask, RoleStarted, SampleMeta, StepCompleted, \
    TrajectoryGroup, WeightsPublished
from tests.integration.test_replay import GROUP_SIZE, NUM_STEPS, record_run


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return record_run(tmp_path_factory.mktemp("recorded"))


def _group(i: int, producer: str = "p0") -> TrajectoryGroup:
    return TrajectoryGroup(group_id=f"g{i}", task_id=f"g{i}", producer_id=producer,
                           samples=[SampleMeta(key=f"g{i}/0", prompt_len=3, response_len=4, reward=1.0)])


# ---------------------------------------------------------------------------------------------------------------
# recording from the bus


async def test_recorder_archives_the_bus_and_resumes_after_restart(bus_config: BusConfig, run_name: str,
                                                                   tmp_path: Path) -> None:
    from rlbus.bus.client import Bus

    async with await Bus.connect(bus_config, run_name, name="test") as bus:
        await bus.ensure_streams()
        s = bus.subjects
        for i in range(3):
            await bus.publish(s.traj, _group(i, producer=f"p{i % 2}"), msg_id=f"g{i}")
        await bus.publish(s.weights, WeightsPublished(version=1, step=1, num_bytes=10, checksum="ab"))
        await bus.publish(s.event("heartbeat.p0"), ProducerHeartbeat(producer_id="p0", version=1))
        await bus.publish_event(RoleStarted(role="trainer", role_id="t"))
        await bus.publish_event(StepCompleted(step=1, version=1, group_ids=["g0", "g1"]))
        await bus.publish_raw(s.traj, b"\x93not a group")  # undecodable: archived as a dead letter, watch goes on
        await bus.publish(s.dead_letter, DeadLetter(reason="bad", original_subject=s.prompts, payload=b"x"))

        rec = Recorder(tmp_path, "metadata")
        await rec.start(bus)
        rec.prompt(PromptTask(task_id="e0-i1-a0", prompt=[], n=GROUP_SIZE), subject=s.prompts)
        await rec.drain({s.traj_stream: 4, s.weights_stream: 1, s.events_stream: 4})
        await rec.stop()
        assert [e.msg.group_id for e in read_entries(tmp_path, "traj")] == ["g0", "g1", "g2"]
        assert [e.seq for e in read_entries(tmp_path, "traj")] == [1, 2, 3]
        assert read_entries(tmp_path, "weights")[0].msg.version == 1
        assert read_entries(tmp_path, "heartbeats")[0].msg.producer_id == "p0"
        assert isinstance(read_entries(tmp_path, "lifecycle")[0].msg, RoleStarted)
        assert read_entries(tmp_path, "completed")[0].msg.group_ids == ["g0", "g1"]
        letters = read_entries(tmp_path, "dead-letter")
        assert sorted(e.msg.consumer for e in letters) == ["", "recorder"]
        assert read_entries(tmp_path, "prompts")[0].msg.task_id == "e0-i1-a0"

        # Published while the recorder is down; a torn line from a crash mid-write is on disk too.
        for i in range(3, 5):
            await bus.publish(s.traj, _group(i), msg_id=f"g{i}")
        with (tmp_path / "events" / "traj.jsonl").open("ab") as f:
            f.write(b'{"seq": 99, "subj')
        rec = Recorder(tmp_path, "metadata")
        await rec.start(bus)
        await rec.drain({s.traj_stream: 6})
        await rec.stop()
        entries = read_entries(tmp_path, "traj")
        assert [e.seq for e in entries] == [1, 2, 3, 5, 6]  # nothing lost, nothing twice
        assert [e.msg.group_id for e in entries][-2:] == ["g3", "g4"]
        assert len(read_entries(tmp_path, "dead-letter")) == 2  # the bad traj message (seq 4) was not re-archived
        assert len(read_entries(tmp_path, "heartbeats")) == 1


def test_resume_cuts_back_steps_after_the_restored_one(tmp_path: Path) -> None:
    run = record_run(tmp_path)["run_dir"]
    assert [r.step for r in read_steps(run)] == [1, 2, 3, 4]
    Recorder(run, "full", resume_step=2)  # the trainer restarts from the checkpoint at step 2
    assert [r.step for r in read_steps(run)] == [1, 2]
    assert sorted(p.name for p in (run / "events" / "steps").iterdir()) == ["step_00000001", "step_00000002"]


def test_metadata_mode_writes_no_tensors_and_off_writes_nothing(tmp_path: Path) -> None:
    meta = record_run(tmp_path / "m", mode="metadata")["run_dir"]
    records = read_steps(meta)
    assert len(records) == NUM_STEPS and all(r.payload == "metadata" and r.payload_bytes == 0 for r in records)
    assert not (meta / "events" / "steps").exists()
    off = record_run(tmp_path / "o", mode="off")["run_dir"]
    assert not (off / "events").exists()


# ---------------------------------------------------------------------------------------------------------------
# rlbus events


def _json_lines(text: str) -> list[dict]:
    return [json.loads(ln) for ln in text.splitlines() if ln.strip()]


def test_events_lists_and_filters(recorded: dict[str, Any], capsys) -> None:
    from rlbus.cli.events import main

    run = str(recorded["run_dir"])
    assert main([run, "--kind", "steps", "--json"]) == 0
    rows = _json_lines(capsys.readouterr().out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["payload"] == "full" and r["payload_bytes"] > 0 for r in rows)
    assert rows[2]["pg_loss"] == recorded["rows"][2]["actor/pg_loss"]

    assert main([run, "--kind", "steps", "--steps", "2:3", "--json"]) == 0
    assert [r["step"] for r in _json_lines(capsys.readouterr().out)] == [2, 3]
    assert main([run, "--kind", "steps", "--group", "e0-i31-a0", "--json"]) == 0
    assert [r["step"] for r in _json_lines(capsys.readouterr().out)] == [3]
    assert main([run, "--steps", "4"]) == 0  # the table view
    out = capsys.readouterr().out
    assert "steps (1)" in out and "prompts" not in out
    assert main([run, "--kind", "steps", "--producer", "p1", "--steps", "3:", "--json"]) == 0
    assert [r["groups"] for r in _json_lines(capsys.readouterr().out)] == [["e0-i30-a0", "e0-i31-a0"],
                                                                           ["e0-i40-a0", "e0-i41-a0"]]


def test_events_decodes_a_group(recorded: dict[str, Any], capsys) -> None:
    from rlbus.cli.events import main

    run = str(recorded["run_dir"])
    assert main([run, "--group", "e0-i21-a0", "--decode", "--json"]) == 0
    samples = _json_lines(capsys.readouterr().out)
    assert len(samples) == GROUP_SIZE
    s = samples[1]
    assert s["step"] == 2 and s["reward"] == 1.0 and s["producer_id"] == "p1"
    assert s["response_mask"][3:5] == [0, 0] and len(s["response_mask"]) == s["response_len"]
    assert [t["role"] for t in s["turns"]] == ["assistant", "tool", "assistant"]
    assert s["prompt_text"].count("t") == s["prompt_len"]  # the word-level tokenizer's tokens t2..t63
    assert main([run, "--group", "e0-i21-a0", "--decode"]) == 0
    assert "mask:   11100" in capsys.readouterr().out


def test_events_exports_parquet(recorded: dict[str, Any], tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    from rlbus.cli.events import main

    out = tmp_path / "trajectories.parquet"
    assert main([str(recorded["run_dir"]), "--export", str(out)]) == 0
    table = pq.read_table(out)
    assert table.num_rows == NUM_STEPS * 2 * GROUP_SIZE
    assert {"text", "reward", "prompt_len", "response_len", "min_version", "producer_id", "step"} <= set(
        table.column_names)
    rows = table.to_pylist()
    assert sorted({r["step"] for r in rows}) == [1, 2, 3, 4]
    row = next(r for r in rows if r["key"] == "e0-i10-a0/2")
    assert row["reward"] == 0.0 and row["producer_id"] == "p0" and row["step"] == 1
    assert row["text"].count("t") == row["prompt_len"] + row["response_len"]  # word-level tokens t2..t63


async def test_events_follow_tails_a_live_run(bus_config: BusConfig, run_name: str, tmp_path: Path, capsys) -> None:
    import asyncio

    import yaml
    from rich.console import Console

    from rlbus.bus.client import Bus
    from rlbus.cli.events import Filters, follow

    (tmp_path / "launch.yaml").write_text(yaml.safe_dump({
        "name": run_name, "model": {"path": "unused"},
        "bus": {"url": bus_config.url, "creds_file": bus_config.creds_file},
    }))  # fmt: skip
    async with await Bus.connect(bus_config, run_name, name="test") as bus:
        await bus.ensure_streams()
        await bus.publish(bus.subjects.traj, _group(0), msg_id="g0")  # before the tail starts: not shown
        task = asyncio.create_task(follow(tmp_path, Filters(kinds=("traj",), producer="p1"), config=None,
                                          overrides=[], as_json=True, console=Console()))
        await asyncio.sleep(1.0)
        for i in (1, 2, 3):
            await bus.publish(bus.subjects.traj, _group(i, producer=f"p{i % 2}"), msg_id=f"g{i}")
        await bus.publish(bus.subjects.weights, WeightsPublished(version=1, step=1, num_bytes=1, checksum=""))
        deadline = asyncio.get_running_loop().time() + 10
        shown: list[dict] = []
        while len(shown) < 2 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.1)
            shown += _json_lines(capsys.readouterr().out)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert [(r["kind"], r["group_id"]) for r in shown] == [("traj", "g1"), ("traj", "g3")]
