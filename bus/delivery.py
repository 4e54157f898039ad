"""One message of a durable pull consumer, decoded into its type, and the dead letter of a delivered message.

Deliveries come from `Bus.fetch` / `Bus.pull` (bus/consuming.py); settle each once: ack, nak, term or dead_letter.
Every settle waits for JetStream to confirm it, so a caller that goes on to count pending messages, or exits, sees
its effect -- unless the server no longer knows the delivery (a nats-server restarted since, whose store had not
yet recorded it): then the settle returns False at once and the message is delivered again, as JetStream does
with any delivery it has no record of (docs/reliability.md, "A settle across a server restart").

A delivery settles through the `Settler` that fetched it (the `Bus`), which it knows only as this protocol: this
module imports nothing of the client.
"""

from __future__ import annotations

import logging
from typing import Generic, Protocol, TypeVar

from nats.aio.msg import Msg

from rlbus.bus.retry import describe_error, is_transient
from rlbus.schemas.wire import DEAD_LETTER_EXCERPT, DeadLetter

log = logging.getLogger(__name__)

T = TypeVar("T")

MSG_ID_HEADER = "Nats-Msg-Id"
#: How long an ack / nak / term waits for JetStream's confirmation.
ACK_TIMEOUT_S = 5.0


class Settler(Protocol):
    """What settles a delivery: the connection that fetched it (`Bus`, bus/client.py, hands itself over).

    `epoch` is the connection's reconnect count when the delivery was fetched (`Bus.epoch`): a settle made after a
    reconnect first asks the server whether it still knows the delivery. Both return True once JetStream confirmed
    the settle, False if the server no longer knows the delivery (it will deliver the message again)."""

    async def settle(self, msg: Msg, payload: bytes, consumer: str, epoch: int) -> bool: ...

    async def dead_letter(self, msg: Msg, reason: str, consumer: str, epoch: int) -> bool: ...


class Delivery(Generic[T]):
    """One message of a durable pull consumer, decoded into its type. Settle it once: ack, nak, or term."""

    __slots__ = ("data", "subject", "consumer", "epoch", "_msg", "_settler")

    data: T
    subject: str
    consumer: str
    epoch: int  # the connection's reconnect count when this was fetched (Settler)

    def __init__(self, data: T, msg: Msg, consumer: str, settler: Settler, epoch: int):
        self.data = data
        self.subject = msg.subject
        self.consumer = consumer
        self.epoch = epoch
        self._msg = msg
        self._settler = settler

    # Sequence numbers and the header are read on demand: parsing the ack subject for every message is a
    # measurable share of the client's per-message cost (bench/bus.py), and most consumers never look.
    @property
    def stream_seq(self) -> int:
        return self._msg.metadata.sequence.stream

    @property
    def num_delivered(self) -> int:
        """1 on first delivery."""
        return self._msg.metadata.num_delivered

    @property
    def stored_at(self) -> float:
        """Unix time JetStream stored the message (the server's clock: no publisher can set it)."""
        return self._msg.metadata.timestamp.timestamp()

    @property
    def reply(self) -> str:
        """The subject this delivery is acked on (`$JS.ACK.<stream>.<consumer>....`): any client allowed to publish
        there settles it, a successor of the role that fetched it too (`Bus.nak_replies`)."""
        return self._msg.reply

    @property
    def msg_id(self) -> str:
        """The Nats-Msg-Id header ("" if the publisher set none)."""
        return msg_id_of(self._msg)

    async def ack(self) -> bool:
        """Acknowledge and wait for JetStream to confirm (double ack): once this returns True, no redelivery. False:
        the server no longer knew this delivery (restarted since) and delivers the message again; whoever gets it
        finds the work done (a group's publish is de-duplicated by its Nats-Msg-Id, the trainer's trained set)."""
        return await self._settler.settle(self._msg, b"+ACK", self.consumer, self.epoch)

    async def nak(self, delay: float | None = None) -> bool:
        """Ask for redelivery, after `delay` seconds if given (else at once); returns once JetStream confirmed (True)
        or found that the server no longer knows the delivery (False: it is delivered again anyway)."""
        payload = b"-NAK" if delay is None else b'-NAK {"delay": %d}' % int(delay * 1e9)
        return await self._settler.settle(self._msg, payload, self.consumer, self.epoch)

    async def in_progress(self) -> bool:
        """Still working on it: resets the consumer's ack_wait timer for this message. Sent without waiting for an
        answer, so it never blocks; one lost to an outage (False) at worst lets ack_wait redeliver the message."""
        try:
            await self._msg.in_progress()
        except Exception as e:
            if not is_transient(e):
                raise
            log.warning("in-progress of %s seq %d (%s) not sent: %s", self.subject, self.stream_seq, self.consumer,
                        describe_error(e))
            return False
        return True

    async def term(self) -> bool:
        """Never redeliver this message (confirmed by JetStream before returning True; False: the server no longer
        knew this delivery and delivers the message again)."""
        return await self._settler.settle(self._msg, b"+TERM", self.consumer, self.epoch)

    async def dead_letter(self, reason: str) -> bool:
        """Publish a DeadLetter carrying this message's bytes and `reason`, then terminate it (the term's outcome, as
        `term`)."""
        return await self._settler.dead_letter(self._msg, reason, self.consumer, self.epoch)

    def __repr__(self) -> str:
        return f"Delivery({type(self.data).__name__}, subject={self.subject!r}, seq={self.stream_seq}, n={self.num_delivered})"


def dead_letter_of(msg: Msg, reason: str, *, consumer: str) -> DeadLetter:
    """The DeadLetter of a delivered JetStream message: its bytes, subject, stream sequence and delivery count."""
    meta = msg.metadata
    return DeadLetter(reason=reason, original_subject=msg.subject, payload=bytes(msg.data[:DEAD_LETTER_EXCERPT]),
                      payload_bytes=len(msg.data), stream_seq=meta.sequence.stream, num_delivered=meta.num_delivered,
                      consumer=consumer)


def msg_id_of(msg: Msg) -> str:
    h = msg.headers
    return h.get(MSG_ID_HEADER, "") if h else ""
