"""The consuming half of `Bus` (bus/client.py): durable pull consumers, ordered watches and snapshots, and the
moving of messages that ran out of deliveries to the dead letters.

    async for d in bus.pull(bus.subjects.traj, bus.subjects.traj_consumer, TrajectoryGroup, batch=16):
        ...; await d.ack()
    async for published in bus.watch(bus.subjects.weights, WeightsPublished, deliver="last"):
        ...

`Bus` inherits these methods from `Consuming`, which holds no state: they use the Bus's connection (`nc`, `js`), its
retry loop (`_retry`), its publish, settle and dead-letter calls, and its per-durable fetch state. A message that
does not decode is dead-lettered (pull consumers) or reported beside the reading (ordered ones). Tests:
`pytest tests/integration/test_bus.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
import time
from collections.abc import Iterable
from typing import Any, AsyncIterator, Literal, TypeVar

import msgspec
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy

from rlbus.bus.delivery import Delivery, dead_letter_of
from rlbus.bus.retry import describe_error, is_transient, permanent
from rlbus.schemas.errors import BusError, SchemaError
from rlbus.schemas.wire import DEAD_LETTER_EXCERPT, DeadLetter, TypedDecoder

log = logging.getLogger(__name__)

T = TypeVar("T")

#: How long a fetch waits before it asks again after a transient failure (no consumer leader, a reconnect).
FETCH_RETRY_WAIT_S = 0.5
#: How long `nak_replies` waits for its naks to reach the server.
NAK_FLUSH_TIMEOUT_S = 2.0

DeliverFrom = Literal["new", "all", "last", "last_per_subject"]
_DELIVER = {
    "new": DeliverPolicy.NEW,
    "all": DeliverPolicy.ALL,
    "last": DeliverPolicy.LAST,
    "last_per_subject": DeliverPolicy.LAST_PER_SUBJECT,  # e.g. each producer's last heartbeat
}


class Consuming:
    """The consuming methods of `Bus` (bus/client.py), which inherits them; no state of its own."""

    async def fetch(
        self, subject: str, durable: str, typ: Any, batch: int = 1, timeout: float = 1.0
    ) -> list[Delivery[Any]]:
        """One fetch of up to `batch` messages from a durable pull consumer; [] if none came within `timeout`."""
        stream = self.stream_of(subject)
        # One subscription per durable, kept: a message the server sends just as a fetch times out lands in this
        # inbox and is returned by the next fetch, instead of in an abandoned inbox (a lost delivery until ack_wait).
        sub = self._fetch_subs.get((stream, durable))
        if sub is None:
            sub = self._fetch_subs[(stream, durable)] = await self.js.pull_subscribe_bind(durable=durable, stream=stream)
        return await self._fetch_decoded(sub, durable, TypedDecoder(typ), batch, timeout)

    async def pull(
        self, subject: str, durable: str, typ: type[T] | Any, *, batch: int = 1, timeout: float = 1.0
    ) -> AsyncIterator[Delivery[T]]:
        """Deliveries of a durable pull consumer, forever. Several iterators on one durable share its messages."""
        decoder = TypedDecoder(typ)
        sub = await self.js.pull_subscribe_bind(durable=durable, stream=self.stream_of(subject))
        try:
            while True:
                for d in await self._fetch_decoded(sub, durable, decoder, batch, timeout):
                    yield d
        finally:
            if not self.nc.is_closed:
                await sub.unsubscribe()

    async def nak_replies(self, subject: str, durable: str, replies: Iterable[str]) -> int:
        """Redeliver now what a dead predecessor held unsettled: a -NAK to each delivery's ack subject (`replies`,
        saved by that predecessor: `Delivery.reply`), so that its messages come back at once instead of after
        ack_wait. Sent without waiting for an answer: a delivery settled or redelivered meanwhile gets none, and a
        nak lost to an outage leaves its message to ack_wait as before. Only subjects of `durable`'s consumer on
        `subject`'s stream are sent to; returns how many."""
        prefix = f"$JS.ACK.{self.stream_of(subject)}.{durable}."
        sent = 0
        for reply in replies:
            if isinstance(reply, str) and reply.startswith(prefix) and " " not in reply:
                await self.nc.publish(reply, b"-NAK")
                sent += 1
        if sent:
            try:
                await self.nc.flush(timeout=NAK_FLUSH_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 -- an outage: what did not go out comes back after ack_wait
                log.warning("bus %s: naks of %d delivery(ies) not confirmed flushed: %s", self.name, sent,
                            describe_error(e))
        return sent

    async def _fetch_decoded(
        self, sub: JetStreamContext.PullSubscription, durable: str, decoder: TypedDecoder, batch: int, timeout: float
    ) -> list[Delivery[Any]]:
        out: list[Delivery[Any]] = []
        msgs, epoch = await self._fetch_raw(sub, durable, batch, timeout)
        for m in msgs:
            try:
                data = decoder.decode(m.data)
            except SchemaError as e:
                await self.dead_letter(m, str(e), durable, epoch)
                continue
            out.append(Delivery(data, m, durable, self, epoch))
        return out

    async def _fetch_raw(
        self, sub: JetStreamContext.PullSubscription, durable: str, batch: int, timeout: float
    ) -> tuple[list[Msg], int]:
        """(messages, the connection epoch they were delivered at or after: `Settler`)."""
        # Messages the server sent on the connection of this epoch or a later one; those left in the inbox by an
        # earlier fetch (sent as it timed out) may be older still, and are taken as from before any reconnect.
        epoch = self.epoch if sub.pending_msgs == 0 else -1
        try:
            msgs = await sub.fetch(batch, timeout=timeout)
        except asyncio.TimeoutError:
            # Idle: nothing to deliver within `timeout`. nats-py raises its own TimeoutError (a subclass) or, from a
            # batched fetch whose first probe outlasts the timeout on a loaded machine, asyncio's.
            self._fetch_failing_since.pop(durable, None)
            return [], epoch
        except Exception as e:
            # No consumer leader (an election on a cluster) or a reconnect: nothing to deliver now; try again, for
            # as long as bus.retry_s allows.
            what = f"bus {self.name}: fetch from {durable}"
            if not is_transient(e):
                permanent(e, what)
                raise
            now = asyncio.get_running_loop().time()
            since = self._fetch_failing_since.setdefault(durable, now)
            if now - since > self.cfg.retry_s:
                raise BusError(f"{what} failing for {now - since:.0f}s: {describe_error(e)}") from e
            if since == now:
                log.warning("%s: %s; retrying", what, describe_error(e))
            await asyncio.sleep(min(timeout, FETCH_RETRY_WAIT_S))
            return [], epoch
        self._fetch_failing_since.pop(durable, None)
        return msgs, epoch

    async def watch(self, subject: str, typ: type[T] | Any, *, deliver: DeliverFrom = "new") -> AsyncIterator[T]:
        """Messages of `subject` in order through an ephemeral ordered consumer (nothing to ack)."""
        if deliver not in _DELIVER:
            raise BusError(f"watch deliver={deliver!r}; expected one of {sorted(_DELIVER)}")
        decoder = TypedDecoder(typ)
        sub = await self._ordered(subject, deliver)
        try:
            async for m in sub.messages:
                try:
                    yield decoder.decode(m.data)
                except SchemaError as e:
                    # Nothing to terminate on an ordered consumer; record it so the bad message is seen, and go on at
                    # once: the dead letter is published beside the watch, not in its way (an observer's credential
                    # may not publish it at all, and a refused publish is retried for bus.retry_s).
                    log.warning("bus %s: undecodable message on %s: %s", self.name, m.subject, e)
                    letter = dead_letter_of(m, str(e), consumer=f"watch:{self.name}")
                    task = asyncio.create_task(self._dead_letter_aside(letter))
                    self._aside.add(task)
                    task.add_done_callback(self._aside.discard)
        finally:
            if not self.nc.is_closed:
                await sub.unsubscribe()

    async def _dead_letter_aside(self, letter: DeadLetter) -> None:
        try:
            await self.publish(self.subjects.dead_letter, letter)
        except Exception as e:  # noqa: BLE001 -- a record of a bad message; the warning above has its reason
            log.warning("bus %s: could not dead-letter an undecodable message (%s)", self.name, describe_error(e))

    async def _ordered(self, subject: str, deliver: DeliverFrom, since_s: float | None = None) -> Any:
        # An ordered consumer re-creates itself after a failover (nats-py resets it on missed heartbeats).
        policy, config = _DELIVER[deliver], None
        if since_s is not None:  # from a moment on, whatever `deliver` says
            start = datetime.datetime.fromtimestamp(time.time() - since_s, tz=datetime.timezone.utc)
            policy = DeliverPolicy.BY_START_TIME
            config = ConsumerConfig(opt_start_time=start.isoformat().replace("+00:00", "Z"))
        return await self._retry(f"ordered consumer on {subject}", lambda: self.js.subscribe(
            subject, stream=self.stream_of(subject), ordered_consumer=True, deliver_policy=policy, config=config))

    async def snapshot(self, subject: str, typ: type[T] | Any, *, deliver: DeliverFrom = "all",
                       timeout: float = 30.0, since_s: float | None = None) -> list[T]:
        """What the stream holds for `subject` now (all of it, the last, the last per subject, or what came in the
        last `since_s` seconds), then stop.

        Caught up is known exactly, not guessed from a quiet spell: every JetStream delivery says how many
        messages remain for its consumer, and the read ends at the first one that says none. Messages published
        meanwhile may be included (they are newer). Undecodable messages are skipped here (watch() reports them).
        """
        if deliver not in ("all", "last", "last_per_subject"):
            raise BusError(f"snapshot deliver={deliver!r}; expected all, last or last_per_subject")
        decoder = TypedDecoder(typ)
        sub = await self._ordered(subject, deliver, since_s)
        out: list[T] = []
        try:
            info = await self._retry(f"consumer info of a snapshot of {subject}", sub.consumer_info)
            if info.num_pending == 0 and info.delivered.consumer_seq == 0:
                return out
            async with asyncio.timeout(timeout):
                async for m in sub.messages:
                    with contextlib.suppress(SchemaError):
                        out.append(decoder.decode(m.data))
                    if m.metadata.num_pending == 0:
                        break
        finally:
            if not self.nc.is_closed:
                await sub.unsubscribe()
        return out

    async def exhausted(self, subject: str, durable: str) -> AsyncIterator[DeadLetter]:
        """Messages of a durable consumer that reached max_deliver without an ack, each moved to the dead letters.

        JetStream stops redelivering such a message and only says so in an advisory; left alone it would sit in a
        work queue forever. The advisories of the prompts consumer are kept in the run's advisories stream (a work
        queue, so one sent while nobody listened waits there). For each, this takes the message out of its stream,
        publishes it as a DeadLetter (reason: the delivery count), acks the advisory and yields the letter, so the
        caller can re-issue the work. Only the prompts consumer's advisories are captured.
        """
        s = self.subjects
        if (subject, durable) != (s.prompts, s.prompts_consumer):
            raise BusError(f"only {s.prompts_consumer} of {s.prompts} has its max-deliveries advisories kept")
        stream = self.stream_of(subject)
        sub = await self._retry("bind the advisories consumer", lambda: self.js.pull_subscribe_bind(
            durable=s.advisories_consumer, stream=s.advisories_stream))
        try:
            while True:
                msgs, epoch = await self._fetch_raw(sub, s.advisories_consumer, 8, 1.0)
                for m in msgs:
                    letter = await self._move_exhausted(m, stream, subject, durable)
                    await self.settle(m, b"+ACK", s.advisories_consumer, epoch)
                    if letter is not None:
                        yield letter
        finally:
            if not self.nc.is_closed:
                await sub.unsubscribe()

    async def _move_exhausted(self, advisory_msg: Msg, stream: str, subject: str, durable: str) -> DeadLetter | None:
        try:
            advisory = msgspec.json.decode(advisory_msg.data)
            seq, deliveries = int(advisory["stream_seq"]), int(advisory.get("deliveries", 0))
        except (msgspec.DecodeError, KeyError, TypeError, ValueError):
            log.warning("bus %s: unreadable max-deliveries advisory %r; skipped", self.name, advisory_msg.data[:200])
            return None
        try:
            raw = await self._retry(f"get {stream} seq {seq}", lambda: self.js.get_msg(stream, seq))
        except nats.js.errors.NotFoundError:
            return None  # acked or removed meanwhile (or moved before a crash): nothing was lost
        letter = DeadLetter(
            reason=f"not acknowledged after {deliveries} deliveries (max_deliver)",
            original_subject=raw.subject or subject,
            payload=bytes((raw.data or b"")[:DEAD_LETTER_EXCERPT]),
            payload_bytes=len(raw.data or b""),
            stream_seq=seq,
            num_delivered=deliveries,
            consumer=durable,
        )
        # The msg id makes a second move of the same message (a crash before the delete) one letter, not two.
        await self.publish(self.subjects.dead_letter, letter, msg_id=f"exhausted-{stream}-{seq}")
        try:
            await self._retry(f"delete {stream} seq {seq}", lambda: self.js.delete_msg(stream, seq))
        except nats.js.errors.NotFoundError:
            pass
        log.warning("bus %s: %s seq %d dead-lettered after %d deliveries", self.name, subject, seq, deliveries)
        return letter
