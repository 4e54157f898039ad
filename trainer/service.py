"""The trainer's controller (rank 0) and the trainer's entry points: consumes groups, trains, publishes weights,
checkpoints, and runs the prompt feeder.

    rlbus trainer configs/quickstart.yaml bus.url=... bus.creds_file=... ray.address=...
    rlbus trainer configs/quickstart.yaml trainer.num_ranks=2          # two local FSDP ranks
    torchrun --nproc-per-node 2 -m rlbus.cli trainer CONFIG            # multi-node

Rank 0 is the controller: it alone talks to NATS (batcher, feeder, events) and holds only metadata. Every step it
broadcasts a plan -- which TransferQueue keys each rank fetches -- and every rank fetches its own tensors
(trainer/worker.py), so no tensor passes through the controller. The train loop:

    while step < total_steps:
        groups = await batcher.next_batch(version)       # whole groups, staleness policy applied
        result = execute(plan(groups))                   # all ranks: fetch, train_step, [gather weights], [checkpoint]
        step += 1; version = step
        publish weights; log metrics; if checkpointed: ack the groups of durable steps
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import shutil
import signal
import socket
import time
import uuid
from typing import Any

import msgspec
import torch
import yaml

from rlbus.bus.client import Bus
from rlbus.bus.loop import raise_if_failed, run
from rlbus.bus.ray_cluster import ensure_ray
from rlbus.trainer.publish import WeightPublisher
from rlbus.common.envs import load_tasks
from rlbus.common.logs import setup_logging
from rlbus.common.model.ensure import ensure_model
from rlbus.common.threads import apply_torch_threads, refresh_executor_threads
from rlbus.consumers.batcher import Batcher
from rlbus.consumers.recorder import Recorder
from rlbus.schemas import staleness
from rlbus.schemas.config import RunConfig
from rlbus.schemas.config_io import to_yaml
from rlbus.schemas.errors import BusError
from rlbus.schemas.staleness import LagSizer
from rlbus.schemas.wire import (
    ErrorRaised,
    EvalCompleted,
    GuardAction,
    RoleStarted,
    RoleStopped,
    StepCompleted,
    TrajectoryGroup,
    WeightsPublished,
)
from rlbus.trainer.checkpoint import discard_after, list_checkpoints
from rlbus.trainer.dist import spawn_local
from rlbus.trainer.feeder import Feeder, parse_task_id
from rlbus.trainer.guard import StabilityGuard, Verdict, rollback_checkpoint
from rlbus.trainer.memory import peak_rss_bytes
from rlbus.trainer.metrics import MetricsLog
from rlbus.trainer.sft import SFT_CHECKPOINTS
from rlbus.trainer.sft_phase import run_phase
from rlbus.trainer.worker import StepPlan, StepResult, StepWorker, plan_shards

log = logging.getLogger("rlbus.trainer")
#: In the run directory: the ack subjects of the groups the trainer holds unacked, for a restarted trainer to nak.
UNACKED_FILE = "trainer-unacked.json"


class TrainerService:
    """Rank 0: the controller. Owns the bus, the feeder, the batcher and the run directory."""

    cfg: RunConfig
    worker: StepWorker
    step: int
    version: int
    # Set by start(); None before (close() releases whatever start() got to).
    bus: Bus | None
    weight_store: WeightPublisher | None  # puts versions in the run's weight store (full, adapter or delta)
    feeder: Feeder | None
    batcher: Batcher | None
    metrics: MetricsLog | None
    recorder: Recorder | None
    _stopping: asyncio.Event
    _feeder_task: asyncio.Task | None
    _eval_task: asyncio.Task | None  # writes the evaluator's EvalCompleted events into the metrics (eval.interval)
    _evals: dict[int, asyncio.Event]  # version -> set once its EvalCompleted is written
    _incarnation: str  # this trainer process, in its weights announcements' message ids
    guard: StabilityGuard  # the stability guard: judges each step's metrics, tightens, rolls back (trainer/guard.py)
    _step_groups: dict[int, list[str]]  # step -> its group ids, for the steps a rollback may drop
    sft_steps: int  # supervised steps (trainer.sft) trained into the weights before RL; 0 without a phase

    def __init__(self, cfg: RunConfig, worker: StepWorker):
        self.cfg, self.worker = cfg, worker
        self.step = self.version = 0
        self.bus = self.weight_store = self.feeder = self.batcher = self.metrics = self.recorder = None
        self._stopping = asyncio.Event()
        self._feeder_task = self._eval_task = None
        self._evals = {}
        self._incarnation = uuid.uuid4().hex[:12]
        self.guard = StabilityGuard(cfg.guard, cfg.trainer)
        self.lag = LagSizer(cfg.trainer.max_staleness, cfg.trainer.max_staleness_for_latency,
                            kl_budget=cfg.guard.max_mismatch_kl)
        self._step_groups = {}

    async def start(self) -> None:
        cfg = self.cfg
        run_dir = cfg.run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(to_yaml(cfg))
        self.bus = await Bus.connect(cfg.bus, cfg.name, name="trainer")
        await self.bus.ensure_streams(traj_max_ack_pending=cfg.traj_max_ack_pending)
        self.weight_store = WeightPublisher(cfg)
        extra = self.worker.restored
        self.step = int(extra.get("step", 0))
        self.version = int(extra.get("version", 0))
        self.sft_steps = int(extra.get("sft_steps", 0))
        if "guard" in extra:
            self.guard.load_state_dict(extra["guard"])
        self.recorder = Recorder(run_dir, cfg.logging.record, resume_step=self.step)
        await self.recorder.start(self.bus)
        dataset = load_tasks(cfg, self.worker.tokenizer)  # drops prompts over data.max_prompt_tokens
        # Admission and the batcher use the staleness bound in force for the next step (the lag the measured waits
        # need, or what the guard lowers it to).
        bound = lambda: self.staleness_bound(self.step + 1)  # noqa: E731
        self.feeder = Feeder(cfg, dataset, self.bus, lambda: self.version,
                             on_release=self.recorder.prompt,
                             forget=lambda task_ids: self.worker.tq.delete([], owners=task_ids), max_staleness=bound,
                             settled=lambda task_id: self.batcher.has_group(task_id))
        if "feeder" in extra:
            self.feeder.load_state_dict(extra["feeder"])
        self.batcher = Batcher(cfg, self.bus, self.worker.tq, self.feeder, trained=set(extra.get("trained", ())),
                               max_staleness=bound, handover=run_dir / UNACKED_FILE)
        self.metrics = MetricsLog(run_dir, tensorboard=cfg.logging.tensorboard, resume_step=self.step,
                                  logging=cfg.logging, run_name=cfg.name, config=yaml.safe_load(to_yaml(cfg)))
        if cfg.eval.interval > 0:  # before the first weights go out: the evaluator scores version 0 at once
            self._eval_task = asyncio.create_task(self._collect_evals(), name="evals")
        await self.bus.publish_event(RoleStarted(role="trainer", role_id=f"trainer-{os.getpid()}",
                                                 host=socket.gethostname(), pid=os.getpid(),
                                                 detail=f"step {self.step} version {self.version}"))
        if self.worker.sft is not None and not await self._sft_phase():
            return  # asked to stop during the supervised phase (checkpointed: a restart goes on from there)
        # Producers (and late joiners via the KV bucket) need the weights of the version we resume at.
        result = await self._execute(StepPlan(step=self.step, shards=None, publish=True, checkpoint=None))
        await self._publish_weights(result.state_dict)
        await self.batcher.take_over()  # what a killed predecessor held comes back now, not after ack_wait
        self.batcher.start()
        lost = await self._groups_of_lost_steps()
        if lost:
            log.info("resuming at step %d: waiting for %d group(s) of the lost steps to be redelivered", self.step,
                     len(lost))
            missing = await self.batcher.await_redelivery(lost, timeout=2 * cfg.bus.ack_wait_s + 5)
            if missing:
                log.warning("%d group(s) of lost steps did not come back: %s", len(missing), missing[:5])
        if cfg.trainer.total_steps > 0:  # 0: a supervised run (trainer.sft), no prompt to release
            self._feeder_task = asyncio.create_task(self._feed(), name="feeder")
        log.info("trainer up at step %d, version %d", self.step, self.version)

    async def _sft_phase(self) -> bool:
        """trainer.sft's phase (trainer/sft_phase.py), then the run's step-0 checkpoint holding its result; whether
        it finished."""
        if not await run_phase(self.cfg, self.worker.sft, self._execute, self._stopping):
            return False
        self.sft_steps = self.worker.sft.num_steps
        await self._checkpoint()
        shutil.rmtree(self.cfg.run_dir / "checkpoints" / SFT_CHECKPOINTS, ignore_errors=True)  # step 0 has it all
        return True

    def stop(self) -> None:
        self._stopping.set()
        if self.bus is not None:  # a shutdown with the server gone must not retry each call for bus.retry_s
            self.bus.stopping()

    async def _feed(self) -> None:
        await asyncio.gather(self.feeder.run(), self.feeder.move_exhausted(), self.feeder.reissue_dead_letters())

    async def _groups_of_lost_steps(self) -> list[str]:
        """Group ids of steps a previous trainer completed after its last checkpoint (so they were never acked).

        Steps the stability guard rolled back (a GuardAction with rollback_to, published after them) are not lost
        but dropped: their groups were acked and their prompts re-issued. The steps up to ours are remembered with
        their groups, for a rollback of this process to drop them.
        """
        events = await self.bus.snapshot(self.bus.subjects.event("step"), StepCompleted, deliver="all")
        actions = await self.bus.snapshot(self.bus.subjects.event("guard"), GuardAction, deliver="all")
        cuts = [(a.created_at, a.rollback_to) for a in actions if a.rollback_to >= 0]
        last: dict[int, StepCompleted] = {}
        for e in events:
            if not any(e.created_at <= at and e.step > to for at, to in cuts):
                last[e.step] = e
        self._step_groups = {step: list(e.group_ids) for step, e in last.items() if step <= self.step}
        return [gid for step in sorted(last) if step > self.step for gid in last[step].group_ids]

    async def run(self) -> None:
        total = self.cfg.trainer.total_steps
        last_ckpt = self.step
        while self.step < total and not self._stopping.is_set():
            raise_if_failed(self._feeder_task)
            before = self.step
            row = await self._train_one_step()
            if row is None:  # stopped while waiting for data
                break
            if self.step <= before:  # the stability guard rolled back to a checkpoint (saved again there)
                last_ckpt = self.step
                continue
            if self.step % self.cfg.trainer.checkpoint_interval == 0 or self.step == total:
                await self._checkpoint()
                last_ckpt = self.step
        if self.step > last_ckpt:  # stopped early: leave the run resumable from here
            await self._checkpoint()
        if self._eval_task is not None and self.step >= total and not self._stopping.is_set():
            await self._await_eval(self.version, self.cfg.eval.final_timeout_s)

    async def _collect_evals(self) -> None:
        """Each EvalCompleted becomes a row of its own in metrics.jsonl (step, version, eval/*) and in TensorBoard."""
        async for e in self.bus.watch(self.bus.subjects.event("eval"), EvalCompleted, deliver="new"):
            row: dict[str, Any] = {"step": e.step, "version": e.version, "eval/num_prompts": e.num_prompts}
            row.update(e.metrics)
            self.metrics.append(row)
            log.info("eval at step %d (v%d): accuracy %.3f", e.step, e.version, e.metrics.get("eval/accuracy", -1))
            self._evals.setdefault(e.version, asyncio.Event()).set()

    async def _await_eval(self, version: int, timeout: float) -> None:
        """Wait (bounded) for the evaluator's score of `version`: training is over, the run's last eval is not."""
        done = self._evals.setdefault(version, asyncio.Event())
        if done.is_set():
            return
        log.info("waiting up to %.0fs for the evaluation of v%d", timeout, version)
        stopper = asyncio.create_task(self._stopping.wait())
        waiter = asyncio.create_task(done.wait())
        finished, _ = await asyncio.wait({stopper, waiter, self._eval_task}, timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        waiter.cancel()
        if self._eval_task in finished:
            raise_if_failed(self._eval_task)
        if not done.is_set():
            log.warning("no evaluation of v%d arrived within %.0fs", version, timeout)

    async def _train_one_step(self) -> dict | None:
        t_wait = time.perf_counter()
        groups = await self._next_batch(self.cfg.trainer.groups_per_step)
        if groups is None:
            return None
        wait_s = time.perf_counter() - t_wait
        for g in groups:  # a group is done when its slowest episode is: that sample's wait is the group's
            self.lag.group(max((m.tool_time_s + m.reward_time_s for m in g.samples), default=0.0))
        t_step = time.perf_counter()
        while True:
            publish = (self.step + 1) % self.cfg.trainer.weight_sync_interval == 0
            plan = StepPlan(step=self.step + 1, shards=plan_shards(groups, self.worker.world),
                            publish=publish, checkpoint=None, lr_scale=self.guard.lr_scale(self.step + 1))
            result = await self._execute(plan)
            if not result.missing:
                break
            owner = {key: g.group_id for g in groups for key in g.keys}
            lost = {owner[k] for k in result.missing}
            log.warning("payload missing for %d group(s); re-issuing their prompts (unless never put)", len(lost))
            await self.batcher.payload_missing(sorted(lost))
            groups = [g for g in groups if g.group_id not in lost]
            more = await self._next_batch(len(lost))
            if more is None:
                return None
            groups += more
        # Staleness is measured against the version the groups were trained at (before this step's update).
        row = self._metrics_row(groups, result, wait_s)
        if self.cfg.guard.enabled:  # the setting this step trained under (`rlbus replay` applies the same)
            row.update(self.guard.setting_metrics(self.step + 1))
        self.step += 1
        self.version = self.step
        self.batcher.trained_in(self.step, [g.group_id for g in groups])
        self._step_groups[self.step] = [g.group_id for g in groups]
        if publish:
            t0 = time.perf_counter()
            msg = await self._publish_weights(result.state_dict)
            row["time/publish_weights"] = time.perf_counter() - t0 + result.timings.get("time/gather_weights", 0.0)
            row["weights/num_bytes"] = float(msg.num_bytes)  # what each producer fetches for this version
            if self.weight_store.last_delta_density is not None:
                row["weights/delta_density"] = self.weight_store.last_delta_density
        # The engine reports its train step's peak over ranks; this process also gathered and published weights.
        row["perf/peak_rss_gb"] = max(row.get("perf/peak_rss_gb", 0.0), peak_rss_bytes() / 1024**3)
        row["step"], row["version"] = self.step, self.version
        row["time/step"] = time.perf_counter() - t_step
        self.lag.step(row["time/step"], row.get("mismatch/kl_k3", math.nan))
        row["staleness/bound"] = float(self.staleness_bound(self.step + 1))
        row["perf/tokens_per_s"] = row.pop("_tokens") / max(row["time/step"], 1e-9)
        verdict = self.guard.observe(self.step, row)
        if self.guard.tightened(self.step + 1):  # the lag ramps up again from the tightened bound, not from before
            self.lag.hold(self.guard.effective_max_staleness(self.step + 1))
        row.update(self._verdict_metrics(verdict))
        record = self.recorder.step(step=self.step, version=self.version, groups=groups, shards=plan.shards,
                                    metrics=row)
        if record is not None:
            row["record/bytes"] = record.payload_bytes
        self.metrics.append(row)
        await self.bus.publish_event(StepCompleted(step=self.step, version=self.version,
                                                   group_ids=[g.group_id for g in groups],
                                                   metrics={k: float(v) for k, v in row.items()
                                                            if isinstance(v, (int, float))}))
        self.feeder.notify()
        skipped = int(row.get("actor/skipped_updates", 0))
        if skipped:  # the engine refused a non-finite gradient: the weights are safe, but someone should look
            message = (f"step {self.step}: {skipped} optimizer update(s) skipped, the loss or gradient was not finite "
                       f"(pg_loss {row.get('actor/pg_loss')}, grad_norm {row.get('actor/grad_norm')}); "
                       f"`rlbus replay {self.cfg.run_dir} --from-step {self.step}` reproduces it")
            log.error(message)
            await self.bus.publish_event(ErrorRaised(role="trainer", role_id=f"trainer-{os.getpid()}",
                                                     error="NonFiniteUpdate", message=message, fatal=False))
        log.info("step %d/%d reward %.3f staleness %.2f pg_loss %.4f", self.step, self.cfg.trainer.total_steps,
                 row["reward/mean"], row["staleness/mean"], row.get("actor/pg_loss", float("nan")))
        if verdict.acted:
            await self._guard_acted(verdict)
        return row

    # -------------------------------------------------------------- the stability guard

    @staticmethod
    def _verdict_metrics(verdict: Verdict) -> dict[str, float]:
        """guard/* keys of the step a rule fired on: each rule's value, and each action taken."""
        out: dict[str, float] = {}
        if verdict.acted:
            out["guard/fired"] = float(len(verdict.fired))
            out.update({f"guard/{f.rule}": f.value for f in verdict.fired})
            out.update({f"guard/action_{a}": 1.0 for a in verdict.actions})
        return out

    async def _guard_acted(self, verdict: Verdict) -> None:
        """Carry out a verdict: roll back if asked (and possible), then announce what was done (events.guard)."""
        rollback_to = -1
        note = ""
        actions = list(verdict.actions)
        if "rollback" in actions:
            to = await self._roll_back(verdict)
            if to is None:  # the guard tightened already (a rollback goes on tightened): warn too
                actions = [a for a in ("warn", "tighten") if a in actions or a == "warn"]
                note = (f" (no checkpoint before step {verdict.rollback_before} is kept to roll back to: warned and "
                        "tightened instead)")
            else:
                rollback_to = to
                note = f" (rolled back from step {verdict.step} to the checkpoint of step {to})"
        nxt = self.step + 1
        message = f"stability guard at step {verdict.step}: {verdict.message()}{note}"
        (log.warning if "warn" in actions else log.info)("%s", message)
        tightened = self.guard.tightened(nxt)
        bound = self.guard.effective_max_staleness(nxt)
        await self.bus.publish_event(GuardAction(
            step=verdict.step, rules=[f.rule for f in verdict.fired], actions=actions, message=message,
            values={f.rule: f.value for f in verdict.fired}, thresholds={f.rule: f.threshold for f in verdict.fired},
            lr_scale=self.guard.lr_scale(nxt), max_staleness=bound if tightened else -1,
            tightened_until=self.guard.state.tightened_until if tightened else 0, rollback_to=rollback_to))
        self.feeder.notify()  # the staleness bound may have moved

    async def _roll_back(self, verdict: Verdict) -> int | None:
        """Go back to the newest checkpoint before the trouble: every rank restores it, its version is published
        again, the dropped steps' prompts are re-issued, their records and metrics rows set aside, and the
        checkpoint is saved again with the guard's new state (so a crash after this resumes tightened). Returns the
        step gone back to, or None when no such checkpoint is kept."""
        root = self.cfg.run_dir / "checkpoints"
        kept = [int(p.name.split("_", 1)[1]) for p in list_checkpoints(root) if (p / ".metadata").is_file()]
        to = rollback_checkpoint(kept, verdict.rollback_before)
        if to is None:
            return None
        dropped = [s for s in range(to + 1, self.step + 1)]
        groups = [(gid, *parse_task_id(gid)) for s in dropped for gid in self._step_groups.get(s, [])]
        log.warning("stability guard: rolling back from step %d to the checkpoint of step %d; %d step(s) and their "
                    "%d group(s) dropped, their prompts re-issued", self.step, to, len(dropped), len(groups))
        result = await self._execute(StepPlan(step=to, shards=None, publish=True, checkpoint=None, restore=to))
        discard_after(root, to)  # a restart or a replay never resumes from a dropped step
        self.step = self.version = to
        for s in dropped:
            self._step_groups.pop(s, None)
        self.recorder.cut_back(to)
        self.metrics.discard_after(to)
        self.guard.rolled_back(to)
        await self.batcher.roll_back(groups)
        await self._publish_weights(result.state_dict)
        await self._checkpoint()
        return to

    async def _next_batch(self, need: int) -> list[TrajectoryGroup] | None:
        """Wait for `need` groups, or None if asked to stop meanwhile."""
        getter = asyncio.create_task(self.batcher.next_batch(self.version, need))
        stopper = asyncio.create_task(self._stopping.wait())
        done, _ = await asyncio.wait({getter, stopper}, return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        if getter in done:
            return getter.result()
        getter.cancel()
        await asyncio.gather(getter, return_exceptions=True)
        return None

    def _metrics_row(self, groups: list[TrajectoryGroup], result: StepResult, wait_s: float) -> dict[str, Any]:
        samples = [s for g in groups for s in g.samples]
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
        lags = [lag for s in samples if (lag := staleness.lag(self.version, s.min_version)) is not None]
        stale = torch.tensor(lags or [0], dtype=torch.float64)
        resp = torch.tensor([s.response_len for s in samples], dtype=torch.float64)
        counts = self.batcher.counts
        row: dict[str, Any] = {
            "reward/mean": rewards.mean().item(),
            "reward/std": rewards.std(unbiased=False).item(),
            "staleness/mean": stale.mean().item(),
            "staleness/max": stale.max().item(),
            "response_length/mean": resp.mean().item(),
            "tool_calls/mean": sum(s.num_tool_calls for s in samples) / len(samples),
            "batch/groups": len(groups),
            "batch/dead_lettered": counts.dead_lettered,
            "batch/dropped_stale": counts.dropped_stale,
            "batch/skipped_uniform": counts.skipped_uniform,
            "batch/duplicates": counts.duplicates,
            "batch/missing_payload": counts.missing_payload,
            "batch/rolled_back": counts.rolled_back,
            "feeder/released": self.feeder.state.released,
            "feeder/abandoned": self.feeder.state.abandoned,
            "time/wait_data": wait_s,
            "_tokens": sum(s.prompt_len + s.response_len for s in samples),
        }
        for v, count in staleness.histogram(lags).items():  # one bucket per version lag
            row[f"staleness/hist_{v}"] = count
        row.update(result.metrics)
        row.update(result.timings)
        row.pop("time/gather_weights", None)
        return row

    def staleness_bound(self, step: int) -> int:
        """The staleness bound in force for `step`: what the guard tightened it to, else what the measured waits
        need (schemas/staleness.py, LagSizer; max_staleness when episodes do not wait)."""
        if self.guard.tightened(step):
            return self.guard.effective_max_staleness(step)
        return self.lag.bound()

    async def _publish_weights(self, state_dict: dict) -> WeightsPublished:
        msg = await self.weight_store.put(self.version, self.step, state_dict)
        # Producers restart samples (partial rollout) and give back groups by the bound in force, not the configured
        # one: a bound raised for latency must not make them throw away what the trainer would keep.
        msg = msgspec.structs.replace(msg, max_staleness=self.staleness_bound(self.step + 1), sft_steps=self.sft_steps)
        # The id names this trainer process too: a trainer resumed from a checkpoint republishes that checkpoint's
        # version, and JetStream must not drop it as a duplicate of the dead process's announcement (whose
        # timeline is gone); within one process the id still de-duplicates a retried publish.
        # After a rollback this process announces versions it announced before: the rollback count keeps them apart.
        rollbacks = self.guard.state.rollbacks
        await self.bus.publish(self.bus.subjects.weights, msg,
                               msg_id=f"weights-v{self.version}-s{self.step}-{self._incarnation}"
                                      + (f"-r{rollbacks}" if rollbacks else ""))
        await self.bus.kv_put("latest", msg)
        return msg

    async def _checkpoint(self) -> None:
        trained = sorted(self.batcher.trained_ids())
        extra = {"step": self.step, "version": self.version, "feeder": self.feeder.state_dict(), "trained": trained,
                 "guard": self.guard.state_dict(), "sft_steps": self.sft_steps}
        await self._execute(StepPlan(step=self.step, shards=None, publish=False, checkpoint=extra))
        acked = await self.batcher.commit(self.step)  # the step is durable: now its groups may go
        log.info("checkpoint at step %d; acked %d group(s)", self.step, acked)

    async def _execute(self, plan: StepPlan) -> StepResult:
        """Run a round on every rank; rank 0's share runs in a thread so the event loop keeps acks alive."""

        def both() -> StepResult:
            return self.worker.execute(self.worker.broadcast(plan))

        return await asyncio.to_thread(both)

    async def close(self, reason: str, clean: bool) -> None:
        for task in (self._feeder_task, self._eval_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self.batcher is not None:
            await self.batcher.stop()
        if self.weight_store is not None:  # our last version must outlive us (the evaluator's last score reads it)
            try:
                await asyncio.wait_for(self.weight_store.flush(), timeout=30.0)
            except Exception as e:
                log.warning("the weight store did not keep a copy of the last version: %s", e)
        if self.metrics is not None:
            self.metrics.close()
        if self.bus is not None:
            try:
                await self.bus.publish_event(RoleStopped(role="trainer", role_id=f"trainer-{os.getpid()}",
                                                         reason=reason, clean=clean))
                if not clean:
                    await self.bus.publish_event(ErrorRaised(role="trainer", role_id=f"trainer-{os.getpid()}",
                                                             error="TrainerFailed", message=reason, fatal=True))
            except BusError as e:  # the checkpoint is on disk; only the announcement is lost with the bus
                log.warning("could not announce the trainer's stop: %s", e)
            try:
                if self.recorder is not None:
                    if self.recorder.enabled:
                        await self._archive_to_the_end()
                    await self.recorder.stop()
            finally:
                await self.bus.close()

    async def _archive_to_the_end(self, timeout: float = 15.0) -> None:
        """Let the recorder catch up with everything the streams hold now (the last groups, this RoleStopped)
        before it stops; what it still misses after `timeout` stays in JetStream, and a restart archives it."""
        s = self.bus.subjects
        try:
            ends = {stream: await self.bus.stream_last_seq(stream)
                    for stream in (s.traj_stream, s.weights_stream, s.events_stream)}
            await self.recorder.drain(ends, timeout=timeout)
        except (TimeoutError, BusError) as e:
            log.warning("event archive not complete at stop (%s); a restart archives the rest", e)


async def run_controller(cfg: RunConfig, worker: StepWorker) -> None:
    refresh_executor_threads()  # the steps run in its threads: each re-sizes its torch pool (common/threads.py)
    service = TrainerService(cfg, worker)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, service.stop)
    try:
        await service.start()
        await service.run()
    except BaseException as e:
        await service.close(reason=f"{type(e).__name__}: {e}", clean=False)
        raise
    await service.close(reason="finished" if service.step >= cfg.trainer.total_steps else "stopped", clean=True)
    log.info("trainer stopped at step %d", service.step)


def run_rank(cfg: RunConfig, model_path: str) -> int:
    """Entry of one rank (spawned locally, under torchrun, or the only one)."""
    setup_logging(cfg.logging.level)
    # Before any torch work: every rank and producer of the run shares the machine's CPUs (common/threads.py).
    apply_torch_threads(cfg.trainer.torch_threads, cfg.trainer.num_ranks + cfg.rollout.num_producers,
                        role=f"trainer rank {os.environ.get('RANK', '0')}",
                        takes_remainder=os.environ.get("RANK", "0") == "0")
    worker = StepWorker(cfg, model_path)
    try:
        if worker.rank == 0:
            try:
                run(run_controller(cfg, worker))
            finally:
                worker.broadcast(None)  # release the other ranks, on every exit path
        else:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 decides when to stop
            worker.serve()
    finally:
        worker.close()
    return 0


def main(cfg: RunConfig) -> int:
    setup_logging(cfg.logging.level)
    model_path = ensure_model(cfg.model)
    n = cfg.trainer.num_ranks
    if n == 1 or "RANK" in os.environ:  # single rank, or torchrun already made the processes
        return run_rank(cfg, model_path)
    # Local multi-rank: every rank must reach the same Ray, so pin its address before spawning.
    address = ensure_ray(cfg.ray)
    cfg = msgspec.structs.replace(cfg, ray=msgspec.structs.replace(cfg.ray, address=address))
    spawn_local(n, run_rank, cfg, model_path)
    return 0
