"""The trainer's intake: pulls TrajectoryGroups from the durable `traj` consumer and forms each step's batch.

A step's batch is `trainer.groups_per_step` whole groups. On the way in, each group meets the staleness policy
(`version - oldest token version > max_staleness`: drop, or keep and let importance weights correct it), optional
dynamic sampling (DAPO: groups whose rewards are all equal carry no GRPO signal and are skipped), and the ledger of
groups already trained (a redelivery after a restart is acknowledged, not retrained).

Acks are held: a group used by step s is acknowledged only by `commit(s)`, after the step is durable (checkpointed).
Until then a background task keeps its delivery alive with `in_progress()`, so JetStream does not redeliver it while
the trainer is healthy, and does redeliver it if the trainer dies: at once, when the restarted trainer naks what its
predecessor held (`take_over`), from the ack subjects the predecessor kept in its run directory.
"""

from __future__ import annotations

import asyncio
import logging
import math
from pathlib import Path
from typing import Callable, Protocol

import msgspec

from rlbus.bus.client import Bus
from rlbus.bus.delivery import Delivery
from rlbus.bus.handover import TRAINER_KEY, Handover
from rlbus.bus.loop import raise_if_failed
from rlbus.bus.transfer_queue import TransferQueue
from rlbus.schemas import staleness
from rlbus.schemas.config import RunConfig
from rlbus.schemas.errors import BusError
from rlbus.schemas.wire import TrajectoryGroup

log = logging.getLogger("rlbus.batcher")

#: Beyond bus.retry_s (how long a producer's publish may take after its put), how much earlier than a group was
#: stored its TransferQueue shards must have started for its missing payload to count as never put (clock skew).
NEVER_PUT_SLACK_S = 10.0
#: In the dead letter of such a group: trainer/feeder.py re-issues its release if no group of it comes after all.
NEVER_PUT = "its payloads were never put"


class Releases(Protocol):
    """Whoever released the prompts (the trainer's feeder): told of every release that will never be trained."""

    def abandon(self, index: int, epoch: int, attempt: int, *, reissue: bool, why: str = "") -> None:
        """Release `index` of `epoch` (its `attempt`-th release) will not become a trained group; release the example
        again when `reissue`. `why`: a few words, kept with an example released again."""

    def vouch(self, task: str, index: int, epoch: int, attempt: int) -> str | None:
        """None if `task` is a release made and not yet superseded; otherwise why not (a group naming anything else
        is dead-lettered with that reason, and steers nothing)."""


class Held(msgspec.Struct):
    delivery: Delivery[TrajectoryGroup]
    step: int  # the step that trained it (-1 while it waits in a batch being formed)


class IntakeCounts(msgspec.Struct, kw_only=True):
    dead_lettered: int = 0
    dropped_stale: int = 0
    skipped_uniform: int = 0
    duplicates: int = 0
    missing_payload: int = 0
    rolled_back: int = 0


class Batcher:
    cfg: RunConfig
    trained: set[str]  # ids of groups whose step is durable (restored from the checkpoint)
    counts: IntakeCounts
    _bus: Bus
    _tq: TransferQueue
    _releases: Releases
    _held: dict[str, Held]
    _discarded: set[str]  # ids of groups discarded in this process: a redelivery must not abandon them twice
    # deliveries fetched beyond what a batch needed (a fetch may return extra), not yet judged
    _backlog: list[Delivery[TrajectoryGroup]]
    _keepalive: asyncio.Task | None
    _bound: Callable[[], int] | None  # the staleness bound in force (the trainer's stability guard); None = configured
    _handover: Handover | None  # the ack subjects of the unsettled deliveries, kept for a successor

    def __init__(self, cfg: RunConfig, bus: Bus, tq: TransferQueue, releases: Releases,
                 trained: set[str] | None = None, max_staleness: Callable[[], int] | None = None,
                 handover: Path | None = None):
        self.cfg = cfg
        subjects = bus.subjects
        self._handover = None if handover is None else Handover(handover, bus, subjects.traj, subjects.traj_consumer,
                                                                key=TRAINER_KEY, role="trainer")
        self._bound = max_staleness
        self._bus, self._tq, self._releases = bus, tq, releases
        self.trained = set(trained or ())
        self.counts = IntakeCounts()
        self._held = {}
        self._discarded = set()
        self._backlog = []
        self._keepalive = None

    def start(self) -> None:
        self._keepalive = asyncio.create_task(self._keep_alive(), name="batcher-keepalive")

    async def stop(self) -> None:
        if self._keepalive is not None:
            self._keepalive.cancel()
            await asyncio.gather(self._keepalive, return_exceptions=True)
        await self._save_unsettled()  # what is still held at the end (none after a run's last commit: the file goes)

    # -------------------------------------------------------------- a predecessor's deliveries

    async def take_over(self) -> int:
        """Before the first fetch: the groups a killed predecessor held unacked go back for redelivery now, not after
        bus.ack_wait_s (bus/handover.py); the restarted trainer would wait that long for the groups of the steps it
        lost. Returns how many were named."""
        return 0 if self._handover is None else await self._handover.take_over()

    async def _save_unsettled(self) -> None:
        """Keep the ack subjects of every delivery held or in the backlog for a successor (after each fetch): in the
        run directory, then in the KV bucket for a successor on another machine."""
        if self._handover is not None:
            self._handover.save([h.delivery.reply for h in self._held.values()] + [d.reply for d in self._backlog])
            await self._handover.share()

    # -------------------------------------------------------------- forming a batch

    async def next_batch(self, version: int, need: int | None = None) -> list[TrajectoryGroup]:
        """Wait for `need` (default groups_per_step) usable groups at trainer version `version`."""
        raise_if_failed(self._keepalive)  # a failed keep-alive would silently let held groups be redelivered
        need = self.cfg.trainer.groups_per_step if need is None else need
        subjects = self._bus.subjects
        batch: list[TrajectoryGroup] = []
        while len(batch) < need:
            if not self._backlog:
                self._backlog = await self._bus.fetch(subjects.traj, subjects.traj_consumer, TrajectoryGroup,
                                                      batch=need - len(batch), timeout=1.0)
                if self._backlog:
                    await self._save_unsettled()
            while self._backlog and len(batch) < need:
                # Judged one at a time at the current version: a leftover waits for the next batch unjudged,
                # so its staleness is measured against the version that trains it.
                group = await self._admit(self._backlog.pop(0), version)
                if group is not None:
                    batch.append(group)
        return batch

    async def await_redelivery(self, group_ids: list[str], timeout: float) -> list[str]:
        """After a restart: wait until the groups of steps the dead trainer lost come back, and put them first.

        A dead trainer's unacked groups return only after ack_wait; without waiting, a short run could finish
        before they do and leave them untrained. Returns the ids that did not come back within `timeout`.
        """
        want = set(group_ids) - self.trained
        subjects = self._bus.subjects
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        seen = {d.data.group_id for d in self._backlog}
        while not want <= seen and loop.time() < deadline:
            got = await self._bus.fetch(subjects.traj, subjects.traj_consumer, TrajectoryGroup,
                                        batch=max(1, len(want - seen)), timeout=1.0)
            self._backlog.extend(got)
            if got:
                await self._save_unsettled()
            seen.update(d.data.group_id for d in got)
        order = {gid: i for i, gid in enumerate(group_ids)}
        # Lost steps' groups first, in their old order; the rest keep their delivery order behind them.
        self._backlog.sort(key=lambda d: order.get(d.data.group_id, len(order)))
        return sorted(want - seen)

    async def _admit(self, d: Delivery[TrajectoryGroup], version: int) -> TrajectoryGroup | None:
        g = d.data
        t = self.cfg.trainer
        if g.group_id in self.trained:  # trained in a durable step; the ack was lost (e.g. crash after checkpoint)
            self.counts.duplicates += 1
            await d.ack()
            await self._free(g)  # a crash between checkpoint and commit() left them stored
            return None
        if g.group_id in self._discarded:  # a second delivery of a group already discarded (its slot is freed)
            self.counts.duplicates += 1
            await d.ack()
            await self._free(g)  # a second copy (a redo published after the duplicate window) stored its own
            return None
        if g.group_id in self._held:  # redelivered while we hold it: keep the first delivery
            self.counts.duplicates += 1
            return None
        distrust = self._releases.vouch(g.task_id, g.index, g.epoch, g.attempt) or _inconsistent(g)
        if distrust is not None:
            # Not a release of ours (forged, or a copy of one already re-issued): it frees no admission slot and
            # re-issues nothing; the dead letter says why. Not remembered as discarded: the real group may come.
            self.counts.dead_lettered += 1
            await d.dead_letter(f"group {g.group_id} from {g.producer_id!r}: {distrust}")
            return None
        bad = [s.key for s in g.samples if not math.isfinite(s.reward)]
        rolled_back = staleness.rolled_back(version, g.max_version)
        stale = staleness.too_stale(version, g.min_version, t, None if self._bound is None else self._bound())
        uniform = t.dynamic_sampling and len({s.reward for s in g.samples}) == 1 and len(g.samples) > 1
        if (bad or rolled_back or stale or uniform) and await self._never_put(d):
            return None  # a group no producer made (its tensors were never put) neither retires nor re-issues
        if bad:
            # A NaN or inf reward would make the whole step's loss NaN (and waste every other group of it). Not
            # re-issued: the same reward function would likely say the same again; the dead letter names it.
            self.counts.dead_lettered += 1
            self._discarded.add(g.group_id)
            await d.dead_letter(f"group {g.group_id} (task {g.task_id}) has non-finite rewards for {bad}")
            await self._free(g)
            self._releases.abandon(g.index, g.epoch, g.attempt, reissue=False, why="non-finite rewards")
            return None
        if rolled_back:
            # Generated by weights of steps a restarted trainer lost (it resumed from an older checkpoint): no
            # version of ours produced these tokens, so no staleness bound or IS weight can vouch for them.
            self.counts.rolled_back += 1
            await self._discard(d, reissue=True, why=staleness.LOST_ROLLED_BACK)
            return None
        if stale:
            self.counts.dropped_stale += 1
            await self._discard(d, reissue=True, why=staleness.LOST_TOO_STALE)
            return None
        if uniform:
            self.counts.skipped_uniform += 1
            await self._discard(d, reissue=False, why="uniform rewards (dynamic sampling)")
            return None
        self._held[g.group_id] = Held(delivery=d, step=-1)
        return g

    async def _free(self, g: TrajectoryGroup) -> None:
        """Drop a finished group's tensors, and whatever else its task stored: the keys of an earlier delivery whose
        producer died between its put and its publish belong to the same task and are named by nobody else."""
        await self._tq.delete(g.keys, owners=[g.task_id])

    async def _discard(self, d: Delivery[TrajectoryGroup], *, reissue: bool, why: str = "") -> None:
        """Give up a group: its release abandoned (the feeder saves any re-issue) before the group is acked. In the
        other order a trainer killed between the two would leave the prompt in flight for good (the group gone, no
        re-issue saved); in this one the group comes back to a restarted trainer, which refuses it as superseded."""
        g = d.data
        self._discarded.add(g.group_id)
        self._releases.abandon(g.index, g.epoch, g.attempt, reissue=reissue, why=why)
        await d.ack()
        await self._free(g)

    async def payload_missing(self, group_ids: list[str]) -> None:
        """Groups whose tensors are gone (Ray restarted): acknowledge them and re-issue their prompts.

        Unless they were never there: a producer puts a group's tensors before it publishes the group, and its
        publish takes at most bus.retry_s, so tensors missing from shards that ran without a restart since well
        before the group was stored (JetStream's clock, which no publisher sets) were never put. Such a group is
        dead-lettered, naming that, and its prompt stays with the release in flight: the feeder re-issues it only if
        no group of it comes within feeder.orphan_grace_s (trainer/feeder.py).
        """
        for gid in group_ids:
            held = self._held.pop(gid)
            _, up_since = await self._tq.missing(held.delivery.data.keys)
            if await self._dead_letter_if_never_put(held.delivery, up_since):
                continue
            self.counts.missing_payload += 1
            await self._discard(held.delivery, reissue=True, why="payload lost")

    async def _never_put(self, d: Delivery[TrajectoryGroup]) -> bool:
        """Before a group retires or re-issues its prompt without being trained (too stale, rolled back, uniform or
        non-finite rewards): True, and the group dead-lettered, if its tensors were never put. A group that names a
        real release but that no producer made (forged with a producer's credential) must not steer the feeder; the
        real group may still come. Tensors present, or lost to a shard's restart: False, the group is judged."""
        missing, up_since = await self._tq.missing(d.data.keys)
        return bool(missing) and await self._dead_letter_if_never_put(d, up_since)

    async def _dead_letter_if_never_put(self, d: Delivery[TrajectoryGroup], up_since: float) -> bool:
        """Whether tensors missing from shards up since `up_since` were never put (see `payload_missing`); if so the
        group is dead-lettered as such, its release left in flight (the feeder's orphan grace takes it from there)."""
        if up_since >= d.stored_at - self.cfg.bus.retry_s - NEVER_PUT_SLACK_S:
            return False
        g = d.data
        self.counts.dead_lettered += 1
        await d.dead_letter(f"group {g.group_id} from {g.producer_id!r}: {NEVER_PUT} (the TransferQueue shards of "
                            f"{g.keys[:3]} have run without a restart since {d.stored_at - up_since:.0f} s before "
                            "the group was published, and do not hold them)")
        return True

    async def roll_back(self, groups: list[tuple[str, int, int, int]]) -> int:
        """The trainer went back to an earlier checkpoint (its stability guard): `groups` (group id, index, epoch,
        attempt), trained in the steps it dropped, are trained no more. Each is acknowledged if still held (its
        tensors freed), leaves `trained`, and its prompt is re-issued (a new attempt: the ledger finds the old one
        re-issued). Returns how many."""
        for group_id, index, epoch, attempt in groups:
            held = self._held.pop(group_id, None)
            self.trained.discard(group_id)
            self._discarded.add(group_id)
            if held is not None:
                await held.delivery.ack()
                await self._free(held.delivery.data)
            self.counts.rolled_back += 1
            self._releases.abandon(index, epoch, attempt, reissue=True, why="rolled back by the stability guard")
        return len(groups)

    # -------------------------------------------------------------- acks after durability

    def trained_in(self, step: int, group_ids: list[str]) -> None:
        for gid in group_ids:
            self._held[gid].step = step

    async def commit(self, durable_step: int) -> int:
        """Ack every group trained in a step <= durable_step, free its tensors; returns how many were acked."""
        done = [gid for gid, h in self._held.items() if 0 <= h.step <= durable_step]
        keys: list[str] = []
        owners: list[str] = []  # each task's other stored keys too (see _free)
        deliveries = []
        for gid in done:
            held = self._held.pop(gid)
            self.trained.add(gid)  # the step is durable: whatever happens to the ack, this group is trained
            keys.extend(held.delivery.data.keys)
            owners.append(held.delivery.data.task_id)
            deliveries.append(held.delivery)
        # All at once: through a failover each ack may wait out its retries, and a step's worth must not add up.
        results = await asyncio.gather(*(d.ack() for d in deliveries), return_exceptions=True)
        for gid, r in zip(done, results):
            if isinstance(r, BusError):
                # Not confirmed (the bus restarted under us): JetStream redelivers the group after ack_wait, and its
                # redelivery meets `trained` and is acked then (`_admit`). Nothing is lost or trained twice.
                log.warning("ack of trained group %s not confirmed (%s); its redelivery will be acked", gid, r)
            elif isinstance(r, BaseException):
                raise r
        if keys:
            await self._tq.delete(keys, owners=owners)
        return len(done)

    def has_group(self, task_id: str) -> bool:
        """Whether a group of `task_id` is held (in a batch or waiting to be acked) or trained (group id = task id)."""
        return task_id in self._held or task_id in self.trained

    def trained_ids(self) -> set[str]:
        """Groups trained so far: durable ones plus those of steps not yet checkpointed (what a checkpoint saves)."""
        return self.trained | {gid for gid, h in self._held.items() if h.step >= 0}

    async def _keep_alive(self) -> None:
        period = max(1.0, self.cfg.bus.ack_wait_s / 3)
        while True:
            await asyncio.sleep(period)
            for delivery in [h.delivery for h in self._held.values()] + list(self._backlog):
                await delivery.in_progress()


def _inconsistent(g: TrajectoryGroup) -> str | None:
    """Why a group cannot be what a producer publishes for its task (None if it can): a producer names the group
    after its task and stores its tensors under `<task id>/...` keys, one per sample."""
    if g.group_id != g.task_id:
        return f"group id {g.group_id!r} is not its task id {g.task_id!r}"
    if not g.samples:
        return "it has no samples"
    foreign = [k for k in g.keys if not k.startswith(f"{g.task_id}/")]
    if foreign:
        return f"payload keys {foreign[:3]} are not under its task id {g.task_id!r}"
    return None
