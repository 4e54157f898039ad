"""bus/retry.py: which errors are passing, and the retry loop's budget (pure logic; the cluster test is
tests/system/test_nats_cluster.py)."""

from __future__ import annotations

import asyncio

import nats.errors
import nats.js.errors
import pytest

from rlbus.bus.retry import is_transient, retrying
from rlbus.schemas.errors import BusError


@pytest.mark.parametrize("error", [
    nats.errors.TimeoutError(),
    nats.errors.NoRespondersError(),
    nats.js.errors.NoStreamResponseError(),
    nats.js.errors.ServiceUnavailableError(code=503),
    nats.js.errors.APIError(code=500, err_code=10008, description="JetStream system temporarily unavailable"),
    nats.js.errors.APIError(code=500, err_code=10009, description="JetStream cluster can not handle request"),
    nats.js.errors.APIError(code=503, description="no leader"),
    nats.js.errors.ServerError(code=500, description="no err_code given"),
])
def test_election_errors_are_transient(error: Exception) -> None:
    assert is_transient(error)


@pytest.mark.parametrize("error", [
    nats.js.errors.NotFoundError(code=404, err_code=10059, description="stream not found"),
    nats.js.errors.KeyNotFoundError(),
    nats.js.errors.BadRequestError(code=400, err_code=10058, description="stream name already in use"),
    nats.js.errors.APIError(code=400, err_code=10077, description="maximum messages per subject exceeded"),
    nats.errors.MaxPayloadError(),
    # A 500 that names its cause is an answer too (a stream config the server refuses: retrying it cost 30 s).
    nats.js.errors.ServerError(code=500, err_code=10052, description="duplicates window can not be larger then max age"),
    ValueError("a bug"),
])
def test_answers_and_bugs_are_not_transient(error: Exception) -> None:
    assert not is_transient(error)


def test_retrying_outlasts_an_election() -> None:
    failures = [nats.js.errors.NoStreamResponseError(), nats.errors.TimeoutError(),
                nats.js.errors.APIError(code=500, err_code=10008)]
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
