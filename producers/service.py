"""The rollout producer: pulls prompt tasks, rolls out GRPO groups, stores tensors, publishes trajectory groups.

    rlbus producer configs/quickstart.yaml bus.url=nats://127.0.0.1:4222 bus.creds_file=... ray.address=...

Any number of producers may run; they share one durable pull consumer on `prompts`, so each task goes to one of
them. The order of a task's life is the "nothing is lost" invariant (docs/architecture.md):

    pull task -> roll out n samples (in_progress() ticks meanwhile) -> put tensors in the TransferQueue
      -> publish TrajectoryGroup (waits for JetStream's ack; Nats-Msg-Id = group id) -> ack the task

A producer killed anywhere before the ack loses nothing: JetStream redelivers the task after ack_wait, and a
re-published group with the same id is dropped by de-duplication. New weights are loaded between generation chunks
(the engine serialises loads with generation), so no work is dropped when a version arrives.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
import threading
import time
import uuid

from rlbus.bus.client import Bus
from rlbus.bus.delivery import Delivery
from rlbus.bus.handover import Handover, producer_key
from rlbus.bus.loop import raise_if_failed, run, serve
from rlbus.bus.ray_cluster import ensure_ray
from rlbus.bus.transfer_queue import TransferQueue
from rlbus.bus.weight_store import WeightStore
from rlbus.producers.weight_sync import WeightSync, connect_deltas
from rlbus.common.logs import setup_logging
from rlbus.common.threads import apply_torch_threads, lower_priority, refresh_executor_threads
from rlbus.producers.agent_loops import AgentLoop
from rlbus.producers.agent_loops.base import StalenessWatch, failure_kind
from rlbus.producers.build import build_rollout
from rlbus.producers.engines import RolloutEngine
from rlbus.producers.inflight import WINDOW_S, InflightSizer
from rlbus.producers.teacher import Teacher
from rlbus.schemas import staleness
from rlbus.schemas.config import RunConfig
from rlbus.schemas.errors import EngineDead, WeightsChecksumMismatch, WeightsLost, WeightsMissing
from rlbus.schemas.staleness import generated_span
from rlbus.schemas.wire import (
    DeadLetter,
    ErrorRaised,
    ProducerHeartbeat,
    PromptTask,
    RoleStarted,
    RoleStopped,
    TrajectoryGroup,
    WeightsPublished,
    encode,
)

log = logging.getLogger("rlbus.producer")

#: Longest wait for the weights a task was released for before rolling out on what the engine holds.
WEIGHTS_WAIT_S = 30.0
#: How often the producer checks that its engine's process is alive.
ENGINE_CHECK_S = 1.0
#: How long a stopping producer waits for the groups it holds before it naks them back to the queue.
DRAIN_TIMEOUT_S = 30.0
#: Once the engine is dead, the orderly stop (tasks nak'ed, the bus closed, the engine shut down) gets this long; a
#: stop still running then (a wedged engine's shutdown, say) ends the process, so that the launcher starts another.
ENGINE_DEATH_EXIT_S = 60.0
#: Once the engine is found dead, how long the tasks it held get to end on the engine's own error (an agent's call
#: answered with the endpoint's 500, a rollout failing with it) before they are cancelled.
ENGINE_DEATH_GRACE_S = 3.0
#: Longest pause before a task whose tool, sandbox or judge failed is handed out again (2, 4, 8, ... seconds).
INFRA_RETRY_MAX_S = 30.0


def default_producer_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def task_error_message(task_id: str, error: BaseException) -> str:
    """An ErrorRaised message for a failed task: `task <id>: <error>`, the id once. Errors raised for a task often
    name it already (an agent loop's AgentFailed: "task <id>: the agent ... raised ..."); errors.jsonl read
    "task X: task X: ..." before."""
    text, prefix = str(error), f"task {task_id}: "
    return text if text.startswith(prefix) else prefix + text


def check_producer_id(producer_id: str) -> str:
    """A producer id is a subject token: no dots, spaces or wildcards."""
    bad = set(producer_id) & set(". *>\t\n")
    if not producer_id or bad:
        raise ValueError(f"producer id {producer_id!r} must be non-empty without {sorted(bad) or 'dots or spaces'}")
    return producer_id


class Producer:
    """One producer process: an engine, an agent loop, a bus connection and a TransferQueue handle."""

    cfg: RunConfig
    producer_id: str
    # Set by start(); None before (close() releases whatever start() got to).
    bus: Bus | None
    tq: TransferQueue | None
    weight_store: WeightStore | None
    weight_sync: WeightSync | None  # fetches announced versions into the engine (full, or an adapter on the base)
    engine: RolloutEngine | None
    agent_loop: AgentLoop | None
    teacher: Teacher | None  # algorithm.distill's teacher: scores each group's tokens before it is stored
    sizer: InflightSizer | None  # how many tasks it holds at once (set by start())
    trainer_version: int  # newest version the trainer announced
    staleness_bound: int | None  # the bound in force it announced with it (None: trainer.max_staleness)
    groups_done: int
    groups_abandoned: int
    tokens_generated: int  # generated tokens of the groups this producer published
    tokens_discarded: int  # generated tokens of groups it gave back as too stale (restarts: discarded())
    infra_failures: int  # tasks given back because a tool, sandbox or judge failed (never trained)
    env_failures: int  # tasks failed because the environment raised or gave bad output
    _inflight: dict[str, asyncio.Task]
    _named: bool  # its id was given (`rlbus up` gives p0, p1, ...): a successor under it takes over its tasks
    _handover: Handover | None  # the ack subjects of the tasks it holds, kept for that successor (bus/handover.py)
    _unsettled: dict[str, str]  # task id -> its delivery's ack subject, while the task is held
    _stopping: asyncio.Event
    _started_at: float
    _load_lock: asyncio.Lock
    _weights_changed: asyncio.Condition  # notified after every weight load (and rollback announcement)
    _loaded_checksum: str  # checksum of the weights the engine holds ("" = the model directory it was built from)
    _fatal: BaseException | None  # what ended the engine (EngineDead): run() raises it once its tasks are back

    def __init__(self, cfg: RunConfig, producer_id: str = ""):
        self.cfg = cfg
        self.producer_id = check_producer_id(producer_id or default_producer_id().replace(".", "_"))
        self._named = bool(producer_id)  # a given id: a restart under it takes over what this one held
        self._handover = None
        self._unsettled = {}
        self.bus = self.tq = self.weight_store = self.weight_sync = self.engine = self.agent_loop = self.sizer = None
        self.teacher = None
        self.trainer_version = 0
        self.staleness_bound = None
        self.groups_done = self.groups_abandoned = self.tokens_generated = self.tokens_discarded = 0
        self.infra_failures = self.env_failures = 0
        self._inflight = {}
        self._stopping = asyncio.Event()
        self._started_at = time.monotonic()
        self._load_lock = asyncio.Lock()
        self._loaded_checksum = ""
        self._weights_changed = asyncio.Condition()
        self._fatal = None

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        cfg = self.cfg
        self.bus = await Bus.connect(cfg.bus, cfg.name, name=f"producer-{self.producer_id}")
        await self.bus.await_streams()  # a producer's credential may not create them: the trainer does
        if self._named:  # tasks a killed predecessor under this id held go back now, not after bus.ack_wait_s
            cfg.run_dir.mkdir(parents=True, exist_ok=True)
            # The list is a file here and, under the id's key, in the KV bucket: a successor started under the same
            # id on another machine takes over from there.
            self._handover = Handover(cfg.run_dir / f"producer-{self.producer_id}-unacked.json", self.bus,
                                      self.bus.subjects.prompts, self.bus.subjects.prompts_consumer,
                                      key=producer_key(self.producer_id), role="producer")
            await self._handover.take_over()
        # Before Ray: under `rlbus up` the head may still be starting (ensure_ray waits).
        stack = build_rollout(cfg, instance=self.producer_id)
        self.engine, self.agent_loop = stack.engine, stack.agent_loop
        self.teacher = Teacher.from_config(cfg, stack.tokenizer)  # a ConfigError unless it shares the tokenizer
        self.sizer = InflightSizer(cfg.rollout.max_inflight_tasks, cfg.rollout.max_inflight_cap, self.agent_loop.meter)
        if cfg.rollout.partial_rollout:
            self.agent_loop.staleness = StalenessWatch(cfg.trainer, self.trainer_version)
        ensure_ray(cfg.ray)  # from the main thread: a head it starts lives as long as this process
        self.tq = TransferQueue.connect(cfg.name, cfg.ray)
        self.weight_store = WeightStore.connect(cfg.name, cfg.ray)
        self.weight_sync = WeightSync(self.engine, self.weight_store, stack.model_path, deltas=connect_deltas(cfg))
        latest = await self.bus.kv_get("latest", WeightsPublished)  # a late joiner starts from the newest weights
        if latest is not None:
            await self._load_version(latest)
        await self.bus.publish_event(RoleStarted(role="producer", role_id=self.producer_id, host=socket.gethostname(),
                                                 pid=os.getpid(), detail=f"version {self.engine.version}"))
        log.info("producer %s up (weights v%d)", self.producer_id, self.engine.version)

    async def run(self) -> None:
        """Main loop: until stopped, keep as many tasks rolling out as `self.sizer` allows (producers/inflight.py:
        `rollout.max_inflight_tasks`, or sized from the engine's idle time)."""
        background = [asyncio.create_task(self._heartbeats(), name="heartbeats"),
                      asyncio.create_task(self._watch_weights(), name="weights"),
                      asyncio.create_task(self._watch_engine(), name="engine")]
        subjects = self.bus.subjects
        sizer = self.sizer
        room = asyncio.Event()  # set when a task ends

        def ended(task_id: str) -> None:
            self._inflight.pop(task_id, None)
            self._unsettled.pop(task_id, None)
            sizer.held(len(self._inflight))
            room.set()

        try:
            while not self._stopping.is_set():
                raise_if_failed(*background)
                if len(self._inflight) >= sizer.update():
                    room.clear()
                    with contextlib.suppress(asyncio.TimeoutError):  # the limit may grow meanwhile
                        await asyncio.wait_for(room.wait(), WINDOW_S)
                    continue
                deliveries = await self.bus.fetch(subjects.prompts, subjects.prompts_consumer, PromptTask,
                                                  batch=1, timeout=1.0)
                if not deliveries:
                    continue
                delivery = deliveries[0]
                self._unsettled[delivery.data.task_id] = delivery.reply
                if self._handover is not None:
                    self._handover.save(self._unsettled.values())
                    await self._handover.share()
                if self._stopping.is_set():  # fetched while asked to stop: give it straight back
                    await delivery.nak()
                    self._unsettled.pop(delivery.data.task_id, None)
                    break
                task = asyncio.create_task(self._handle(delivery), name=delivery.data.task_id)
                self._inflight[delivery.data.task_id] = task
                sizer.held(len(self._inflight))
                task.add_done_callback(lambda t, tid=delivery.data.task_id: ended(tid))
            await self._drain()
            if self._fatal is not None:  # the engine is gone: exit non-zero (`rlbus up` restarts the producer)
                raise self._fatal
        finally:
            # On a failure (a dead engine, a failed weight watch) the held tasks go back now, not after ack_wait:
            # cancelled, each naks its delivery.
            held = list(self._inflight.values())
            for t in background + held:
                t.cancel()
            await asyncio.gather(*background, *held, return_exceptions=True)
            if self._handover is not None:  # every task finished or nak'ed: the list empties and the file goes
                self._handover.save(self._unsettled.values())
                await self._handover.share()

    def stop(self) -> None:
        """Ask the main loop to stop pulling; held tasks are finished (or nak'ed after DRAIN_TIMEOUT_S)."""
        self._stopping.set()
        if self.bus is not None:  # a shutdown with the server gone must not retry each call for bus.retry_s
            self.bus.stopping()

    def discarded(self) -> tuple[int, int]:
        """(generated tokens thrown away for staleness, samples restarted): groups given back, samples restarted
        under partial rollout, and the tokens of turns interrupted in flight where the engine counts them."""
        watch = self.agent_loop.staleness if self.agent_loop is not None else None
        tokens = self.tokens_discarded + (watch.tokens_discarded if watch else 0)
        tokens += getattr(self.engine, "tokens_interrupted", 0)
        return tokens, watch.samples_restarted if watch else 0

    async def close(self, reason: str = "", clean: bool = True) -> None:
        tokens, restarted = self.discarded()
        log.info("producer %s: %d groups published (%d generated tokens); discarded for staleness: %d generated "
                 "tokens (%d groups given back, %d samples restarted)", self.producer_id, self.groups_done,
                 self.tokens_generated, tokens, self.groups_abandoned, restarted)
        if self.agent_loop is not None and self.agent_loop.spares_cancelled:
            log.info("producer %s: %d redundant episode(s) cancelled once their group had its n (%d generated tokens)",
                     self.producer_id, self.agent_loop.spares_cancelled, self.agent_loop.spare_tokens_discarded)
        if self.bus is not None:
            with contextlib.suppress(Exception):  # best effort: the bus may be the thing that failed
                await self.bus.publish_event(RoleStopped(role="producer", role_id=self.producer_id,
                                                         reason=reason, clean=clean))
            await self.bus.close()
        if self.agent_loop is not None:
            await self.agent_loop.close()
        if self.engine is not None:
            await self.engine.close()
        if self.teacher is not None:
            self.teacher.close()

    # ---------------------------------------------------------------- one task

    async def _handle(self, delivery: Delivery[PromptTask]) -> None:
        task: PromptTask = delivery.data
        cfg = self.cfg
        max_deliver = cfg.bus.max_deliver
        ticker = asyncio.create_task(self._keep_alive(delivery))
        unpublished: list[str] = []  # keys stored but not yet named by a group on the bus: freed if we fail
        try:
            await self._await_weights(task.released_version)
            started = time.monotonic()
            log.info("task %s: rolling out (delivery %d)", task.task_id, delivery.num_delivered)
            trajectories = await self.agent_loop.rollout_group(task, task.n or cfg.rollout.n)
            oldest = staleness.oldest(generated_span(t.versions, t.response_mask)[0] for t in trajectories)
            if staleness.too_stale(self.trainer_version, oldest, cfg.trainer, self.staleness_bound):
                # The trainer would drop this group; give the task back so it is redone with fresh weights (under
                # partial rollout only once a sample is out of restarts).
                self.groups_abandoned += 1
                dropped = sum(sum(t.response_mask) for t in trajectories)
                self.tokens_discarded += dropped
                log.info("task %s abandoned: generated at v%d, trainer at v%d (%d generated tokens)", task.task_id,
                         oldest, self.trainer_version, dropped)
                await delivery.nak()
                return
            # Keys are this rollout's own: if an earlier delivery's group was published before its producer died,
            # that group's metadata must keep pointing at its own tensors, not at this redo's. The delivery number
            # alone does not make them so: a nats-server killed before it persisted a delivery hands the task out
            # again as delivery 1, and two producers then put (and the surplus one deleted) the same keys.
            prefix = f"{task.task_id}/d{delivery.num_delivered}-{self.producer_id}-{uuid.uuid4().hex[:8]}"
            items = {f"{prefix}/{i}": t.tensors() for i, t in enumerate(trajectories)}
            if self.teacher is not None:  # on-policy distillation: the teacher's scores travel with the tokens
                for tensors, scores in zip(items.values(), await self.teacher.score(trajectories)):
                    tensors["teacher_log_probs"] = scores
            unpublished = list(items)
            await self.tq.put_many(items)
            group = TrajectoryGroup(
                group_id=task.task_id, task_id=task.task_id, producer_id=self.producer_id,
                samples=[t.sample_meta(key) for key, t in zip(items, trajectories)],
                data_source=task.data_source, index=task.index, epoch=task.epoch, attempt=task.attempt,
            )
            ack = await self.bus.publish(self.bus.subjects.traj, group, msg_id=group.group_id)
            unpublished = []
            if ack.duplicate:  # an earlier delivery's group is already on the bus: this redo is surplus
                await self.tq.delete(list(items))
            # (None: a retried publish whose kept copy may be this one's own first attempt; its tensors stay. If they
            # are surplus after all, the batcher frees them with the task: it deletes every key under the task id.)
            await delivery.ack()
            self.groups_done += 1
            generated = sum(int(sum(t.response_mask)) for t in trajectories)
            self.tokens_generated += generated
            log.info("task %s: done in %.2fs (%d generated tokens)", task.task_id, time.monotonic() - started,
                     generated)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await delivery.nak()
            await self._free(unpublished)
            raise
        except EngineDead as e:
            # Not the task's fault: it goes straight back for another producer, and this one stops (the engine
            # cannot come back under it; a restarted producer builds a new one).
            log.error("task %s: %s; giving the task back and stopping", task.task_id, e)
            with contextlib.suppress(Exception):
                await delivery.nak()
            await self._free(unpublished)
            await self._engine_died(e)
        except Exception as e:
            failure = failure_kind(e)
            if failure == "infrastructure":  # not the task's fault: no traceback, a longer pause before the retry
                self.infra_failures += 1
                log.warning("task %s: %s failure, giving it back: %s", task.task_id, failure, e)
                delay = min(2.0 ** delivery.num_delivered, INFRA_RETRY_MAX_S)
            else:
                self.env_failures += 1
                log.exception("task %s failed", task.task_id)
                delay = 1.0
            await self._free(unpublished)
            await self.bus.publish_event(ErrorRaised(role="producer", role_id=self.producer_id,
                                                     error=type(e).__name__, failure=failure,
                                                     message=task_error_message(task.task_id, e)))
            if delivery.num_delivered >= max_deliver:
                await delivery.dead_letter(f"producer {self.producer_id}: {failure} failure: {type(e).__name__}: {e}")
            else:
                await delivery.nak(delay=delay)
        finally:
            ticker.cancel()

    async def _free(self, keys: list[str]) -> None:
        """Best effort: drop tensors no group names (a SIGKILL here leaves them to the trainer, which frees every key
        of a task once the task is done: transfer_queue.py, "Owners")."""
        if keys:
            try:
                await self.tq.delete(keys)
            except Exception as e:
                log.warning("could not free %d unpublished key(s) (%s); the trainer frees them with their task",
                            len(keys), e)

    async def _await_weights(self, released_version: int) -> None:
        """Do not start a task on weights older than those it was released for: the announcement of that version
        may still be loading, and a rollout begun now would be stale on arrival. A trainer that rolled back (it
        restarted from an older checkpoint) announces a lower version, which lowers the bar.

        A task released for a version this producer has not heard of means its weights watch lags (a bus restart
        stalls it for a while): it reads the newest announcement from the KV bucket instead of rolling out on old
        weights, which the trainer would only drop."""
        if released_version > self.trainer_version:
            latest = await self.bus.kv_get("latest", WeightsPublished)
            if latest is not None and latest.version != self.trainer_version:
                log.info("task released at v%d, newer than v%d this producer heard of: catching up from the KV bucket",
                         released_version, self.trainer_version)
                await self._load_version(latest)
        async with self._weights_changed:
            try:
                await asyncio.wait_for(self._weights_changed.wait_for(
                    lambda: self.engine.version >= min(released_version, self.trainer_version)), WEIGHTS_WAIT_S)
            except asyncio.TimeoutError:
                log.warning("weights v%d not loaded after %.0fs; rolling out on v%d", released_version,
                            WEIGHTS_WAIT_S, self.engine.version)

    async def _keep_alive(self, delivery: Delivery[PromptTask]) -> None:
        """Tell JetStream the task is still being worked on, so ack_wait does not redeliver it meanwhile."""
        while True:
            await asyncio.sleep(self.cfg.rollout.in_progress_interval_s)
            await delivery.in_progress()

    async def _drain(self) -> None:
        if not self._inflight:
            return
        log.info("draining %d task(s)", len(self._inflight))
        tasks = list(self._inflight.values())
        done, pending = await asyncio.wait(tasks, timeout=DRAIN_TIMEOUT_S)
        for t in pending:  # cancelled tasks nak themselves
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    # ---------------------------------------------------------------- weights and heartbeats

    async def _watch_weights(self) -> None:
        async for published in self.bus.watch(self.bus.subjects.weights, WeightsPublished, deliver="last"):
            await self._load_version(published)

    async def _load_version(self, published: WeightsPublished) -> None:
        # The newest announcement wins, even when it is older than what we hold: a trainer that restarted from a
        # checkpoint republishes that checkpoint's version, and weights of the lost steps must not roll out again.
        # An announcement the weight store cannot back (forged, or inconsistent) is refused: the producer keeps
        # the weights it has and the version it believes in, and the announcement goes to the dead letters.
        try:
            await self._load(published)
            self.trainer_version = published.version
            self.staleness_bound = published.max_staleness if published.max_staleness >= 0 else None
            if self.agent_loop.staleness is not None:  # samples the new version leaves too stale restart now
                self.agent_loop.staleness.bound = self.staleness_bound
                self.agent_loop.staleness.advance(published.version)
        except (WeightsMissing, WeightsChecksumMismatch) as e:
            await self._refuse(published, e)
        finally:
            async with self._weights_changed:  # tasks waiting for a version re-check (also after a rollback)
                self._weights_changed.notify_all()

    async def _refuse(self, published: WeightsPublished, error: Exception) -> None:
        if isinstance(error, WeightsLost):  # died with its trainer; the restarted one announces again
            log.info("weights v%d are gone with the trainer that made them (%s); waiting for a newer announcement",
                     published.version, error)
            return
        held = await self.weight_store.versions()
        if isinstance(error, WeightsMissing) and held and published.version < max(held):
            # Merely old: evicted since it was announced (this producer fell behind); a newer one follows.
            log.info("weights v%d already evicted (store holds %s); waiting for a newer announcement",
                     published.version, held)
            return
        reason = f"producer {self.producer_id} refused weights announcement v{published.version}: " \
                 f"{type(error).__name__}: {error}"
        log.warning("%s; keeping v%d", reason, self.engine.version)
        await self.bus.publish(self.bus.subjects.dead_letter, DeadLetter(
            reason=reason, original_subject=self.bus.subjects.weights, payload=encode(published),
            consumer=f"producer:{self.producer_id}"))
        await self.bus.publish_event(ErrorRaised(role="producer", role_id=self.producer_id,
                                                 error=type(error).__name__, message=reason, fatal=False))

    async def _load(self, published: WeightsPublished) -> None:
        async with self._load_lock:
            if (published.version, published.weights_checksum) == (self.engine.version, self._loaded_checksum):
                return
            if published.version == self.engine.version == 0 and not self._loaded_checksum \
                    and not published.full_checksum and not published.sft_steps:
                # Version 0 is the model the engine was built from: nothing to load. Not under delta sync (load
                # it: the next delta applies to it), nor when a supervised phase (trainer.sft) trained it.
                self._loaded_checksum = published.weights_checksum  # the base model the engine was built from
                return
            # Raises WeightsChecksumMismatch unless the store's bytes are the ones announced.
            fallback = await self.weight_sync.load(published)  # waits for the chunk in flight
            self._loaded_checksum = published.weights_checksum
            if fallback is not None:  # a delta this producer could not apply: it loaded the full copy
                message = f"producer {self.producer_id}: weights v{published.version} loaded as a full copy, not " \
                          f"as the delta from v{published.base_version}: {fallback}"
                log.warning("%s", message)
                await self.bus.publish_event(ErrorRaised(role="producer", role_id=self.producer_id,
                                                         error="WeightsDeltaFallback", message=message, fatal=False))
            log.info("loaded weights v%d", published.version)

    async def _watch_engine(self) -> None:
        """Notice a dead engine (vLLM's engine core killed) within a second, also while no task is rolling out or
        while every task waits on something the dead engine will never finish (a weight load, say): the held tasks
        are cancelled (each naks its delivery) and the producer stops, raising EngineDead from run()."""
        while self.engine.alive:
            await asyncio.sleep(ENGINE_CHECK_S)
        error = EngineDead(f"producer {self.producer_id}: the rollout engine's process is gone")
        log.error("%s; giving %d task(s) back and stopping", error, len(self._inflight))
        await self._engine_died(error)
        held = list(self._inflight.values())
        if held:  # the calls in flight hear of the death from the engine itself: their agents see its error
            await asyncio.wait(held, timeout=ENGINE_DEATH_GRACE_S)
        for t in held:
            t.cancel()

    async def _engine_died(self, error: EngineDead) -> None:
        """Record the first sign of a dead engine (run() raises it once the held tasks are back), say so once on the
        bus, and stop pulling tasks: the engine cannot come back under this producer; a restarted one builds anew."""
        if self._fatal is None:
            self._fatal = error
            watchdog = threading.Timer(ENGINE_DEATH_EXIT_S, _exit_stuck, args=(self.producer_id,))
            watchdog.daemon = True
            watchdog.start()
            with contextlib.suppress(Exception):  # best effort: stopping must not wait on the event
                await self.bus.publish_event(ErrorRaised(role="producer", role_id=self.producer_id,
                                                         error=type(error).__name__, message=str(error), fatal=True))
        self.stop()

    async def _heartbeats(self) -> None:
        while True:
            minutes = max((time.monotonic() - self._started_at) / 60.0, 1e-9)
            # One subject per producer, so `rlbus status` reads each one's last heartbeat (last-per-subject).
            await self.bus.publish(self.bus.subjects.event(f"heartbeat.{self.producer_id}"), ProducerHeartbeat(
                producer_id=self.producer_id, version=self.engine.version, host=socket.gethostname(),
                pid=os.getpid(), status="draining" if self._stopping.is_set() else "running",
                groups_done=self.groups_done, tokens_generated=self.tokens_generated,
                tokens_discarded=self.discarded()[0], samples_restarted=self.discarded()[1],
                groups_per_min=self.groups_done / minutes, inflight=len(self._inflight),
                inflight_limit=self.sizer.limit, engine_idle=round(self.sizer.idle_share(), 3),
                infra_failures=self.infra_failures, env_failures=self.env_failures,
                tool_retries=getattr(getattr(self.agent_loop, "runner", None), "infra_retries", 0),
                spares_cancelled=self.agent_loop.spares_cancelled))
            await asyncio.sleep(self.cfg.rollout.heartbeat_interval_s)



def _exit_stuck(producer_id: str) -> None:
    """The engine died ENGINE_DEATH_EXIT_S ago and the producer has not stopped: end it from this thread (what it
    still holds comes back after ack_wait, or sooner from the handover file its successor reads)."""
    log.error("producer %s: still stopping %.0fs after its engine died; exiting now", producer_id,
              ENGINE_DEATH_EXIT_S)
    _exit_now(1)


async def run_producer(cfg: RunConfig, producer_id: str = "") -> None:
    refresh_executor_threads()  # generation runs in its threads: each re-sizes its torch pool (common/threads.py)
    await serve(Producer(cfg, producer_id))


def main(cfg: RunConfig, producer_id: str = "") -> int:
    setup_logging(cfg.logging.level)
    # Before any torch work: the producers and the trainer's ranks share the machine's CPUs (common/threads.py).
    role = f"producer {producer_id or '(unnamed)'}"
    apply_torch_threads(cfg.rollout.torch_threads, cfg.trainer.num_ranks + cfg.rollout.num_producers, role=role)
    lower_priority(cfg.rollout.nice, role=role)
    try:
        run(run_producer(cfg, producer_id))
    except EngineDead as e:
        # The tasks are back and the bus is closed (serve() closed the role): end here, without the interpreter's
        # own finalization, which a dead vLLM engine's leftovers (its sockets and threads) can hold up.
        log.error("%s; exiting for a restart", e)
        _exit_now(1)
    return 0


def _exit_now(code: int) -> None:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
