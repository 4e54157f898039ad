"""Blocking calls off the event loop: synchronous tools, rewards and environment steps run in a bounded pool.

A producer's event loop drives every episode in flight, the bus connection and the weight watch; a synchronous call
made on it (a Gym `step` that sleeps, a `requests.get` in a tool, a reward that shells out) would stall all of them.
`await run_blocking(fn, *args)` runs `fn(*args)` in a worker thread instead, with at most `rollout.blocking_workers`
such calls at once per producer (`configure`; by default one for each episode the producer may hold: a pool smaller
than that made episodes queue for slots while their engine idled, 52 steps/min against 131 on agentic B3 with 16);
a caller can pass its own, tighter limit (a tool's `max_concurrency`: a pool of 4 sandboxes means 4 calls at once).

The threads are daemon threads of their own, not the loop's executor: a call that never returns (a hung
environment) holds its thread forever, and executor threads are joined when the process exits, so one hung game
would keep a stopping producer alive. A caller that stops waiting (its episode timed out, its task was cancelled)
gives its slot back at once; the abandoned thread runs on outside the bound, which is the price of never waiting on
a call that hangs.

    .venv/bin/python -m pytest -q tests/unit/test_blocking.py
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import threading
import weakref
from typing import Any, Callable

#: Blocking calls at once per loop until `configure` says otherwise (a producer: rollout.blocking_slots).
DEFAULT_WORKERS = 16

_workers = DEFAULT_WORKERS
# One semaphore per event loop (tests and the evaluator run loops of their own; a semaphore belongs to one loop).
_slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()


def configure(max_workers: int) -> None:
    """Set how many blocking calls may run at once (each loop's pool is made anew at that size)."""
    global _workers
    if max_workers < 1:
        raise ValueError(f"max_workers: must be >= 1, got {max_workers}")
    _workers = max_workers
    _slots.clear()


def _pool() -> asyncio.Semaphore:
    loop = asyncio.get_running_loop()
    slots = _slots.get(loop)
    if slots is None:
        slots = _slots[loop] = asyncio.Semaphore(_workers)
    return slots


async def run_blocking(fn: Callable[..., Any], *args: Any, limit: asyncio.Semaphore | None = None) -> Any:
    """`fn(*args)` in a daemon thread, once a slot of the pool (and of `limit`, if given) is free."""
    async with contextlib.AsyncExitStack() as slots:
        if limit is not None:
            await slots.enter_async_context(limit)
        await slots.enter_async_context(_pool())
        return await in_daemon_thread(fn, *args)


def is_async(fn: Any) -> bool:
    """Whether calling `fn` returns an awaitable it declares (an async function or an async __call__)."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def in_daemon_thread(fn: Callable[..., Any], *args: Any) -> asyncio.Future:
    """`fn(*args)` in a thread of its own, as a future of this loop (unbounded: `run_blocking` bounds it)."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(error: BaseException | None, result: Any) -> None:
        if not future.done():  # the awaiting coroutine may have been cancelled (the episode timed out)
            future.set_exception(error) if error is not None else future.set_result(result)

    def run() -> None:
        try:
            outcome: tuple[BaseException | None, Any] = (None, fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine, which re-raises it
            outcome = (e, None)
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits for this any more
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=run, name=f"blocking-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return future
