"""The producer's pool for blocking calls: synchronous work leaves the event loop, bounded in number.

    .venv/bin/python -m pytest -q tests/unit/test_blocking.py
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from rlbus.producers import blocking


@pytest.fixture
def pool_of_two():
    blocking.configure(2)
    yield
    blocking.configure(blocking.DEFAULT_WORKERS)


async def test_blocking_calls_run_off_the_loop_at_most_the_pool_size_at_once(pool_of_two):
    running, most = 0, 0
    lock = threading.Lock()

    def work(seconds: float) -> str:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(seconds)  # a blocking call: the loop must stay free meanwhile
        with lock:
            running -= 1
        return threading.current_thread().name

    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.01)
            ticks += 1

    beat = asyncio.create_task(ticker())
    t0 = time.perf_counter()
    names = await asyncio.gather(*(blocking.run_blocking(work, 0.2) for _ in range(6)))
    elapsed = time.perf_counter() - t0
    beat.cancel()
    assert most == 2  # six calls, two at a time
    assert 0.55 < elapsed < 2.0  # three rounds of 0.2 s
    assert ticks >= 30  # the event loop kept ticking every 10 ms throughout
    assert all(n.startswith("blocking-work") for n in names)


async def test_a_callers_own_limit_is_tighter_than_the_pool(pool_of_two):
    limit = asyncio.Semaphore(1)
    spans: list[tuple[float, float]] = []

    def work() -> None:
        start = time.perf_counter()
        time.sleep(0.05)
        spans.append((start, time.perf_counter()))

    await asyncio.gather(*(blocking.run_blocking(work, limit=limit) for _ in range(3)))
    spans.sort()
    assert all(b[0] >= a[1] for a, b in zip(spans, spans[1:]))  # one at a time


async def test_a_call_that_hangs_gives_its_slot_back_when_its_caller_stops_waiting(pool_of_two):
    release = threading.Event()
    hung = [asyncio.ensure_future(blocking.run_blocking(release.wait)) for _ in range(2)]
    await asyncio.sleep(0.05)
    for h in hung:  # the callers time out (an episode timeout, say)
        h.cancel()
    await asyncio.gather(*hung, return_exceptions=True)
    assert await asyncio.wait_for(blocking.run_blocking(lambda: 7), 2.0) == 7  # the pool is free again
    release.set()


async def test_errors_reach_the_caller():
    def broken() -> None:
        raise ValueError("bad input")

    with pytest.raises(ValueError, match="bad input"):
        await blocking.run_blocking(broken)


def test_the_pool_holds_one_slot_for_each_episode_a_producer_may_hold_unless_set() -> None:
    from rlbus.schemas.config import RolloutConfig

    assert RolloutConfig(n=4).blocking_slots == 64 * 4  # max_inflight_cap tasks of n episodes
    assert RolloutConfig(n=8, redundant_samples=2, max_inflight_tasks=3).blocking_slots == 3 * 10
    assert RolloutConfig(blocking_workers=5).blocking_slots == 5
    with pytest.raises(ValueError, match="blocking_workers"):
        RolloutConfig(blocking_workers=-1)
