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
