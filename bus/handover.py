"""What a role holds unsettled, kept for its successor: a role killed with deliveries unacked leaves them to
JetStream, which hands them out again only after `bus.ack_wait_s` (a minute by default). The role keeps the ack
subjects of those deliveries in a file of the run directory; the same role started again (the launcher restarts it
under the same id) naks them before its first fetch, and they come back at once.

    handover = Handover(run_dir / "trainer-unacked.json", bus, bus.subjects.traj, bus.subjects.traj_consumer)
    await handover.take_over()          # first: the predecessor's deliveries are redelivered now
    ...
    handover.save(d.reply for d in unsettled)   # after each fetch (and settle): a superset is fine
    handover.save(d.reply for d in unsettled)   # on the way out: nothing held, no file left behind

A file, not the bus: it must survive the role's SIGKILL, and it is read only by the role's own successor on the same
machine (one started elsewhere waits out ack_wait, as before). A nak of a delivery settled since is ignored by
JetStream, so the list may name more than is held; it must never name less than was fetched, so it is written after
each fetch, before the deliveries are worked on.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from rlbus.bus.client import Bus

log = logging.getLogger("rlbus.bus")


class Handover:
    """The ack subjects of one consumer's unsettled deliveries, kept at `path` for this role's successor."""

    path: Path
    _bus: Bus
    _subject: str
    _durable: str

    def __init__(self, path: Path, bus: Bus, subject: str, durable: str):
        self.path, self._bus, self._subject, self._durable = path, bus, subject, durable

    def save(self, replies: Iterable[str]) -> None:
        """Replace the list (atomically: a kill leaves the old list or the new one). An empty list is no file: a role
        that stops holding nothing leaves nothing behind."""
        replies = list(replies)
        if not replies:
            self.path.unlink(missing_ok=True)
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_bytes(msgspec.json.encode(replies))
        os.replace(tmp, self.path)

    async def take_over(self) -> int:
        """Nak every delivery the predecessor listed (only ack subjects of this consumer: `Bus.nak_replies`), so
        they are redelivered now; returns how many naks went out. Call before this role's first fetch."""
        if not self.path.is_file():
            return 0
        try:
            replies = msgspec.json.decode(self.path.read_bytes(), type=list[str])
        except msgspec.DecodeError as e:
            log.warning("%s unreadable (%s): what it named comes back after ack_wait", self.path, e)
            return 0
        sent = await self._bus.nak_replies(self._subject, self._durable, replies)
        if sent:
            log.info("%s (%s): %d delivery(ies) a predecessor held unsettled go back for redelivery now",
                     self._subject, self._durable, sent)
        return sent
