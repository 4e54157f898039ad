"""Which NATS / JetStream errors are passing, and one retry loop for them.

On a NATS cluster, a server that dies takes the leaders of the streams and consumers it led with it; for the few
seconds an election takes, every JetStream call on those assets fails: a publish finds no responders, an API
request answers 503 or "JetStream system temporarily unavailable", a request's reply never comes. A reconnect to
another server looks the same from the client. None of it means the call is wrong, so every JetStream call of
`Bus` goes through `retrying`: transient errors are retried with doubling backoff (0.1 s up to 0.5 s) for up to
`bus.retry_s` seconds (longer than an election), anything else is raised at once, and a call still failing at the end
raises `BusError` naming the call and the last error.

Every call retried is idempotent or made so: publishes carry a Nats-Msg-Id where a copy would matter (the server
drops a duplicate), acks / naks / terms of one delivery apply once, KV puts of the same value are harmless.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats.errors
import nats.js.errors

from rlbus.schemas.errors import BusError

log = logging.getLogger(__name__)

T = TypeVar("T")

#: nats-server error codes that mean "not now" rather than "not so" (server/errors.json): incomplete results (a peer
#: did not answer in time), no suitable peers for placement (a replica's server is down), JetStream system
#: temporarily unavailable (no meta leader), cluster can not handle the request (not the leader), peer not a member
#: (yet), stream offline, consumer offline.
TRANSIENT_ERR_CODES = frozenset({10004, 10005, 10008, 10009, 10040, 10118, 10119})
#: Status-only replies (no err_code) that an outage produces: request timeout, server error, service unavailable.
TRANSIENT_STATUS = frozenset({408, 500, 503})

_TRANSIENT_TYPES: tuple[type[BaseException], ...] = (
    nats.errors.TimeoutError,  # a reply lost to a reconnect or an election (FlushTimeoutError, FetchTimeoutError too)
    nats.errors.NoRespondersError,  # nobody serves that subject right now (a stream or consumer has no leader)
    nats.errors.ConnectionReconnectingError,  # drain / flush while the client is between two servers
    nats.errors.StaleConnectionError,  # (and UnexpectedEOF) a server that stopped answering pings or hung up
    nats.errors.OutboundBufferLimitError,  # a publish while reconnecting, once the reconnect buffer is full
    nats.js.errors.NoStreamResponseError,  # a JetStream publish no stream leader answered (no responders)
    asyncio.TimeoutError,  # a fetch whose first probe outlasts its timeout (nats-py raises asyncio's own there)
)

class ConnectionLost(nats.errors.TimeoutError):
    """A request's connection dropped before its reply came: the request or its reply may have died with it."""

    def __str__(self) -> str:
        return "nats: the connection dropped while the request awaited its reply"


def abandon_requests(nc: Any) -> int:
    """Fail, with ConnectionLost, every request of `nc` still awaiting its reply; call it when the connection drops.

    A request written to a connection that then dies is never answered, and nats-py would wait out its whole
    timeout (5 s for a publish's ack or an ack's confirmation) before the retry loop asks again; failed now, it is
    asked again as soon as the client has reconnected. Every call `Bus` retries is idempotent, so a request that did
    reach the server before the drop is harmless to repeat. nats-py keeps the pending replies' futures in
    `Client._resp_map` (nats-py 2.16, `_request_new_style`); tests/integration/test_bus_outage.py pins this.
    """
    lost = 0
    for future in list(getattr(nc, "_resp_map", {}).values()):
        if not future.done():
            future.set_exception(ConnectionLost())
            lost += 1
    return lost


FIRST_WAIT_S = 0.1
#: The longest pause between two attempts. Short: a call waits out an election (seconds, nats-server's Raft timeouts)
#: and then at most this long, and asking twice a second for up to bus.retry_s is no load for a server.
MAX_WAIT_S = 0.5


def is_transient(e: BaseException) -> bool:
    """True for errors a leader election, a reconnect, a server restart or a lost reply produce; False for a wrong
    call. docs/reliability.md ("Which errors are passing") lists each case and where nats-py raises it."""
    if isinstance(e, nats.js.errors.APIError):
        err_code = getattr(e, "err_code", None)  # KeyNotFoundError and its kin set none at all
        if err_code is not None:
            # The server named the cause; only the ones that mean "no leader / no peer right now" pass (10005 and
            # 10040 come as 400s). The rest (e.g. 10052: an invalid stream config, 10039: JetStream not enabled)
            # will not get better by asking again.
            return err_code in TRANSIENT_ERR_CODES
        if isinstance(e, (nats.js.errors.NotFoundError, nats.js.errors.BadRequestError)):
            return False  # not found / bad request are answers, not outages
        if isinstance(e, nats.js.errors.ServiceUnavailableError):
            # A 503 with nothing else: nats-py makes it from a JetStream API request nobody answered (no responders,
            # js/manager.py `_api_request`) and from a bare "503" status in a fetch (APIError.from_msg): no leader.
            return True
        return (getattr(e, "code", None) or 0) in TRANSIENT_STATUS
    return isinstance(e, _TRANSIENT_TYPES)


def describe_error(e: BaseException) -> str:
    """`e` in words that say what is wrong: nats-py prints a bare 503 as "code=None err_code=None
    description='None'", and a few of its errors print nothing."""
    name = type(e).__name__
    if isinstance(e, nats.js.errors.ServiceUnavailableError) and getattr(e, "err_code", None) is None:
        return (f"{name}: JetStream answered 503 with no detail (no server answered the request: no stream or "
                "consumer leader, or no JetStream server reachable)")
    if isinstance(e, nats.js.errors.APIError) and not getattr(e, "description", None):
        return f"{name}: JetStream answered status {getattr(e, 'code', None)} with no description"
    text = str(e)
    return f"{name}: {text}" if text else name


def permanent(e: BaseException, what: str) -> BaseException:
    """`e`, noted with the call it failed and why it was not retried (the type stays, for callers that catch it)."""
    if isinstance(e, Exception):
        e.add_note(f"rlbus: {what}: {describe_error(e)}; not retried (not an outage: see docs/reliability.md)")
    return e


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
                permanent(e, what)
                raise
            if on_transient is not None:
                on_transient()
            left = deadline - loop.time()
            if left <= 0:
                detail = describe(e) if describe else describe_error(e)
                raise BusError(f"{what} failed for {budget_s:.0f}s ({attempts} attempts): {detail}") from e
            if attempts == 1 or attempts % 10 == 0:
                log.warning("%s: %s; retrying for up to %.0fs more", what, describe_error(e), left)
            await asyncio.sleep(min(wait, left))
            wait = min(wait * 2, MAX_WAIT_S)
