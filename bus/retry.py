"""Which NATS / JetStream errors are passing, and one retry loop for them.

On a NATS cluster, a server that dies takes the leaders of the streams and consumers it led with it; for the few
seconds an election takes, every JetStream call on those assets fails: a publish finds no responders, an API
request answers 503 or "JetStream system temporarily unavailable", a request's reply never comes. A reconnect to
another server looks the same from the client. None of it means the call is wrong, so every JetStream call of
`Bus` goes through `retrying`: transient errors are retried with doubling backoff for up to `bus.retry_s` seconds
(longer than an election), anything else is raised at once, and a call still failing at the end raises `BusError`
naming the call and the last error.

Every call retried is idempotent or made so: publishes carry a Nats-Msg-Id where a copy would matter (the server
drops a duplicate), acks / naks / terms of one delivery apply once, KV puts of the same value are harmless.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, TypeVar

import nats.errors
import nats.js.errors

from rlbus.schemas.errors import BusError

log = logging.getLogger(__name__)

T = TypeVar("T")

#: nats-server error codes that mean "not now" rather than "not so": JetStream system temporarily unavailable (no
#: meta leader), cluster can not handle the request (not the leader), stream offline, consumer offline.
_TRANSIENT_ERR_CODES = frozenset({10008, 10009, 10118, 10119})
_TRANSIENT_STATUS = frozenset({408, 500, 503})

_TRANSIENT_TYPES: tuple[type[BaseException], ...] = (
    nats.errors.TimeoutError,  # a request's reply lost in a failover (also asyncio.TimeoutError's nats subclass)
    nats.errors.NoRespondersError,  # nobody serves that API subject right now
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    nats.js.errors.NoStreamResponseError,  # a publish no stream leader answered
    nats.js.errors.ServiceUnavailableError,
    nats.js.errors.ServerError,
    asyncio.TimeoutError,
)

FIRST_WAIT_S = 0.1
MAX_WAIT_S = 2.0


def is_transient(e: BaseException) -> bool:
    """True for errors a leader election, a reconnect or a lost reply produce; False for a wrong call."""
    if isinstance(e, (nats.js.errors.NotFoundError, nats.js.errors.BadRequestError)):
        return False  # not found / bad request are answers, not outages
    if isinstance(e, nats.js.errors.APIError):
        if e.err_code is not None and e.err_code not in _TRANSIENT_ERR_CODES:
            return False  # the server named what is wrong (e.g. 10052: an invalid stream config); asking again won't fix it
        return e.err_code in _TRANSIENT_ERR_CODES or (e.code or 0) in _TRANSIENT_STATUS
    return isinstance(e, _TRANSIENT_TYPES)


async def retrying(what: str, call: Callable[[], Awaitable[T]], *, budget_s: float,
                   describe: Callable[[BaseException], str] | None = None,
                   on_transient: Callable[[], None] | None = None) -> T:
    """`await call()`, again after each transient error, for at most `budget_s` seconds in all.

    `what` names the call in logs and in the final BusError; `describe(last_error)` may give that error a better
    message (e.g. "no stream stores ..."); `on_transient()` is called on each transient error.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + budget_s
    wait, attempts = FIRST_WAIT_S, 0
    while True:
        attempts += 1
        try:
            return await call()
        except Exception as e:
            if not is_transient(e):
                raise
            if on_transient is not None:
                on_transient()
            left = deadline - loop.time()
            if left <= 0:
                detail = describe(e) if describe else f"{type(e).__name__}: {e}"
                raise BusError(f"{what} failed for {budget_s:.0f}s ({attempts} attempts): {detail}") from e
            if attempts == 1 or attempts % 10 == 0:
                log.warning("%s: %s: %s; retrying for up to %.0fs more", what, type(e).__name__, e or "(no detail)",
                            left)
            await asyncio.sleep(min(wait, left))
            wait = min(wait * 2, MAX_WAIT_S)
