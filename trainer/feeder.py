"""The prompt feeder: walks the data set and releases PromptTasks onto the `prompts` work queue, under admission.

It runs inside the trainer's controller (rank 0), because admission depends on the trainer's version:

    admitted = released - abandoned <= (version + max_staleness + 1) * groups_per_step      (AReaL's rule)

`abandoned` counts releases that will never become a trained group (dropped as too stale, skipped by dynamic
sampling, payload lost, dead-lettered), so they do not hold admission slots forever. Groups whose data was lost are
re-issued (a new release of the same example with attempt + 1): an example is given up once `feeder.max_attempts`
of its releases were lost for its own sake (payload lost, dead-lettered, ...) or `feeder.max_stale_releases` were
lost to staleness, which says nothing about the example (a re-issue lands at the back of the admission window, where
a fast trainer makes it stale again).

A release whose group was dead-lettered because its payloads were never put (consumers/batcher.py: a forged group,
or one whose tensors a producer's bug deleted) is not re-issued at once: its real group may still come. If none is
held or trained `feeder.orphan_grace_s` after the dead letter, and the release is still the example's latest, it is
re-issued, so no prompt stays in flight for good (holding an admission slot). Found from the dead letters (read from
the stream's start), so a restarted trainer finds the same ones.

Task ids are deterministic (`e<epoch>-i<index>-a<attempt>`) and sent as Nats-Msg-Id, so a feeder that restarts and
re-releases a task within JetStream's duplicate window is de-duplicated. The feeder's position is written to
`<run_dir>/feeder.json` before each release batch is published, with the batch as pending (write-ahead), so a
restart continues where it stopped, not at the last checkpoint (tasks released since the checkpoint are still in
the queue or with producers), never behind a task it already published, and publishes a pending batch again.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import re
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import msgspec

from rlbus.bus.client import Bus
from rlbus.common.data import PromptDataset, example_to_task
from rlbus.common.files import write_atomic
from rlbus.consumers.batcher import NEVER_PUT
from rlbus.schemas import staleness
from rlbus.schemas.config import RunConfig
from rlbus.schemas.errors import SchemaError
from rlbus.schemas.wire import DeadLetter, PromptTask, TrajectoryGroup, TypedDecoder

log = logging.getLogger("rlbus.feeder")
_TASK_ID = re.compile(r"e(\d+)-i(\d+)-a(\d+)")
_GROUPS = TypedDecoder(TrajectoryGroup)


class Reissue(msgspec.Struct, array_like=True):
    index: int
    epoch: int
    attempt: int


class FeederState(msgspec.Struct, kw_only=True):
    epoch: int = 0
    cursor: int = 0  # next position in this epoch's permutation
    released: int = 0
    abandoned: int = 0
    reissues: list[Reissue] = []
    given_up: int = 0  # examples dropped after max_attempts releases
    gave_up: list[str] = []  # their last task ids, so that the ledger accounts for each by name
    dead_lettered: list[str] = []  # task ids whose dead letter was handled (re-issued once)
    orphans_handled: list[str] = []  # task ids whose never-put group's dead letter was judged after the grace
    pending: list[Reissue] = []  # releases saved as made before their publish (write-ahead): published on a restart
    exhausted: bool = False  # all epochs released
    attempts: dict[str, int] = {}  # "e<epoch>-i<index>" -> its latest re-issue (scheduled or released); absent: 0
    lost: dict[str, list[str]] = {}  # "e<epoch>-i<index>" -> why each of its releases that was re-issued was lost
    retired: dict[str, str] = {}  # task id -> why its group was dropped without a re-issue (non-finite rewards, ...)


def task_id(index: int, epoch: int, attempt: int) -> str:
    """The deterministic id of one release of an example (also its group's id and Nats-Msg-Id)."""
    return f"e{epoch}-i{index}-a{attempt}"


def parse_task_id(task: str) -> tuple[int, int, int]:
    """(index, epoch, attempt) of a task id made by `task_id`; ValueError for any other string."""
    m = _TASK_ID.fullmatch(task)
    if m is None:
        raise ValueError(f"{task!r} is not a task id (e<epoch>-i<index>-a<attempt>)")
    return int(m[2]), int(m[1]), int(m[3])


def permutation(n: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    order = list(range(n))
    if shuffle:
        random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


class Feeder:
    """Releases tasks while admission allows. `version_fn()` returns the trainer's current version."""

    cfg: RunConfig
    state: FeederState
    _dataset: PromptDataset
    _bus: Bus
    _version_fn: Callable[[], int]
    _wake: asyncio.Event
    _path: Path
    _order: list[int]
    _position: list[int]  # example index -> its position in this epoch's order
    _on_release: Callable[[PromptTask, str], None] | None  # the event recorder (the work queue allows no 2nd reader)
    _forget: Callable[[list[str]], Awaitable[Any]] | None  # frees whatever tasks stored in the TransferQueue
    _bound: Callable[[], int] | None  # the staleness bound in force (the stability guard's); None = the configured
    _settled: Callable[[str], bool] | None  # whether a group of a task is held or trained (the batcher's)
    _orphans: dict[str, tuple[int, int, int, float]]  # never-put task -> (index, epoch, attempt, when to judge it)

    def __init__(self, cfg: RunConfig, dataset: PromptDataset, bus: Bus, version_fn: Callable[[], int], state: FeederState | None = None,
                 on_release: Callable[[PromptTask, str], None] | None = None,
                 forget: Callable[[list[str]], Awaitable[Any]] | None = None,
                 max_staleness: Callable[[], int] | None = None, settled: Callable[[str], bool] | None = None):
        self.cfg = cfg
        self._settled = settled
        self._orphans = {}
        self._bound = max_staleness
        self._forget = forget
        self._on_release = on_release
        self._dataset = dataset
        self._bus = bus
        self._version_fn = version_fn
        self._wake = asyncio.Event()
        self._path = cfg.run_dir / "feeder.json"
        self.state = state or self._load_saved() or FeederState()
        self._set_order()

    # -------------------------------------------------------------- admission

    def admitted(self) -> int:
        return self.state.released - self.state.abandoned

    def allowance(self) -> int:
        """How many more tasks admission allows right now."""
        return staleness.allowance(self._version_fn(), self.state.released, self.state.abandoned, self.cfg.trainer,
                                   max_staleness=None if self._bound is None else self._bound())

    def notify(self) -> None:
        """The version moved or a release was abandoned: re-check admission."""
        self._wake.set()

    def abandon(self, index: int, epoch: int, attempt: int, *, reissue: bool, why: str = "") -> None:
        """A release will not become a trained group; optionally release the example again. `why` (a few words: "too
        stale", "payload lost") is kept for an example released again, so that one given up says why each of its
        releases was lost, and for a release retired without a re-issue (the log line, feeder.json, `rlbus events
        --ledger`)."""
        self.state.abandoned += 1
        if not reissue:  # the example is done without being trained: the ledger accounts for it by this name
            self.state.retired[task_id(index, epoch, attempt)] = why or "unspecified"
        else:
            example = _example(index, epoch)
            lost = self.state.lost.setdefault(example, [])
            lost.append(why or "unspecified")
            stale = sum(w in staleness.STALENESS_LOSSES for w in lost)
            if len(lost) - stale < self.cfg.feeder.max_attempts and stale < self.cfg.feeder.max_stale_releases:
                self.state.reissues.append(Reissue(index=index, epoch=epoch, attempt=attempt + 1))
                self.state.attempts[example] = attempt + 1
            else:
                self.state.given_up += 1
                self.state.gave_up.append(task_id(index, epoch, attempt))
                log.warning("example %d (epoch %d) given up after %d releases (lost: %s)", index, epoch, attempt + 1,
                            ", ".join(lost))
        # Saved now, not at the next release: the group is already acked, so a crash before the next release would
        # lose the re-issue and keep the admission slot held for good.
        self._save()
        self.notify()

    def vouch(self, task: str, index: int, epoch: int, attempt: int) -> str | None:
        """None if `task` (index, epoch, attempt) is a release this feeder made and has not superseded; otherwise
        why not. Only such a release may re-issue or retire its prompt: a group or a dead letter that names
        anything else (forged, or a copy of a release already re-issued) is dead-lettered with this reason."""
        s = self.state
        if task != task_id(index, epoch, attempt):
            return f"task id {task!r} does not match its index {index}, epoch {epoch}, attempt {attempt}"
        if not 0 <= index < len(self._dataset):
            return f"task {task} names example {index}; the data set has {len(self._dataset)}"
        if epoch > s.epoch or (epoch == s.epoch and self._position[index] >= s.cursor):
            return f"task {task} was never released (the feeder is at epoch {s.epoch}, position {s.cursor})"
        latest = s.attempts.get(_example(index, epoch), 0)
        if attempt > latest or Reissue(index=index, epoch=epoch, attempt=attempt) in s.reissues:
            return f"task {task} was never released (example {index} of epoch {epoch} is at attempt {latest})"
        if attempt < latest:
            return f"task {task} was superseded: its prompt was already re-issued as attempt {latest}"
        if task in s.gave_up:
            return f"task {task} was given up after {attempt + 1} releases"
        return None

    # -------------------------------------------------------------- main loop

    async def run(self) -> None:
        if self.state.pending:  # a feeder that died mid-batch: its releases go out (again; msg ids de-duplicate)
            log.info("feeder: publishing %d release(s) saved before a restart", len(self.state.pending))
            await self._publish_pending()
        while True:
            self._wake.clear()  # before reading the allowance: a notify() after this line is not missed
            self.reissue_orphans()
            n = self.allowance()
            if n > 0 and await self._release(n) == 0 and self.state.exhausted:
                log.info("feeder: data set exhausted after %d epoch(s)", self.state.epoch + 1)
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=5.0)
            except asyncio.TimeoutError:
                pass

    async def _release(self, n: int) -> int:
        """Release up to `n` tasks. They are saved as released (and pending) before any is published: a feeder killed
        mid-batch must not restart behind tasks it already published, or their groups would be refused as never
        released while the restarted feeder's own release of them is de-duplicated away (the prompt stuck in
        flight). The restart publishes the pending ones again (`run`)."""
        items: list[Reissue] = []
        while len(items) < n:
            item = self._next()
            if item is None:
                break
            items.append(Reissue(*item))
        if not items:
            return 0
        self.state.pending = items
        self.state.released += len(items)
        self._save()
        await self._publish_pending()
        return len(items)

    async def _publish_pending(self) -> None:
        for r in self.state.pending:
            task = self._task(r.index, r.epoch, r.attempt)
            await self._bus.publish(self._bus.subjects.prompts, task, msg_id=task.task_id)
            if self._on_release is not None:  # a duplicate too: its first copy's ack may have been lost to a failover
                self._on_release(task, self._bus.subjects.prompts)
        self.state.pending = []
        self._save()

    def _next(self) -> tuple[int, int, int] | None:
        s = self.state
        if s.reissues:
            r = s.reissues.pop(0)
            return r.index, r.epoch, r.attempt
        if s.exhausted:
            return None
        if s.cursor >= len(self._order):
            epochs = self.cfg.feeder.epochs
            if epochs and s.epoch + 1 >= epochs:
                s.exhausted = True
                return None
            s.epoch += 1
            s.cursor = 0
            self._set_order()
        index = self._order[s.cursor]
        s.cursor += 1
        return index, s.epoch, 0

    def _task(self, index: int, epoch: int, attempt: int) -> PromptTask:
        return example_to_task(self._dataset[index], task_id=task_id(index, epoch, attempt),
                               n=self.cfg.rollout.n, epoch=epoch, attempt=attempt,
                               released_version=self._version_fn())

    async def move_exhausted(self) -> None:
        """Tasks that reached `bus.max_deliver` unacked sit in the work queue for good: move each into the dead
        letters (`reissue_dead_letters` takes it from there)."""
        subjects = self._bus.subjects
        async for _ in self._bus.exhausted(subjects.prompts, subjects.prompts_consumer):
            pass

    async def reissue_dead_letters(self) -> None:
        """Release again every task that ended in the dead letters, once, by name.

        A task gets there two ways: a producer gave up on it after its last delivery (and terminated it, which
        raises no max-deliveries advisory), or it reached max_deliver unacked (`move_exhausted`). Both are read
        from the events stream from its start, so a letter written while this feeder was down is not missed, and
        the task ids already handled (saved with the state) are not released twice.
        """
        decoder = TypedDecoder(PromptTask)
        subjects = self._bus.subjects
        handled = set(self.state.dead_lettered)
        async for letter in self._bus.watch(subjects.dead_letter, DeadLetter, deliver="all"):
            if letter.original_subject == subjects.traj:
                self._note_orphan(letter)
                continue
            if letter.original_subject != subjects.prompts or letter.payload_bytes > len(letter.payload):
                continue  # not a prompt, or garbage cut to an excerpt: no task to name
            try:
                task = decoder.decode(letter.payload)
            except SchemaError:
                continue  # garbage on the prompts subject names no example
            if task.task_id in handled:
                continue
            distrust = self.vouch(task.task_id, task.index, task.epoch, task.attempt)
            if distrust is not None:  # not ours to act on: a forged letter, or one of a release already replaced
                log.warning("dead letter of task %s ignored: %s", task.task_id, distrust)
                continue
            handled.add(task.task_id)
            self.state.dead_lettered.append(task.task_id)
            log.warning("task %s was dead-lettered (%s); releasing it again", task.task_id, letter.reason)
            self.abandon(task.index, task.epoch, task.attempt, reissue=True, why="prompt dead-lettered")  # saves
            if self._forget is not None:  # a producer killed between its put and its publish left tensors behind
                try:
                    await self._forget([task.task_id])
                except Exception as e:  # the re-issue matters, the memory less: a shard down is no reason to stop
                    log.warning("could not free the stored tensors of task %s: %s", task.task_id, e)

    def _note_orphan(self, letter: DeadLetter) -> None:
        """A group dead-lettered as never put: judge its release after the grace (`reissue_orphans`)."""
        if NEVER_PUT not in letter.reason or letter.payload_bytes > len(letter.payload):
            return
        try:
            g = _GROUPS.decode(letter.payload)
        except SchemaError:
            return
        if g.task_id in self._orphans or g.task_id in self.state.orphans_handled:
            return
        due = letter.created_at + self.cfg.feeder.orphan_grace_s
        self._orphans[g.task_id] = (g.index, g.epoch, g.attempt, due)
        self.notify()

    def reissue_orphans(self) -> int:
        """Re-issue each release whose never-put group's grace ran out, unless a group of it came after all (held
        or trained), or the release is not the example's latest any more (re-issued, given up, or never ours: a
        forged group naming no release). Returns how many were re-issued."""
        now, count = time.time(), 0
        for task, (index, epoch, attempt, due) in list(self._orphans.items()):
            if now < due:
                continue
            del self._orphans[task]
            self.state.orphans_handled.append(task)  # judged once, also across a restart
            if self.vouch(task, index, epoch, attempt) is not None or (self._settled and self._settled(task)):
                self._save()
                continue
            log.warning("task %s: no group of it came within feeder.orphan_grace_s (%.0f s) of its group dead-lettered"
                        " as never put; releasing it again", task, self.cfg.feeder.orphan_grace_s)
            self.abandon(index, epoch, attempt, reissue=True, why="group never put")  # saves the state
            count += 1
        return count

    # -------------------------------------------------------------- persistence

    def _save(self) -> None:
        self._path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self._path, msgspec.json.encode(self.state))  # a crash leaves the old or the new state

    def _load_saved(self) -> FeederState | None:
        if not self._path.is_file():
            return None
        try:
            return msgspec.json.decode(self._path.read_bytes(), type=FeederState)
        except msgspec.DecodeError as e:
            raise RuntimeError(f"{self._path} is corrupt ({e}); delete it to restart the feeder from the "
                               "last checkpoint's position") from e

    def state_dict(self) -> dict:
        return json.loads(msgspec.json.encode(self.state))

    def load_state_dict(self, d: dict) -> None:
        """Take a checkpoint's position unless the live file is further along (it usually is)."""
        restored = msgspec.convert(d, FeederState)
        if restored.released > self.state.released:
            self.state = restored
            self._set_order()

    def _set_order(self) -> None:
        """This epoch's order of examples, and each example's position in it (what `vouch` asks)."""
        self._order = permutation(len(self._dataset), self.cfg.feeder.seed, self.state.epoch, self.cfg.feeder.shuffle)
        self._position = [0] * len(self._order)
        for pos, index in enumerate(self._order):
            self._position[index] = pos


def _example(index: int, epoch: int) -> str:
    return f"e{epoch}-i{index}"
