"""The event loop of long-running services: uvloop where installed, asyncio otherwise.

    from rlbus.bus.loop import run
    sys.exit(run(run_role(cfg)))

uvloop roughly halves the per-message cost of the NATS client (socket reads, callbacks, timers), which is most of a
producer's or trainer's bus overhead; it is a pyproject dependency on every platform but Windows.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Any, Coroutine, Protocol, TypeVar

T = TypeVar("T")


def uvloop_available() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run a service's main coroutine to completion on uvloop (asyncio's default loop where uvloop is missing)."""
    try:
        import uvloop
    except ImportError:
        # Only where uvloop is not installed (Windows, or a minimal install): behaviour is the same, just slower.
        return asyncio.run(coro)
    return uvloop.run(coro)


def raise_if_failed(*tasks: "asyncio.Task | None") -> None:
    """Re-raise the exception of a finished background task, so that its failure stops the service that owns it
    instead of vanishing with the task."""
    for t in tasks:
        if t is not None and t.done() and not t.cancelled() and t.exception() is not None:
            raise t.exception()


class Role(Protocol):
    async def start(self) -> None: ...
    async def run(self) -> None: ...
    def stop(self) -> None: ...
    async def close(self, reason: str = "", clean: bool = True) -> None: ...


async def serve(role: Role) -> None:
    """start(), then run() until it returns (stop() on SIGTERM / SIGINT asks it to); close() on every exit path,
    saying whether it was clean."""
    loop = asyncio.get_running_loop()
    try:
        await role.start()
        # After start(): ray.init installs its own SIGTERM handler, which would exit without draining.
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, role.stop)
        await role.run()
    except BaseException as e:
        await role.close(reason=f"{type(e).__name__}: {e}", clean=False)
        raise
    await role.close(reason="stopped", clean=True)
