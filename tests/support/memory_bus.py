"""In-memory stand-ins for the Bus, its Delivery and the TransferQueue, for fast unit tests of pure logic only.

They imitate just what `consumers/batcher.py` (Batcher) and `trainer/feeder.py` (Feeder) call, with JetStream's
observable rules where those classes depend on them: a delivery is settled at most once, a publish with a msg_id
already stored is a duplicate (`PubAck.duplicate`), a fetch returns [] when nothing is queued. They are not a NATS
model: no ack_wait, redelivery, streams or ordering guarantees beyond FIFO. Everything that needs real JetStream
semantics is tested by the integration tests against a real nats-server (tests/support/nats_server.py).

    bus = MemoryBus("unit")
    d = bus.deliver_group(group)           # queue a TrajectoryGroup delivery on `traj` for the trainer
    bus.push_exhausted(letter)             # a DeadLetter for `exhausted(...)`; bus.end_exhausted() ends the iterator
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from nats.js.api import PubAck

from rlbus.schemas.subjects import Subjects
from rlbus.schemas.wire import DeadLetter, TrajectoryGroup, TypedDecoder, encode


class SettledTwice(AssertionError):
    """A delivery was acked, nak'ed or terminated after it was already settled (a double-ack bug)."""


class MemoryDelivery:
    """One queued message. `data` is decoded by `fetch` with the type the consumer asks for, as the real Bus does."""

    def __init__(self, subject: str, payload: bytes, num_delivered: int):
        self.subject = subject
        self.consumer = ""
        self.payload = payload
        self.num_delivered = num_delivered
        self.data: Any = None
        self.acks = 0
        self.naks: list[float | None] = []
        self.terms = 0
        self.in_progress_calls = 0
        self.dead_letters: list[str] = []  # reasons of dead_letter() calls (the real one publishes, then terms)
        self.stored_at = time.time()  # JetStream's clock, when the message was stored

    @property
    def settled(self) -> bool:
        return bool(self.acks or self.naks or self.terms)

    def _settle(self, how: str) -> None:
        if self.settled:
            raise SettledTwice(f"{how} of an already settled delivery {self!r}")

    async def ack(self) -> None:
        self._settle("ack")
        self.acks += 1

    async def nak(self, delay: float | None = None) -> None:
        self._settle("nak")
        self.naks.append(delay)

    async def in_progress(self) -> None:
        self.in_progress_calls += 1

    async def term(self) -> None:
        self._settle("term")
        self.terms += 1

    async def dead_letter(self, reason: str) -> None:
        self._settle("dead_letter")
        self.dead_letters.append(reason)
        self.terms += 1

    def __repr__(self) -> str:
        gid = getattr(self.data, "group_id", None)
        return f"MemoryDelivery({self.subject!r}, {gid!r}, n={self.num_delivered}, acks={self.acks})"


class MemoryBus:
    def __init__(self, run: str = "unit"):
        self.subjects = Subjects.for_run(run)
        self.published: list[tuple[str, Any, str | None]] = []  # (subject, msg, msg_id) of every stored message
        self.duplicates: list[str] = []  # msg_ids of publishes dropped as duplicates
        self.fetches: list[tuple[str, str, int]] = []  # (subject, durable, batch) of every fetch
        self.exhausted_calls: list[tuple[str, str]] = []
        self._msg_ids: set[tuple[str, str]] = set()
        self._queues: dict[str, deque[MemoryDelivery]] = {}
        self._deliveries: dict[str, int] = {}  # msg key -> times delivered
        self._dead: asyncio.Queue[DeadLetter | None] = asyncio.Queue()

    async def publish(self, subject: str, msg: Any, msg_id: str | None = None) -> PubAck:
        encode(msg)  # what the real bus sends must be encodable
        if msg_id is not None and (subject, msg_id) in self._msg_ids:
            self.duplicates.append(msg_id)
            return PubAck(stream=subject, seq=len(self.published), duplicate=True)
        if msg_id is not None:
            self._msg_ids.add((subject, msg_id))
        self.published.append((subject, msg, msg_id))
        return PubAck(stream=subject, seq=len(self.published), duplicate=False)

    def deliver(self, subject: str, msg: Any, key: str) -> MemoryDelivery:
        """Queue a (re)delivery of `msg` for `fetch`; `key` identifies the message across redeliveries."""
        self._deliveries[key] = self._deliveries.get(key, 0) + 1
        d = MemoryDelivery(subject, encode(msg), self._deliveries[key])
        self._queues.setdefault(subject, deque()).append(d)
        return d

    def deliver_group(self, group: TrajectoryGroup) -> MemoryDelivery:
        return self.deliver(self.subjects.traj, group, group.group_id)

    def queued(self, subject: str) -> int:
        return len(self._queues.get(subject, ()))

    async def fetch(self, subject: str, durable: str, typ: Any, batch: int = 1,
                    timeout: float = 1.0) -> list[MemoryDelivery]:
        self.fetches.append((subject, durable, batch))
        q = self._queues.get(subject)
        if not q:
            await asyncio.sleep(min(timeout, 0.005))  # a short wait, so a caller's loop does not spin hot
            return []
        decoder = TypedDecoder(typ)
        out = [q.popleft() for _ in range(min(batch, len(q)))]
        for d in out:
            d.consumer = durable
            d.data = decoder.decode(d.payload)
        return out

    async def watch(self, subject: str, typ: Any, *, deliver: str = "new") -> AsyncIterator[Any]:
        """deliver="all": what was published on `subject` so far, in order, then the iterator ends (a snapshot:
        enough for the pure logic tested here)."""
        assert deliver == "all", "the in-memory watch only replays what was published"
        for published_subject, msg, _ in list(self.published):
            if published_subject == subject:
                yield TypedDecoder(typ).decode(encode(msg))

    def push_exhausted(self, letter: DeadLetter) -> None:
        self._dead.put_nowait(letter)

    def end_exhausted(self) -> None:
        """Make `exhausted()` return once the letters pushed before are yielded."""
        self._dead.put_nowait(None)

    async def exhausted(self, subject: str, durable: str) -> AsyncIterator[DeadLetter]:
        self.exhausted_calls.append((subject, durable))
        while (letter := await self._dead.get()) is not None:
            yield letter


class MemoryTransferQueue:
    def __init__(self) -> None:
        self.deleted: list[list[str]] = []  # the keys of every delete call
        self.owners_deleted: list[list[str]] = []  # its owners
        self.absent: set[str] = set()  # keys it does not hold (every other key is there)
        self.started_at: float | None = None  # None: as if restarted just now (a missing payload was lost)

    async def missing(self, keys: list[str]) -> tuple[list[str], float]:
        return [k for k in keys if k in self.absent], time.time() if self.started_at is None else self.started_at

    async def delete(self, keys: list[str], owners: list[str] = ()) -> int:
        self.deleted.append(list(keys))
        self.owners_deleted.append(list(owners))
        return len(keys)
