"""What a role holds unsettled, kept for its successor: a role killed with deliveries unacked leaves them to
JetStream, which hands them out again only after `bus.ack_wait_s` (a minute by default). The role keeps the ack
subjects of those deliveries in a file of the run directory; the same role started again (the launcher restarts it
under the same id) naks them before its first fetch, and they come back at once.

    handover = Handover(run_dir / "trainer-unacked.json", bus, bus.subjects.traj, bus.subjects.traj_consumer,
                        key="unacked.trainer", role="trainer")
    await handover.take_over()          # first: the predecessor's deliveries are redelivered now
    ...
    handover.save(d.reply for d in unsettled)   # after each fetch (and settle): a superset is fine
    await handover.share()                      # and into the KV bucket, for a successor on another machine
    handover.save(d.reply for d in unsettled)   # on the way out: nothing held, no file left behind

A file first: it must survive the role's SIGKILL, and is read by the role's own successor on the same machine. With
a `key` (the trainer's, `unacked.trainer`; a named producer's, `unacked.producer.<id>`), the list also goes into the
run's KV bucket, where a successor started on another machine finds it; a share that fails (the bus restarting)
leaves the file to do the work. A nak
of a delivery settled since is ignored by JetStream, so the list may name more than is held; it must never name
less than was fetched, so it is written after each fetch, before the deliveries are worked on.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from rlbus.bus.streams import PRODUCERS_KEY, TRAINER_KEY
from rlbus.schemas.errors import BusError
from rlbus.schemas.wire import Unacked

if TYPE_CHECKING:
    from rlbus.bus.client import Bus

log = logging.getLogger("rlbus.bus")

# The KV keys live in bus/streams.py (bus/auth.py needs them, and importing this module would import the client).
__all__ = ["PRODUCERS_KEY", "TRAINER_KEY", "Handover", "producer_key"]

#: What a KV key may hold (a producer id outside it keeps its list in the file only).
_KEY_TOKEN = re.compile(r"[-_=a-zA-Z0-9]+")


def producer_key(producer_id: str) -> str:
    """The KV key of a producer's list; "" when its id cannot be part of a key."""
    return f"{PRODUCERS_KEY}.{producer_id}" if _KEY_TOKEN.fullmatch(producer_id) else ""


class Handover:
    """The ack subjects of one consumer's unsettled deliveries, kept at `path` (and under `key` in the run's KV
    bucket, when given) for this role's successor."""

    path: Path
    _bus: Bus
    _subject: str
    _durable: str
    _key: str  # KV key of the shared list ("" = the file only)
    _role: str
    _saved: list[str]  # the list as last saved
    _shared: list[str] | None  # the list as last shared (None: never)

    def __init__(self, path: Path, bus: Bus, subject: str, durable: str, *, key: str = "", role: str = ""):
        self.path, self._bus, self._subject, self._durable = path, bus, subject, durable
        self._key, self._role = key, role
        self._saved, self._shared = [], None

    def save(self, replies: Iterable[str]) -> None:
        """Replace the list (atomically: a kill leaves the old list or the new one). An empty list is no file: a role
        that stops holding nothing leaves nothing behind."""
        self._saved = replies = list(replies)
        if not replies:
            self.path.unlink(missing_ok=True)
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_bytes(msgspec.json.encode(replies))
        os.replace(tmp, self.path)

    async def share(self) -> None:
        """Put the list as last saved under `key` in the KV bucket (nothing when it has not changed since, or without
        a key). Best effort: the file stays the record when the bus cannot take it."""
        if not self._key or self._saved == self._shared:
            return
        try:
            await self._bus.kv_put(self._key, Unacked(role=self._role, consumer=self._durable, replies=self._saved))
        except BusError as e:
            log.warning("could not share the unacked list under %s (%s): a successor elsewhere waits out ack_wait",
                        self._key, e)
            return
        self._shared = list(self._saved)

    async def take_over(self) -> int:
        """Nak every delivery the predecessor listed, in the file or under `key` (only ack subjects of this consumer:
        `Bus.nak_replies`), so they are redelivered now; returns how many naks went out. Call before this role's
        first fetch."""
        replies = set(self._from_file())
        if self._key:
            try:
                shared = await self._bus.kv_get(self._key, Unacked)
            except BusError as e:
                log.warning("could not read the unacked list under %s (%s)", self._key, e)
                shared = None
            if shared is not None and shared.consumer == self._durable:
                replies.update(shared.replies)
        if not replies:
            return 0
        sent = await self._bus.nak_replies(self._subject, self._durable, sorted(replies))
        if sent:
            log.info("%s (%s): %d delivery(ies) a predecessor held unsettled go back for redelivery now",
                     self._subject, self._durable, sent)
        return sent

    def _from_file(self) -> list[str]:
        if not self.path.is_file():
            return []
        try:
            return msgspec.json.decode(self.path.read_bytes(), type=list[str])
        except msgspec.DecodeError as e:
            log.warning("%s unreadable (%s): what it named comes back after ack_wait", self.path, e)
            return []
