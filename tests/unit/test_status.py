"""`rlbus status`'s per-producer numbers: rate from heartbeats, version lag behind the trainer.

    .venv/bin/python -m pytest -q tests/unit/test_status.py
"""

from __future__ import annotations

import pytest

from rlbus.cli.status import producer_rates, version_lag
from rlbus.schemas.wire import ProducerHeartbeat


def hb(pid_: str, t: float, done: int, *, pid: int = 1, version: int = 0, reported: float = 0.0):
    return ProducerHeartbeat(producer_id=pid_, version=version, pid=pid, groups_done=done, created_at=t,
                             groups_per_min=reported)


def test_rate_is_groups_per_minute_between_first_and_last_heartbeat():
    beats = [hb("p0", 100.0, 4), hb("p1", 100.0, 0), hb("p0", 130.0, 9), hb("p1", 160.0, 3)]
    assert producer_rates(beats) == {"p0": pytest.approx(10.0), "p1": pytest.approx(3.0)}


def test_a_restarted_producer_counts_from_its_new_process():
    beats = [hb("p0", 100.0, 40, pid=1), hb("p0", 110.0, 44, pid=1), hb("p0", 120.0, 0, pid=2), hb("p0", 150.0, 5, pid=2)]
    assert producer_rates(beats) == {"p0": pytest.approx(10.0)}
    # the same pid whose count went down (a counter reset) is a new run too
    assert producer_rates([hb("p0", 0.0, 9), hb("p0", 6.0, 1), hb("p0", 12.0, 2)]) == {"p0": pytest.approx(10.0)}


def test_one_heartbeat_gives_the_rate_the_producer_reported():
    assert producer_rates([hb("p0", 100.0, 4, reported=7.5)]) == {"p0": 7.5}
    assert producer_rates([]) == {}


def test_version_lag_is_trainer_version_minus_the_producers():
    assert version_lag(5, hb("p0", 0.0, 0, version=3)) == 2
    assert version_lag(3, hb("p0", 0.0, 0, version=3)) == 0
    assert version_lag(None, hb("p0", 0.0, 0, version=3)) is None


def test_the_producers_table_shows_in_flight_sizing_and_failure_counts():
    """A heartbeat with the in-flight limit, engine idle share and failure counts shows them; one from before those
    fields existed (their defaults) shows "-" rather than a limit of 0 and no failures."""
    import time

    from rich.console import Console

    from rlbus.cli.status import render, sizing_cells
    from rlbus.schemas.config import ModelConfig, RunConfig

    sized = ProducerHeartbeat(producer_id="p0", version=3, inflight=5, inflight_limit=8, engine_idle=0.125,
                              infra_failures=2, env_failures=1, tool_retries=7, created_at=time.time())
    old = ProducerHeartbeat(producer_id="p1", version=3, inflight=1, created_at=time.time())
    assert sizing_cells(sized) == ("5 / 8", "12%", "2 / 1", "7")
    assert sizing_cells(old) == ("1 / -", "-", "-", "-")
    st = {"step": None, "guard": None, "weights": None, "heartbeats": [sized, old], "prompts_queued": 0,
          "groups_waiting": 0, "groups_held": 0, "rates": {}, "lags": {}}
    console = Console(record=True, width=200)
    for table in render(RunConfig(name="t", model=ModelConfig(path="unused")), st):
        console.print(table)
    text = console.export_text().splitlines()
    cells = lambda ln, bar: [c.strip() for c in ln.split(bar)[1:-1]]  # noqa: E731
    (header,) = [cells(ln, "┃") for ln in text if ln.count("┃") > 2]
    rows = {r[0]: dict(zip(header, r)) for r in (cells(ln, "│") for ln in text if ln.count("│") > 2)}
    row = rows.__getitem__
    assert {k: row("p0")[k] for k in ("in flight / limit", "engine idle", "failures infra / env", "tool retries")} == {
        "in flight / limit": "5 / 8", "engine idle": "12%", "failures infra / env": "2 / 1", "tool retries": "7"}
    assert [row("p1")[k] for k in ("in flight / limit", "engine idle", "failures infra / env", "tool retries")] == [
        "1 / -", "-", "-", "-"]
