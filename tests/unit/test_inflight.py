"""How many tasks a producer holds: grown while its engine idles with tasks to be had, never past the cap.

A fake clock drives the sizer (pure logic); the meter is the real one.

    .venv/bin/python -m pytest -q tests/unit/test_inflight.py
"""

from __future__ import annotations

from rlbus.producers.inflight import WINDOW_S, EngineMeter, InflightSizer


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _window(clock: Clock, meter: EngineMeter, sizer: InflightSizer, *, busy: float, held: int) -> int:
    """One sizing window in which the producer holds `held` tasks and the engine works `busy` of the time."""
    sizer.held(held)
    meter.begin()
    clock.now += WINDOW_S * busy
    meter.end()
    clock.now += WINDOW_S * (1 - busy)
    return sizer.update()


def test_the_meter_counts_time_with_any_call_outstanding_once():
    clock = Clock()
    meter = EngineMeter(clock)
    meter.begin()
    clock.now = 1.0
    meter.begin()  # a second call while the first runs: the same busy second
    clock.now = 2.0
    meter.end()
    clock.now = 3.0
    assert meter.busy_s == 3.0  # in progress counts
    meter.end()
    clock.now = 10.0
    assert meter.busy_s == 3.0


def test_an_idle_engine_at_the_limit_takes_more_tasks_up_to_the_cap():
    clock = Clock()
    meter = EngineMeter(clock)
    sizer = InflightSizer(0, 12, meter, clock)
    limits = []
    for _ in range(8):  # episodes wait on a slow tool: the engine works a fifth of the time
        limits.append(_window(clock, meter, sizer, busy=0.2, held=sizer.limit))
    assert limits[:3] == [4, 12, 12]  # a fifth busy: about five times the tasks, at most four times a window


def test_a_producer_held_back_by_admission_does_not_grow():
    clock = Clock()
    meter = EngineMeter(clock)
    sizer = InflightSizer(0, 12, meter, clock)
    _window(clock, meter, sizer, busy=0.5, held=sizer.limit)  # grow to a few
    grown = sizer.limit
    assert grown == 2
    for _ in range(5):  # idle, but the feeder releases nothing more: below its limit the whole time
        assert _window(clock, meter, sizer, busy=0.1, held=1) == grown


def test_a_saturated_engine_sheds_a_limit_it_does_not_use():
    clock = Clock()
    meter = EngineMeter(clock)
    sizer = InflightSizer(0, 12, meter, clock)
    for _ in range(4):
        _window(clock, meter, sizer, busy=0.3, held=sizer.limit)
    high = sizer.limit
    assert _window(clock, meter, sizer, busy=1.0, held=1) == high - 1


def test_a_configured_number_is_kept():
    clock = Clock()
    meter = EngineMeter(clock)
    sizer = InflightSizer(3, 64, meter, clock)
    for _ in range(4):
        assert _window(clock, meter, sizer, busy=0.0, held=3) == 3
