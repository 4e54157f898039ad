"""How long the running event loop went without running a ticker task: what a blocking call on it would show."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator


@contextlib.asynccontextmanager
async def loop_gaps(interval_s: float) -> AsyncIterator[list[float]]:
    """Within the block, a task sleeps `interval_s` again and again; the list gets each wake-up's time since the
    last (filled while the block runs, complete when it ends)."""
    gaps: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(interval_s)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    try:
        yield gaps
    finally:
        done.set()
        await tick
