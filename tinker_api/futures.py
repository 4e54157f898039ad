"""Futures: what the Tinker SDK's requests return at once, and what `retrieve_future` answers by long-poll.

Every request that does work (create_model, forward_backward, optim_step, save_*, load_weights, asample) is answered
at once with a request id; its work runs later, and its result (or failure) is kept under that id, for its key
alone, for `tinker.future_ttl_s` after it finished. A `retrieve_future` waits up to `tinker.poll_s` for the result;
past that it answers `try_again` and the SDK asks again.

The requests of one training model run in `seq_id` order (`Ordered`): the SDK numbers them 1, 2, 3, ... per model
(a model made by loading a checkpoint starts with the load, number 0) and sends them as they come, concurrently,
so that a forward_backward, the optim_step after it and the next forward_backward are all in flight while the
first runs; each waits here for its predecessors. The same seq_id sent again (the SDK retries a request whose answer
was lost) gets the request id of the first.
"""

from __future__ import annotations

import asyncio
import logging
import traceback
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from rlbus.tinker_api.wire import BadRequest, RequestFailed, TryAgain, encode

log = logging.getLogger("rlbus.tinker")

#: A finished request's answer: (content type, body).
Result = tuple[str, bytes]
Work = Callable[[], Awaitable[Result]]
JSON = "application/json"
RETRY_WINDOW = 1024  # seq_ids remembered per model behind the one running, to answer a resent request


class UserError(BadRequest):
    """A request that ran and failed for a reason its client can fix: its future fails with category "user"."""


def json_result(value: object) -> Result:
    return JSON, encode(value)


@dataclass
class _Entry:
    owner: str
    future: asyncio.Future[Result]
    kind: str  # what the request was (for logs)


class Futures:
    """Results by request id, each visible to the key (owner) that made the request."""

    ttl_s: float
    _entries: dict[str, _Entry]
    _tasks: set[asyncio.Task]  # work started by `run` (held: the loop keeps only weak references)

    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self._entries = {}
        self._tasks = set()

    def new(self, owner: str, kind: str) -> tuple[str, asyncio.Future[Result]]:
        """A fresh request id and the future its work will settle."""
        request_id = f"req-{uuid.uuid4().hex}"
        fut: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self._entries[request_id] = _Entry(owner, fut, kind)
        fut.add_done_callback(lambda _: asyncio.get_running_loop().call_later(self.ttl_s, self._forget, request_id))
        return request_id, fut

    def _forget(self, request_id: str) -> None:
        self._entries.pop(request_id, None)

    def run(self, owner: str, kind: str, work: Work) -> str:
        """Start `work` now (not ordered with anything); its result goes under the returned request id."""
        request_id, fut = self.new(owner, kind)
        task = asyncio.create_task(settle(fut, kind, work))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return request_id

    async def retrieve(self, owner: str, request_id: str, wait_s: float) -> Result | None:
        """The result of `request_id` within `wait_s` (a try_again when it is not ready); None: no such request
        for this key."""
        entry = self._entries.get(request_id)
        if entry is None or entry.owner != owner:
            return None
        try:
            return await asyncio.wait_for(asyncio.shield(entry.future), wait_s)
        except TimeoutError:
            return json_result(TryAgain(request_id=request_id))

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def settle(fut: asyncio.Future[Result], kind: str, work: Work) -> None:
    """Run `work` and put its result, or its failure as the SDK reads one, into `fut`."""
    try:
        result = await work()
    except BadRequest as e:  # UserError included: the client's request is at fault
        result = json_result(RequestFailed(error=str(e), category="user"))
    except asyncio.CancelledError:
        if not fut.done():
            fut.set_result(json_result(RequestFailed(error="the service stopped", category="server")))
        raise
    except Exception as e:  # noqa: BLE001 - any failure of the work is its request's answer; the service goes on
        log.error("tinker: %s failed:\n%s", kind, traceback.format_exc())
        result = json_result(RequestFailed(error=f"{type(e).__name__}: {e}", category="server"))
    if not fut.done():
        fut.set_result(result)


class Ordered:
    """Runs one model's requests one at a time, in seq_id order, whatever order they arrive in."""

    next_seq: int | None  # the seq_id that runs next; None: the first one submitted (a model restored mid-run)
    _pending: dict[int, tuple[str, Work, asyncio.Future[Result]]]  # seq_id -> (kind, work, its future)
    _ids: dict[int, str]  # seq_id -> request id, for every request taken (a resent one gets the same)
    _wake: asyncio.Event
    _task: asyncio.Task | None

    def __init__(self, first_seq: int | None):
        self.next_seq = first_seq
        self._pending, self._ids = {}, {}
        self._wake = asyncio.Event()
        self._task = None

    def submit(self, futures: Futures, owner: str, kind: str, seq_id: int | None, work: Work) -> str:
        """Queue `work` as request `seq_id` (None: after every request taken so far); returns its request id."""
        if self.next_seq is None:
            self.next_seq = seq_id if seq_id is not None else 1
        if seq_id is None:
            seq_id = max([self.next_seq - 1, *self._ids]) + 1
        if seq_id in self._ids:  # a retry of a request already taken
            return self._ids[seq_id]
        if seq_id < self.next_seq:
            raise BadRequest(f"seq_id {seq_id}: this model already ran its requests up to {self.next_seq - 1}")
        request_id, fut = futures.new(owner, kind)
        self._ids[seq_id] = request_id
        self._pending[seq_id] = (kind, work, fut)
        self._wake.set()
        if self._task is None:
            self._task = asyncio.create_task(self._run())
        return request_id

    async def _run(self) -> None:
        while True:
            while self.next_seq not in self._pending:
                self._wake.clear()
                await self._wake.wait()
            kind, work, fut = self._pending.pop(self.next_seq)
            await settle(fut, kind, work)
            self._ids.pop(self.next_seq - RETRY_WINDOW, None)  # a retry comes soon after its first: keep the recent
            self.next_seq += 1

    @property
    def waiting(self) -> list[int]:
        """seq_ids taken but not run yet (those beyond a gap wait for the missing one)."""
        return sorted(self._pending)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for _, _, fut in self._pending.values():
            if not fut.done():
                fut.set_result(json_result(RequestFailed(error="the service stopped", category="server")))
