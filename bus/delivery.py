"""One message of a durable pull consumer, decoded into its type, and the dead letter of a delivered message.

Deliveries come from `Bus.fetch` / `Bus.pull` (bus/consuming.py); settle each once: ack, nak, term or dead_letter.
Every settle waits for JetStream to confirm it, so a caller that goes on to count pending messages, or exits, sees
its effect.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Generic, TypeVar

from nats.aio.msg import Msg

from rlbus.schemas.wire import DEAD_LETTER_EXCERPT, DeadLetter

if TYPE_CHECKING:
    from rlbus.bus.client import Bus

T = TypeVar("T")

MSG_ID_HEADER = "Nats-Msg-Id"
#: How long an ack / nak / term waits for JetStream's confirmation.
ACK_TIMEOUT_S = 5.0


class Delivery(Generic[T]):
    """One message of a durable pull consumer, decoded into its type. Settle it once: ack, nak, or term."""

    __slots__ = ("data", "subject", "consumer", "_msg", "_bus")

    data: T
    subject: str
    consumer: str

    def __init__(self, data: T, msg: Msg, consumer: str, bus: "Bus"):
        self.data = data
        self.subject = msg.subject
        self.consumer = consumer
        self._msg = msg
        self._bus = bus

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

    async def ack(self) -> None:
        """Acknowledge and wait for JetStream to confirm (double ack): once this returns, no redelivery."""
        await self._bus._settle(self._msg, b"+ACK", self.consumer)

    async def nak(self, delay: float | None = None) -> None:
        """Ask for redelivery, after `delay` seconds if given (else at once); returns once JetStream confirmed."""
        payload = b"-NAK" if delay is None else b'-NAK {"delay": %d}' % int(delay * 1e9)
        await self._bus._settle(self._msg, payload, self.consumer)

    async def in_progress(self) -> None:
        """Still working on it: resets the consumer's ack_wait timer for this message."""
        await self._msg.in_progress()

    async def term(self) -> None:
        """Never redeliver this message (confirmed by JetStream before returning)."""
        await self._bus._settle(self._msg, b"+TERM", self.consumer)

    async def dead_letter(self, reason: str) -> None:
        """Publish a DeadLetter carrying this message's bytes and `reason`, then terminate it."""
        await self._bus._dead_letter(self._msg, reason, self.consumer)

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
