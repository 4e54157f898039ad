"""The inspector's index (cli/ui_index.py) follows a run directory written by the real recorder: steps appended
while it is open appear on refresh, a run cut back by a resume or a rollback is read again, samples page and sort in
SQL, and a read-only run directory is indexed elsewhere.

    .venv/bin/python -m pytest -q tests/unit/test_ui_index.py
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from rlbus.cli.ui_index import RunIndex
from rlbus.cli.ui_views import compare, overview, samples_page
from rlbus.consumers.recorder import Recorder
from rlbus.schemas.wire import ChatMessage, PromptTask, SampleMeta, TrajectoryGroup


def _record(run_dir: Path, rec: Recorder, step: int, *, groups: int = 2, n: int = 3) -> None:
    gs = []
    for g in range(groups):
        task = f"e0-i{step * 10 + g}-a0"
        rec.prompt(PromptTask(task_id=task, n=n, prompt=[ChatMessage(role="user", content=f"what is {step}+{g}?")]))
        gs.append(TrajectoryGroup(group_id=task, task_id=task, producer_id=f"p{g}", samples=[
            SampleMeta(key=f"{task}/{s}", prompt_len=4, response_len=10 + s, reward=float(s == 0),
                       min_version=max(0, step - 1 - s), max_version=step - 1) for s in range(n)]))
    shards = [[(s, gi) for gi, g in enumerate(gs) for s in g.samples]]
    row = {"step": step, "version": step, "reward/mean": step / 10, "actor/entropy": 1.0 / step}
    rec.step(step=step, version=step, groups=gs, shards=shards, metrics=row)
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write(json.dumps(row) + "\n")


def test_the_index_follows_appends_and_cut_backs(tmp_path: Path) -> None:
    run = tmp_path / "run"
    rec = Recorder(run, "metadata")
    for step in (1, 2, 3):
        _record(run, rec, step)
    index = RunIndex.open(run)
    assert index.path == run / "ui" / "index.sqlite"
    assert overview(index)["series"]["step"] == [1, 2, 3]
    assert index.db.execute("SELECT count(*) FROM samples").fetchone()[0] == 3 * 6
    # staleness = the version the step trained from minus the sample's oldest token version
    assert {r[0] for r in index.db.execute("SELECT staleness FROM samples WHERE step=3")} == {0, 1, 2}

    _record(run, rec, 4)  # the live run goes on: only the new lines are read
    assert index.refresh()
    got = overview(index, since=3)
    assert got["series"]["step"] == [4] and got["series"]["reward/mean"] == [0.4]
    assert not index.refresh()  # nothing new

    generation = index.generation
    rec.cut_back(2)  # a guard rollback to step 2: steps 3 and 4 are redone
    lines = (run / "metrics.jsonl").read_text().splitlines()[:2]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    _record(run, rec, 3)
    index.refresh()
    assert index.generation > generation
    assert overview(index)["series"]["step"] == [1, 2, 3]
    assert [r[0] for r in index.db.execute("SELECT DISTINCT step FROM samples ORDER BY step")] == [1, 2, 3]
    # each step's record is read from its own line of the rewritten file
    assert [index.step_record(s).step for s in (1, 2, 3)] == [1, 2, 3] and index.step_record(4) is None
    assert index.step_record(3).groups[0].group_id == "e0-i30-a0"
    index.close()

    again = RunIndex.open(run)  # cached: nothing re-read, same answers
    assert overview(again)["series"]["step"] == [1, 2, 3]


def test_a_step_recorded_again_keeps_its_last_record(tmp_path: Path) -> None:
    """A step redone after a crash is appended again: its last record wins, read in one go or across refreshes."""
    run = tmp_path / "run"
    rec = Recorder(run, "metadata")
    _record(run, rec, 1)
    _record(run, rec, 2)
    _record(run, rec, 2, groups=1)  # step 2 again, in the same first read
    index = RunIndex.open(run)
    count = lambda step: index.db.execute("SELECT count(*) FROM samples WHERE step=?", (step,)).fetchone()[0]  # noqa: E731
    assert (count(1), count(2)) == (6, 3)
    assert index.db.execute("SELECT num_samples FROM steps WHERE step=2").fetchone()[0] == 3
    _record(run, rec, 1, groups=3)  # step 1 again, after the index was built
    assert index.refresh()
    assert (count(1), count(2)) == (9, 3)
    assert len(index.step_record(1).groups) == 3
    index.close()


def test_samples_page_sorts_filters_and_pages_on_the_server(tmp_path: Path) -> None:
    run = tmp_path / "run"
    rec = Recorder(run, "metadata")
    for step in range(1, 6):
        _record(run, rec, step)
    index = RunIndex.open(run)
    page = samples_page(index, {"sort": "length", "desc": "1", "limit": "4", "offset": "0"})
    assert page["total"] == 30 and len(page["rows"]) == 4
    assert [r["response_len"] for r in page["rows"]] == [12, 12, 12, 12]
    last = samples_page(index, {"sort": "length", "desc": "1", "limit": "4", "offset": "28"})
    assert [r["response_len"] for r in last["rows"]] == [10, 10]
    assert samples_page(index, {"step": "2:3"})["total"] == 12
    assert samples_page(index, {"step": "4"})["total"] == 6
    assert samples_page(index, {"producer": "p1", "min_reward": "1"})["total"] == 5
    found = samples_page(index, {"q": "what is 4+1"})
    assert found["total"] == 3 and {r["group_id"] for r in found["rows"]} == {"e0-i41-a0"}
    assert found["rows"][0]["prompt"] == "user: what is 4+1?"
    assert samples_page(index, {"min_staleness": "2"})["total"] == 3 * 2  # steps 3..5: each group's third sample
    cmp = compare(index, 2, 5)
    assert {m["metric"]: (m["a"], m["b"]) for m in cmp["metrics"]}["reward/mean"] == (0.2, 0.5)
    assert cmp["samples"]["a"]["samples"] == 6


def test_a_read_only_run_directory_is_indexed_elsewhere(tmp_path: Path) -> None:
    run = tmp_path / "run"
    rec = Recorder(run, "metadata")
    _record(run, rec, 1)
    mode = run.stat().st_mode
    os.chmod(run, stat.S_IRUSR | stat.S_IXUSR)
    try:
        if os.access(run, os.W_OK):  # root writes anyway: nothing to check here
            return
        index = RunIndex.open(run)
        assert run not in index.path.parents
        assert overview(index)["series"]["step"] == [1]
    finally:
        os.chmod(run, mode)


def test_the_inspector_serves_loopback_addresses_only() -> None:
    from rlbus.cli.ui import check_loopback

    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        check_loopback(host)
    for host in ("0.0.0.0", "::", "10.1.2.3", "example.org"):
        with pytest.raises(SystemExit, match="not a loopback address"):
            check_loopback(host)


def test_a_non_finite_metric_is_served_as_null(tmp_path: Path) -> None:
    from rlbus.cli.ui import _dumps

    run = tmp_path / "run"
    _record(run, Recorder(run, "metadata"), 1)
    with (run / "metrics.jsonl").open("a") as f:  # metrics.jsonl is json.dumps': a NaN loss is written as NaN
        f.write(json.dumps({"step": 2, "version": 2, "actor/pg_loss": float("nan"), "reward/mean": 0.5}) + "\n")
    index = RunIndex.open(run)
    served = json.loads(_dumps(compare(index, 1, 2)))
    assert {m["metric"]: m["b"] for m in served["metrics"]}["actor/pg_loss"] is None
    assert json.loads(_dumps(overview(index)))["series"]["reward/mean"] == [0.1, 0.5]


def _archive(run: Path, kind: str, msgs: list) -> None:
    """Archive lines as the recorder writes them (consumers/recorder.py: Entry(seq, subject, recorded_at, msg))."""
    import msgspec

    from rlbus.consumers.event_log import KINDS, Entry, events_dir

    with (events_dir(run) / KINDS[kind][0]).open("ab") as f:
        for i, m in enumerate(msgs):
            f.write(msgspec.json.encode(Entry(seq=i + 1, subject=f"rlbus.t.{kind}", recorded_at=m.created_at,
                                              msg=m)) + b"\n")


def test_producers_restarts_kills_versions_and_tokens(tmp_path: Path) -> None:
    from rlbus.cli.ui_views import producers
    from rlbus.schemas.wire import ProducerHeartbeat, RoleStarted, RoleStopped

    run = tmp_path / "run"
    _record(run, Recorder(run, "metadata"), 1)
    beat = lambda t, pid, version, tokens, discarded=0: ProducerHeartbeat(  # noqa: E731
        producer_id="p0", pid=pid, version=version, tokens_generated=tokens, tokens_discarded=discarded,
        created_at=100.0 + t)
    # p0's first process beats from t=0 to 4 and is SIGKILLed (no RoleStopped); its restart beats from t=30 (a gap:
    # offline meanwhile) and stops cleanly. p1 runs throughout and stops uncleanly.
    _archive(run, "heartbeats", [beat(0, 11, 0, 0), beat(2, 11, 1, 50), beat(4, 11, 2, 90, 7),
                                 beat(30, 12, 2, 10), beat(32, 12, 3, 40),
                                 ProducerHeartbeat(producer_id="p1", pid=21, version=1, tokens_generated=5,
                                                   created_at=101.0)])
    _archive(run, "lifecycle", [RoleStarted(role="producer", role_id="p0", pid=11, created_at=99.0),
                                RoleStarted(role="producer", role_id="p1", pid=21, created_at=99.5),
                                RoleStarted(role="producer", role_id="p0", pid=12, created_at=129.0),
                                RoleStopped(role="producer", role_id="p0", reason="done", created_at=133.0),
                                RoleStopped(role="producer", role_id="p1", reason="EngineDead", clean=False,
                                            created_at=134.0)])
    got = {p["producer_id"]: p for p in producers(RunIndex.open(run))["producers"]}
    p0 = got["p0"]
    assert [pr["pid"] for pr in p0["processes"]] == [11, 12] and p0["restarts"] == 1 and p0["killed"] == 1
    assert p0["processes"][1]["stop"] == {"t": 133.0, "reason": "done", "clean": True}
    assert [(sp["pid"], sp["start"], sp["end"]) for sp in p0["spans"]] == [(11, 100.0, 104.0), (12, 130.0, 132.0)]
    assert [v["version"] for v in p0["versions"]] == [0, 1, 2, 3]
    assert (p0["tokens_generated"], p0["tokens_discarded"]) == (90 + 40, 7)
    assert got["p1"]["processes"][0]["stop"]["clean"] is False and got["p1"]["restarts"] == 0


def test_producers_show_in_flight_sizing_failure_counts_and_error_classes(tmp_path: Path) -> None:
    """The latest in-flight limit and engine idle share, the limit over time, failure counts summed over processes
    (each counts from zero), and each error's failure class; None ("-" on the page) where heartbeats or errors
    predate those fields."""
    from rlbus.cli.ui import _dumps
    from rlbus.cli.ui_views import producers
    from rlbus.schemas.wire import ErrorRaised, ProducerHeartbeat

    run = tmp_path / "run"
    _record(run, Recorder(run, "metadata"), 1)
    beat = lambda t, pid, limit, idle, infra, env, retries: ProducerHeartbeat(  # noqa: E731
        producer_id="p0", pid=pid, version=1, inflight_limit=limit, engine_idle=idle, infra_failures=infra,
        env_failures=env, tool_retries=retries, created_at=100.0 + t)
    # p0's first process predates the fields (an old log's heartbeat); its restart reports them, the limit growing
    # from 1 to 4 and staying there; a third process starts again from a limit of 1 and no failures. p1's
    # heartbeats all predate them.
    _archive(run, "heartbeats", [ProducerHeartbeat(producer_id="p0", pid=11, version=0, created_at=100.0),
                                 beat(2, 12, 1, 0.6, 0, 0, 0), beat(4, 12, 4, 0.3, 1, 0, 2),
                                 beat(6, 12, 4, 0.05, 2, 1, 3), beat(40, 13, 1, 0.0, 0, 0, 0),
                                 beat(42, 13, 1, 0.5, 1, 0, 0),
                                 ProducerHeartbeat(producer_id="p1", pid=21, version=1, inflight=2, created_at=101.0)])
    _archive(run, "errors", [ErrorRaised(role="producer", role_id="p0", error="InfrastructureError",
                                         message="sandbox timed out", failure="infrastructure", created_at=103.0),
                             ErrorRaised(role="producer", role_id="p0", error="ValueError", message="bad answer",
                                         failure="environment", created_at=105.0),
                             ErrorRaised(role="trainer", role_id="trainer-1", error="WeightsDeltaFallback",
                                         message="base missing", created_at=106.0)])
    served = json.loads(_dumps(producers(RunIndex.open(run))))
    got = {p["producer_id"]: p for p in served["producers"]}
    p0, p1 = got["p0"], got["p1"]
    assert (p0["inflight_limit"], p0["engine_idle"]) == (1, 0.5)  # the latest heartbeat's
    # where the limit changed, and the latest heartbeat (the line reaches it)
    assert [(v["t"], v["limit"]) for v in p0["inflight_limits"]] == [(102.0, 1), (104.0, 4), (140.0, 1), (142.0, 1)]
    assert (p0["infra_failures"], p0["env_failures"], p0["tool_retries"]) == (2 + 1, 1, 3)
    assert all(p1[k] is None for k in ("inflight_limit", "engine_idle", "infra_failures", "env_failures",
                                       "tool_retries")) and p1["inflight_limits"] == []
    assert [(e["error"], e["failure"]) for e in served["errors"]] == [
        ("WeightsDeltaFallback", None), ("ValueError", "environment"), ("InfrastructureError", "infrastructure")]


def test_the_overview_marks_guard_actions_rollbacks_and_weight_versions(tmp_path: Path) -> None:
    from rlbus.schemas.wire import GuardAction, WeightsPublished

    run = tmp_path / "run"
    rec = Recorder(run, "metadata")
    for step in (1, 2, 3):
        _record(run, rec, step)
    _archive(run, "guard", [GuardAction(step=2, rules=["mismatch_kl"], actions=["warn", "tighten"], message="kl",
                                        created_at=1.0),
                            GuardAction(step=3, rules=["reward_drop"], actions=["warn", "rollback"], message="drop",
                                        rollback_to=2, created_at=2.0)])
    _archive(run, "weights", [WeightsPublished(version=v, step=s, num_bytes=1, checksum="x", created_at=float(i))
                              for i, (v, s) in enumerate([(1, 1), (2, 2), (3, 3), (2, 3)])])
    (run / "metrics.discarded.jsonl").write_text(json.dumps({"step": 3, "version": 3}) + "\n")
    with (run / "metrics.jsonl").open("a") as f:  # the evaluator's row for version 2
        f.write(json.dumps({"step": 2, "eval/accuracy": 0.75, "eval/num_prompts": 8}) + "\n")
    (run / "checkpoints" / "step_2").mkdir(parents=True)
    got = overview(RunIndex.open(run))
    assert [(g["step"], g["actions"], g["rollback_to"]) for g in got["guard"]] == [
        (2, "warn,tighten", -1), (3, "warn,rollback", 2)]
    assert [w["version"] for w in got["weights"]] == [1, 2, 3, 2]  # the rollback republished version 2
    assert got["discarded"] == [3] and got["checkpoints"] == [2]
    assert got["eval"] == {"step": [2], "accuracy": [0.75]} and got["series"]["step"] == [1, 2, 3]
