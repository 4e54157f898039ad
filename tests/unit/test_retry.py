"""bus/retry.py: which errors are passing, and the retry loop's budget (pure logic; the cluster test is
tests/system/test_nats_cluster.py)."""

from __future__ import annotations

import asyncio

import nats.errors
import nats.js.errors
import pytest
from nats.aio.msg import Msg
from nats.js.client import JetStreamContext
from nats.js.manager import JetStreamManager

from rlbus.bus.retry import describe_error, is_transient, retrying
from rlbus.schemas.errors import BusError


def _raised(call) -> Exception:  # type: ignore[no-untyped-def]
    """The exception `call()` raises (through nats-py's own code path)."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 (whatever nats-py raises is the point)
        return e
    raise AssertionError("nothing raised")


def _status(code: str, description: str = "") -> Msg:
    headers = {"Status": code}
    if description:
        headers["Description"] = description
    return Msg(_client=None, subject="_INBOX.x", data=b"", headers=headers)  # type: ignore[arg-type]


class _SilentNats:
    """Just enough of a client for nats-py's JetStream code to send one request into an outage."""

    def __init__(self, error: Exception):
        self.error = error

    async def request(self, *args: object, **kwargs: object) -> Msg:
        raise self.error

    def _jsm(self) -> None: ...


def _reply(code: int, err_code: int | None, description: str) -> Exception:
    """What nats-py raises for a JetStream API error reply (`APIError.from_error`)."""
    err = {"code": code, "description": description}
    if err_code is not None:
        err["err_code"] = err_code
    return _raised(lambda: nats.js.errors.APIError.from_error(err))


def _via_api_request(error: Exception) -> Exception:
    jsm = JetStreamManager(_SilentNats(error))  # type: ignore[arg-type]
    return _raised(lambda: asyncio.run(jsm.stream_info("PROMPTS")))


def _via_publish(error: Exception) -> Exception:
    js = JetStreamContext(_SilentNats(error))  # type: ignore[arg-type]
    return _raised(lambda: asyncio.run(js.publish("rlbus.r.traj", b"x")))


# What an outage produces, made the way nats-py makes it (docs/reliability.md, "Which errors are passing").
OUTAGE = {
    # A JetStream API request (stream / consumer info, add_consumer, get_msg, KV get) nobody answered: nats-py
    # turns NoRespondersError into a ServiceUnavailableError with no code at all (js/manager.py _api_request).
    "api request, no responders": _via_api_request(nats.errors.NoRespondersError()),
    "api request, reply lost": _via_api_request(nats.errors.TimeoutError()),
    "publish, no stream leader": _via_publish(nats.errors.NoRespondersError()),
    "publish, ack lost": _via_publish(nats.errors.TimeoutError()),
    # A status-only reply in a fetch or a direct get: "503" becomes a bare ServiceUnavailableError.
    "fetch, bare 503 status": _raised(lambda: nats.js.errors.APIError.from_msg(_status("503"))),
    "fetch, 408 status": _raised(lambda: nats.js.errors.APIError.from_msg(_status("408", "Request Timeout"))),
    "api reply 503 10008": _reply(503, 10008, "JetStream system temporarily unavailable"),
    "api reply 500 10009": _reply(500, 10009, "JetStream cluster can not handle request"),
    "api reply 503 10004": _reply(503, 10004, "incomplete results"),
    "api reply 400 10005": _reply(400, 10005, "no suitable peers for placement"),
    "api reply 500 10118": _reply(500, 10118, "stream is offline"),
    "api reply 500 10119": _reply(500, 10119, "consumer is offline"),
    "api reply 500, no err_code": _reply(500, None, "server error"),
    "request, no responders": nats.errors.NoRespondersError(),
    "request, reply lost": nats.errors.TimeoutError(),
    "fetch timeout after heartbeats": nats.js.errors.FetchTimeoutError(),
    "flush timeout": nats.errors.FlushTimeoutError(),
    "drain while reconnecting": nats.errors.ConnectionReconnectingError(),
    "stale connection": nats.errors.StaleConnectionError(),
    "connection hung up": nats.errors.UnexpectedEOF(),
    "reconnect buffer full": nats.errors.OutboundBufferLimitError(),
    "batched fetch, first probe late": TimeoutError(),
}

# Answers and wrong calls: raised at once, and their text names what is wrong.
ANSWERS = {
    "stream not found": _reply(404, 10059, "stream not found"),
    "key not found": nats.js.errors.KeyNotFoundError(),
    "stream name in use": _reply(400, 10058, "stream name already in use"),
    "fetch, 400 status": _raised(lambda: nats.js.errors.APIError.from_msg(_status("400", "Bad Request"))),
    "invalid stream config (500 10052)": _reply(500, 10052, "duplicates window can not be larger then max age"),
    "JetStream not enabled for account (503 10039)": _reply(503, 10039, "JetStream not enabled for account"),
    "insufficient resources (503 10023)": _reply(503, 10023, "insufficient resources"),
    "message too large": nats.errors.MaxPayloadError(),
    "connection closed": nats.errors.ConnectionClosedError(),
    "connection draining": nats.errors.ConnectionDrainingError(),
    "authorization": nats.errors.AuthorizationError(),
    "bad subject": nats.errors.BadSubjectError(),
    "a bug": ValueError("a bug"),
}


@pytest.mark.parametrize("case", sorted(OUTAGE))
def test_what_an_outage_produces_is_transient(case: str) -> None:
    assert is_transient(OUTAGE[case]), describe_error(OUTAGE[case])


@pytest.mark.parametrize("case", sorted(ANSWERS))
def test_answers_and_wrong_calls_are_permanent(case: str) -> None:
    assert not is_transient(ANSWERS[case])


def test_a_bare_503_is_described_by_what_it_means() -> None:
    e = OUTAGE["api request, no responders"]
    assert type(e) is nats.js.errors.ServiceUnavailableError and e.code is None and e.err_code is None
    assert "no detail" in describe_error(e) and "leader" in describe_error(e)


def test_a_permanent_error_keeps_its_type_and_is_noted_with_the_call() -> None:
    async def call() -> None:
        raise nats.js.errors.APIError.from_error({"code": 500, "err_code": 10052, "description": "bad config"})

    with pytest.raises(nats.js.errors.ServerError) as info:
        asyncio.run(retrying("bus t: create stream X", call, budget_s=10))
    assert any("create stream X" in n and "bad config" in n for n in info.value.__notes__)


def test_retrying_gives_up_on_a_bare_503_naming_it() -> None:
    async def call() -> None:
        raise nats.js.errors.ServiceUnavailableError()

    with pytest.raises(BusError, match=r"stream info failed for 0s .*503 with no detail"):
        asyncio.run(retrying("stream info", call, budget_s=0.3))


@pytest.mark.parametrize(
    "error",
    [
        nats.errors.TimeoutError(),
        nats.errors.NoRespondersError(),
        nats.js.errors.NoStreamResponseError(),
        nats.js.errors.ServiceUnavailableError(code=503),
        nats.js.errors.APIError(code=500, err_code=10008, description="JetStream system temporarily unavailable"),
        nats.js.errors.APIError(code=500, err_code=10009, description="JetStream cluster can not handle request"),
        nats.js.errors.APIError(code=503, description="no leader"),
        nats.js.errors.ServerError(code=500, description="no err_code given"),
    ],
)
def test_election_errors_are_transient(error: Exception) -> None:
    assert is_transient(error)


@pytest.mark.parametrize(
    "error",
    [
        nats.js.errors.NotFoundError(code=404, err_code=10059, description="stream not found"),
        nats.js.errors.KeyNotFoundError(),
        nats.js.errors.BadRequestError(code=400, err_code=10058, description="stream name already in use"),
        nats.js.errors.APIError(code=400, err_code=10077, description="maximum messages per subject exceeded"),
        nats.errors.MaxPayloadError(),
        # A 500 that names its cause is an answer too (a stream config the server refuses: retrying it cost 30 s).
        nats.js.errors.ServerError(
            code=500, err_code=10052, description="duplicates window can not be larger then max age"
        ),
        ValueError("a bug"),
    ],
)
def test_answers_and_bugs_are_not_transient(error: Exception) -> None:
    assert not is_transient(error)


def test_retrying_outlasts_an_election() -> None:
    failures = [
        nats.js.errors.NoStreamResponseError(),
        nats.errors.TimeoutError(),
        nats.js.errors.APIError(code=500, err_code=10008),
    ]
    calls = 0

    async def call() -> str:
        nonlocal calls
        calls += 1
        if failures:
            raise failures.pop(0)
        return "stored"

    assert asyncio.run(retrying("publish", call, budget_s=10)) == "stored"
    assert calls == 4


def test_retrying_gives_up_after_its_budget_with_the_call_named() -> None:
    async def call() -> None:
        raise nats.js.errors.NoStreamResponseError()

    async def timed() -> float:
        loop = asyncio.get_running_loop()
        t = loop.time()
        with pytest.raises(BusError, match=r"publish on 'x' failed for 1s .*no stream stores x"):
            await retrying("publish on 'x'", call, budget_s=1.0, describe=lambda e: "no stream stores x")
        return loop.time() - t

    assert 0.9 <= asyncio.run(timed()) < 3.0


def test_retrying_raises_a_wrong_call_at_once() -> None:
    calls = 0

    async def call() -> None:
        nonlocal calls
        calls += 1
        raise nats.js.errors.NotFoundError(code=404, err_code=10059)

    with pytest.raises(nats.js.errors.NotFoundError):
        asyncio.run(retrying("stream info", call, budget_s=10))
    assert calls == 1
