"""The event log's writer: archives the bus's metadata, every step's composition and (record=full) its tensors.

The format and its readers are in consumers/event_log.py (and docs/event-log.md). On restart each watcher resumes
after the last stream sequence on disk, and step records (with their tensor folders) after the resumed step are cut
back, as metrics.jsonl is.

    recorder = Recorder(cfg.run_dir, cfg.logging.record, resume_step=step)     # rank 0
    await recorder.start(bus)                                                  # traj, weights, events.> watchers
    recorder.prompt(task)                                                      # the feeder, per release
    write_shard(cfg.run_dir, cfg.logging.record, step, rank, batch)            # every rank, before train_step
    recorder.step(step=..., version=..., groups=..., shards=plan.shards, metrics=row)
    await recorder.stop()

Tests: `pytest tests/integration/test_events.py tests/integration/test_replay.py`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import msgspec
import torch
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.client import JetStreamContext
from safetensors.torch import save_file
from tensordict import TensorDict

from rlbus.bus.client import Bus
from rlbus.bus.delivery import dead_letter_of
from rlbus.common.files import write_atomic
from rlbus.consumers.event_log import (
    EVENT_KIND,
    KINDS,
    RECORD_FORMAT,
    STEPS_FILE,
    Entry,
    RecordError,
    RecordMode,
    ShardRow,
    StepRecord,
    advantages_path,
    events_dir,
    shard_path,
)
from rlbus.schemas.errors import SchemaError
from rlbus.schemas.wire import Event, PromptTask, SampleMeta, TrajectoryGroup, TypedDecoder, WeightsPublished

log = logging.getLogger("rlbus.recorder")

_ENC = msgspec.json.Encoder()


def _repair_tail(path: Path) -> None:
    """Cut a torn last line (a crash mid-write) so the file is whole lines again."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    with path.open("rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return
        size = f.seek(0, os.SEEK_END)
        back = min(size, 1 << 20)
        while True:
            f.seek(size - back)
            cut = f.read(back).rfind(b"\n")
            if cut >= 0 or back == size:
                f.truncate(size - back + cut + 1 if cut >= 0 else 0)
                return
            back = min(size, back * 2)


def _last_line(path: Path) -> bytes | None:
    if not path.is_file() or path.stat().st_size == 0:
        return None
    with path.open("rb") as f:
        size = f.seek(0, os.SEEK_END)
        back = min(size, 4096)
        while True:
            f.seek(size - back)
            lines = f.read(back).rstrip(b"\n").split(b"\n")
            if len(lines) > 1 or back == size:
                return lines[-1]
            back = min(size, back * 2)


class _SeqOnly(msgspec.Struct):
    seq: int = 0


class _TaskId(msgspec.Struct):
    task_id: str = ""


class _PromptId(msgspec.Struct):
    msg: _TaskId = msgspec.field(default_factory=_TaskId)


class _SeqSubject(msgspec.Struct):
    seq: int = 0
    subject: str = ""


# ---------------------------------------------------------------------------------------------------------------
# writing: every rank


def write_shard(run_dir: str | os.PathLike, mode: RecordMode, step: int, rank: int, batch: TensorDict) -> int:
    """Save the collated TensorDict `batch` that `rank` trains on at `step`; returns its bytes (0 unless full).

    Written to a temporary name and renamed, so a step redone after a crash (or a retry after a missing payload)
    replaces the earlier file whole.
    """
    if mode != "full":
        return 0
    return _save(shard_path(run_dir, step, rank), {k: batch.get(k) for k in batch.keys()}, step, rank)


def write_advantages(run_dir: str | os.PathLike, mode: RecordMode, step: int, rank: int,
                     tensors: dict[str, torch.Tensor]) -> int:
    """Save what `rank` computed from its batch at `step` (TrainEngine.computed: the advantages the loss used, and
    GAE's values and returns), which the batch alone cannot give back: the critic's values, the KL penalty in the
    reward. Rows as in the rank's shard; returns the bytes (0 unless full)."""
    if mode != "full" or not tensors:
        return 0
    return _save(advantages_path(run_dir, step, rank), tensors, step, rank)


def _save(path: Path, tensors: dict[str, torch.Tensor], step: int, rank: int) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(tmp),
              metadata={"step": str(step), "rank": str(rank), "format": str(RECORD_FORMAT)})
    os.replace(tmp, path)
    return path.stat().st_size


# ---------------------------------------------------------------------------------------------------------------
# writing: rank 0


class Recorder:
    """Rank 0's archive writer: bus watchers, feeder hand-over and step records. A no-op when mode is "off"."""

    run_dir: Path
    mode: RecordMode
    dir: Path
    _files: dict[str, Any]  # kind -> open append handle
    _last_seq: dict[str, int]  # stream name -> last archived sequence
    _tasks: list[asyncio.Task]
    _prompt_ids: set[str] | None  # task ids in prompts.jsonl, read on the first hand-over

    def __init__(self, run_dir: str | os.PathLike, mode: RecordMode = "full", *, resume_step: int = 0):
        self.run_dir = Path(run_dir)
        self.mode = mode
        self.dir = events_dir(run_dir)
        self._files, self._last_seq, self._tasks, self._prompt_ids = {}, {}, [], None
        if mode == "off":
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        for name, _ in [*KINDS.values(), (STEPS_FILE, None)]:
            _repair_tail(self.dir / name)
        self._cut_back(resume_step)

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def cut_back(self, step: int) -> None:
        """Forget steps after `step` (the trainer's stability guard rolled back to it): they are redone, and their
        new records replace these. The bus archive (events/*.jsonl) keeps what happened, the rollback included."""
        if self.enabled:
            handle = self._files.pop(STEPS_FILE, None)  # _cut_back replaces the file: appends must go to the new one
            if handle is not None:
                handle.close()
            self._cut_back(step)

    def _cut_back(self, step: int) -> None:
        """Forget steps after `step`: the resumed run redoes them and its records replace these."""
        path = self.dir / STEPS_FILE
        if path.is_file():
            lines = [ln for ln in path.read_bytes().splitlines(keepends=True) if ln.strip()]
            keep = [ln for ln in lines if msgspec.json.decode(ln, type=_StepOnly).step <= step]
            if len(keep) != len(lines):
                write_atomic(path, b"".join(keep))
        steps = self.dir / "steps"
        if steps.is_dir():
            for d in steps.iterdir():
                if d.name.startswith("step_") and int(d.name[5:]) > step:
                    shutil.rmtree(d)

    def _append(self, kind_file: str, line: bytes) -> None:
        f = self._files.get(kind_file)
        if f is None:
            f = self._files[kind_file] = (self.dir / kind_file).open("ab")
        f.write(line + b"\n")
        f.flush()  # whole lines reach the OS at once; a crash leaves at most a torn tail, repaired on open

    # -- the feeder's hand-over --------------------------------------------------------------------------------------

    def prompt(self, task: PromptTask, subject: str = "") -> None:
        """Archive a PromptTask the feeder released (call after JetStream acknowledged the publish), once per task id.

        The feeder hands over every acknowledged publish, de-duplicated ones too: a publish whose ack was lost to a
        failover is stored, and its retry comes back as a duplicate -- the stream holds it, the archive may not yet.
        """
        if not self.enabled:
            return
        if self._prompt_ids is None:
            path = self.dir / KINDS["prompts"][0]
            lines = path.read_bytes().splitlines() if path.is_file() else []
            self._prompt_ids = {msgspec.json.decode(ln, type=_PromptId).msg.task_id for ln in lines if ln.strip()}
        if task.task_id in self._prompt_ids:
            return
        self._append(KINDS["prompts"][0], _ENC.encode(Entry(seq=0, subject=subject, recorded_at=time.time(),
                                                             msg=task)))
        self._prompt_ids.add(task.task_id)

    # -- step records ------------------------------------------------------------------------------------------------

    def step(
        self,
        *,
        step: int,
        version: int,
        groups: list[TrajectoryGroup],
        shards: list[list[tuple[SampleMeta, int]]],
        metrics: dict[str, Any],
    ) -> StepRecord | None:
        """Archive step `step`'s composition (`shards` = the plan's per-rank (sample, group index) rows)."""
        self._raise_if_failed()
        if not self.enabled:
            return None
        position = [{s.key: i for i, s in enumerate(g.samples)} for g in groups]
        rows = [[ShardRow(group=gi, sample=position[gi][meta.key]) for meta, gi in shard] for shard in shards]
        nbytes = 0
        if self.mode == "full":
            for r, shard in enumerate(shards):
                path = shard_path(self.run_dir, step, r)
                if shard and not path.is_file():
                    raise RecordError(self.run_dir, f"rank {r} wrote no tensors for step {step} ({path})")
                nbytes += path.stat().st_size if path.is_file() else 0
                computed = advantages_path(self.run_dir, step, r)
                nbytes += computed.stat().st_size if computed.is_file() else 0
        clean = {k: _finite_or_none(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        record = StepRecord(step=step, trained_version=version - 1, version=version, world_size=len(shards),
                            groups=list(groups), shards=rows, metrics=clean, payload=self.mode, payload_bytes=nbytes)
        self._append(STEPS_FILE, _ENC.encode(record))
        return record

    # -- bus watchers ------------------------------------------------------------------------------------------------

    async def start(self, bus: Bus) -> None:
        """Watch `traj`, `weights` and `events.>` from the stream position after what is already on disk.

        Returns once the three ordered consumers exist; their messages are archived by background tasks.
        """
        if not self.enabled:
            return
        s = bus.subjects
        letters = self._dead_letter_seqs()
        self._last_seq = {
            s.traj_stream: max(self._last_seq_of("traj"), letters.get(s.traj, 0)),
            s.weights_stream: max(self._last_seq_of("weights"), letters.get(s.weights, 0)),
            s.events_stream: max([self._last_seq_of(k) for k in set(EVENT_KIND.values()) if k != "dead-letter"]
                                 + [q for subj, q in letters.items() if subj.startswith(s.prefix + ".events.")]),
        }
        watched = [(s.traj, s.traj_stream, TrajectoryGroup, "traj"), (s.weights, s.weights_stream, WeightsPublished,
                   "weights"), (s.events, s.events_stream, Event, None)]  # fmt: skip
        log.info("recorder: archiving into %s from stream positions %s", self.dir,
                 {k: v + 1 for k, v in self._last_seq.items()})
        for subject, stream, typ, kind in watched:
            sub = await self._subscribe(bus, subject, stream)
            self._tasks.append(asyncio.create_task(self._archive(bus, sub, stream, typ, kind),
                                                   name=f"record-{stream}"))

    def _last_seq_of(self, kind: str) -> int:
        line = _last_line(self.dir / KINDS[kind][0])
        return msgspec.json.decode(line, type=_SeqOnly).seq if line else 0

    def _dead_letter_seqs(self) -> dict[str, int]:
        """Highest archived sequence per original subject in the dead-letter file (it holds the recorder's own
        undecodable traj / weights messages as well as the events stream's dead letters)."""
        out: dict[str, int] = {}
        path = self.dir / KINDS["dead-letter"][0]
        if path.is_file():
            for ln in path.read_bytes().splitlines():
                if ln.strip():
                    e = msgspec.json.decode(ln, type=_SeqSubject)
                    out[e.subject] = max(out.get(e.subject, 0), e.seq)
        return out

    async def _subscribe(self, bus: Bus, subject: str, stream: str) -> JetStreamContext.PushSubscription:
        # An ordered consumer from a stream sequence: nothing to ack, no durable state on the server; the position
        # lives in our own files, so what is on disk and where we resume can never disagree.
        return await bus.js.subscribe(subject, stream=stream, ordered_consumer=True,
                                      config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                                                            opt_start_seq=self._last_seq[stream] + 1))

    async def _archive(self, bus: Bus, sub: JetStreamContext.PushSubscription, stream: str, typ: Any,
                       kind: str | None) -> None:
        decoder = TypedDecoder(typ)
        try:
            async for m in sub.messages:
                seq = m.metadata.sequence.stream
                if seq <= self._last_seq[stream]:
                    continue
                try:
                    msg = decoder.decode(m.data)
                    file = KINDS[kind or EVENT_KIND[type(msg)]][0]
                except SchemaError as e:  # kept in the archive as a dead letter; the watch goes on
                    msg = dead_letter_of(m, str(e), consumer="recorder")
                    file = KINDS["dead-letter"][0]
                    log.warning("recorder: %s seq %d does not decode; archived as a dead letter: %s", m.subject, seq, e)
                self._append(file, _ENC.encode(Entry(seq=seq, subject=m.subject, recorded_at=time.time(), msg=msg)))
                self._last_seq[stream] = seq
        finally:
            if not (bus.nc.is_closed or bus.nc.is_draining):
                await sub.unsubscribe()

    def archived(self) -> dict[str, int]:
        """Last archived stream sequence per stream (what a restart resumes after)."""
        return dict(self._last_seq)

    def _raise_if_failed(self) -> None:
        for t in self._tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise t.exception()

    async def drain(self, subject_seq: dict[str, int], timeout: float = 10.0) -> None:
        """Wait until every stream in `subject_seq` is archived up to the given sequence (tests, clean stops)."""
        deadline = time.monotonic() + timeout
        while any(self._last_seq.get(st, 0) < seq for st, seq in subject_seq.items()):
            self._raise_if_failed()
            if time.monotonic() > deadline:
                raise TimeoutError(f"recorder did not reach {subject_seq} within {timeout}s (at {self._last_seq})")
            await asyncio.sleep(0.02)

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        results = await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        for f in self._files.values():
            f.close()
        self._files = {}
        for r in results:
            if isinstance(r, Exception):  # a watcher that died before stop: its failure is the caller's to see
                raise r


class _StepOnly(msgspec.Struct):
    step: int


def _finite_or_none(v: float | int) -> float | int | None:
    return None if isinstance(v, float) and (v != v or v in (float("inf"), float("-inf"))) else v
