"""The nemesis's schedule (bench/nemesis.py `schedule`): pure logic, no bus or Ray. One seed replays one schedule;
kinds are drawn as configured, every kind once per round; faults fall inside the run, past ack_wait where they must.

    .venv/bin/python -m pytest -q tests/unit/test_nemesis_schedule.py
"""

from __future__ import annotations

from collections import Counter

import pytest

from bench.nemesis import FAULT_KINDS, schedule


def test_the_same_seed_replays_the_same_schedule_and_another_seed_does_not():
    a = schedule(7, steps=600, num_faults=14)
    assert a == schedule(7, steps=600, num_faults=14)
    assert a != schedule(8, steps=600, num_faults=14)


def test_every_kind_comes_once_per_round_and_only_the_kinds_asked_for():
    faults = schedule(3, steps=600, num_faults=16)
    counts = Counter(f.kind for f in faults)
    assert set(counts) == set(FAULT_KINDS)  # 16 faults over 7 kinds: two whole rounds and two more
    assert sorted(counts.values()) == [2] * 5 + [3] * 2
    for r in range(2):  # each round of 7 consecutive faults has every kind
        assert {f.kind for f in faults[7 * r:7 * (r + 1)]} == set(FAULT_KINDS)
    only = schedule(3, steps=200, num_faults=6, kinds=["trainer-kill", "nats-kill"])
    assert Counter(f.kind for f in only) == {"trainer-kill": 3, "nats-kill": 3}


def test_faults_fall_at_distinct_steps_inside_the_run_in_step_order_with_holds_where_they_matter():
    faults = schedule(11, steps=300, num_faults=20, warmup_steps=10, tail_steps=40, ack_wait_s=10.0)
    steps = [f.at_step for f in faults]
    assert steps == sorted(steps) and len(set(steps)) == 20 and 10 <= steps[0] and steps[-1] < 260
    assert [f.index for f in faults] == list(range(20))
    for f in faults:
        if f.kind == "producer-stop":
            assert f.hold_s > 10.0  # past ack_wait: the stopped producer's task must go to another
        elif f.kind in ("nats-kill", "node-loss"):
            assert f.hold_s > 0
        else:
            assert f.hold_s == 0


def test_a_schedule_that_cannot_be_drawn_is_refused():
    with pytest.raises(ValueError, match="num_faults"):
        schedule(0, steps=60, num_faults=20)
    with pytest.raises(ValueError, match="kinds"):
        schedule(0, steps=600, num_faults=3, kinds=["ray-head-kill"])
