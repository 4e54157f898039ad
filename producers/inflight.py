"""How many prompt tasks a producer holds at once: enough to keep its engine busy while episodes wait.

An episode that waits on a tool, an environment step or a judge generates nothing meanwhile; a producer holding one
task then leaves its engine idle for most of the wait. `rollout.max_inflight_tasks: 0` (the default) sizes the
number from what the producer measures instead of asking the user to tune it:

- `EngineMeter` records how much of the wall clock the engine had at least one generate call to work on (queued or
  running): its busy share. Idle time is time the engine could have spent on another task's turns.
- `InflightSizer` looks at each window of WINDOW_S seconds. If the engine was idle more than IDLE_TARGET of it while
  the producer held as many tasks as it may (so more tasks were to be had: a producer the feeder's admission holds
  back never sits at its limit), the limit grows to what would have kept the engine busy (Little's law: `limit /
  busy share`, at most MAX_GROWTH times a window), up to `rollout.max_inflight_cap`.
  If the engine was busy throughout (more tasks would only queue behind each other and age their tokens) and the
  producer held fewer tasks than its limit for the whole window, the limit comes back down by one.

The feeder's admission bounds the tasks in flight over all producers whatever each one allows (schemas/staleness.py),
and the cap bounds what one producer holds in memory. `rollout.max_inflight_tasks: N > 0` fixes the number at N.

    .venv/bin/python -m pytest -q tests/unit/test_inflight.py
"""

from __future__ import annotations

import math
import time
from typing import Callable

#: Seconds per sizing window.
WINDOW_S = 1.0
#: Most the limit is multiplied by in one window.
MAX_GROWTH = 4.0
#: Engine idle share above which a producer at its limit takes more tasks.
IDLE_TARGET = 0.1


class EngineMeter:
    """The engine's busy time: wall-clock seconds during which at least one generate call was outstanding."""

    outstanding: int  # generate calls not yet returned
    _busy_s: float
    _since: float  # when `outstanding` last went from 0 to 1
    _clock: Callable[[], float]

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.outstanding = 0
        self._busy_s = 0.0
        self._since = 0.0
        self._clock = clock

    def begin(self) -> None:
        if self.outstanding == 0:
            self._since = self._clock()
        self.outstanding += 1

    def end(self) -> None:
        self.outstanding -= 1
        if self.outstanding == 0:
            self._busy_s += self._clock() - self._since

    @property
    def busy_s(self) -> float:
        """Busy seconds so far, the call in progress included."""
        return self._busy_s + (self._clock() - self._since if self.outstanding else 0.0)


class InflightSizer:
    """The limit on tasks in flight: fixed, or grown and shrunk from the engine's idle share (module docstring)."""

    limit: int
    cap: int
    fixed: bool
    _meter: EngineMeter
    _clock: Callable[[], float]
    _window_start: float
    _busy_at_start: float
    _at_limit_s: float  # seconds of this window the producer held `limit` tasks (or more)
    _below_s: float  # seconds of this window it held fewer
    _last: float  # when `held` was last reported
    _held: int

    def __init__(self, configured: int, cap: int, meter: EngineMeter, clock: Callable[[], float] = time.monotonic):
        self.fixed = configured > 0
        self.cap = max(cap, 1)
        self.limit = configured if self.fixed else 1
        self._meter, self._clock = meter, clock
        now = clock()
        self._window_start = self._last = now
        self._busy_at_start = meter.busy_s
        self._at_limit_s = self._below_s = 0.0
        self._held = 0

    def held(self, count: int) -> None:
        """The producer now holds `count` tasks (called on every change)."""
        now = self._clock()
        if self._held >= self.limit:
            self._at_limit_s += now - self._last
        else:
            self._below_s += now - self._last
        self._held, self._last = count, now

    def idle_share(self) -> float:
        span = self._clock() - self._window_start
        if span <= 0:
            return 0.0
        return max(0.0, 1.0 - (self._meter.busy_s - self._busy_at_start) / span)

    def update(self) -> int:
        """Re-judge the limit once a window has passed; returns it."""
        now = self._clock()
        if self.fixed or now - self._window_start < WINDOW_S:
            return self.limit
        self.held(self._held)  # close the window's accounting
        span = now - self._window_start
        idle = self.idle_share()
        at_limit = self._at_limit_s / span
        if idle > IDLE_TARGET and at_limit > 0.5:
            # Little's law: the engine worked `busy` of the time with `limit` tasks; about limit / busy keep it busy.
            factor = min(MAX_GROWTH, 1.0 / max(1.0 - idle, 1.0 / MAX_GROWTH))
            self.limit = min(self.cap, max(self.limit + 1, math.ceil(self.limit * factor)))
        elif idle < 0.01 and self._below_s >= span * 0.99 and self.limit > 1:
            self.limit -= 1
        self._window_start = now
        self._busy_at_start = self._meter.busy_s
        self._at_limit_s = self._below_s = 0.0
        return self.limit
