"""The on-disk format of a run's event log and its readers (`rlbus events`, `rlbus replay`).

The writer is consumers/recorder.py; this module is what both sides agree on, and all a reader needs. A run
directory must replay alone -- no bus, no Ray -- so the trainer copies what JetStream holds into `<run_dir>/events/`
as it happens, and every FSDP rank writes the batch it trained on. The format (stable, documented in
docs/event-log.md):

    events/
        prompts.jsonl       PromptTask, handed over by the feeder as it releases them (the prompts stream is a
                            work queue: a second consumer there is not allowed)
        traj.jsonl          TrajectoryGroup      <- ordered consumer on `traj`
        weights.jsonl       WeightsPublished     <- ordered consumer on `weights`
        completed.jsonl     StepCompleted        <- ordered consumer on `events.>`, routed by type
        heartbeats.jsonl    ProducerHeartbeat
        lifecycle.jsonl     RoleStarted / RoleStopped / ProducersScaled
        errors.jsonl        ErrorRaised
        guard.jsonl         GuardAction (the trainer's stability guard acted)
        dead_letters.jsonl  DeadLetter
        steps.jsonl         StepRecord: which groups, in which order, which rows on which rank, metrics
        steps/step_00000012/rank_0.safetensors   the collated TensorDict rank 0 trained on at step 12 (full only)

Every archive line is `{"seq", "subject", "recorded_at", "msg"}` with `msg` the wire struct as JSON (its `kind` tag
included); `steps.jsonl` lines are bare StepRecords.

    entries = read_entries(run_dir, "traj")                    # [Entry[TrajectoryGroup]]
    records = read_steps(run_dir)                              # [StepRecord], one per step
    batch = load_step_batch(run_dir, records[-1])              # the whole step's TensorDict

Tests: `pytest tests/integration/test_events.py tests/integration/test_replay.py`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Generic, Iterator, Literal, TypeVar, Union

import msgspec

from rlbus.schemas.errors import RlbusError
from rlbus.schemas.wire import (
    DeadLetter,
    ErrorRaised,
    EvalCompleted,
    GuardAction,
    ProducerHeartbeat,
    ProducersScaled,
    PromptTask,
    RoleStarted,
    RoleStopped,
    SampleMeta,
    StepCompleted,
    TrajectoryGroup,
    WeightsPublished,
)

#: Version of the on-disk layout; bumped only by a breaking change (fields are appended with defaults otherwise).
RECORD_FORMAT = 1
EVENTS_DIR = "events"
STEPS_FILE = "steps.jsonl"

M = TypeVar("M")
RecordMode = Literal["off", "metadata", "full"]


class RecordError(RlbusError):
    """The event log of a run directory is missing what was asked of it."""

    def __init__(self, run_dir: str | os.PathLike, reason: str):
        self.run_dir = str(run_dir)
        self.reason = reason
        super().__init__(f"event log of {self.run_dir}: {reason}")


class Entry(msgspec.Struct, Generic[M], kw_only=True):
    """One archived bus message."""

    seq: int  # JetStream stream sequence (0 for prompts: they come from the feeder, not a stream)
    subject: str
    recorded_at: float
    msg: M


class ShardRow(msgspec.Struct, array_like=True):
    """One row of a rank's batch: sample `sample` of group `group` (indices into StepRecord.groups)."""

    group: int
    sample: int


class StepRecord(msgspec.Struct, kw_only=True, tag="step_record", tag_field="kind"):
    """The exact composition of one optimizer step. `groups[i]` has `group_index == i` in the batch."""

    step: int
    trained_version: int  # the policy version the step started from
    version: int  # the version it produced
    world_size: int
    groups: list[TrajectoryGroup]  # in step order
    shards: list[list[ShardRow]]  # per rank, the rows of its batch in order (rank r's file holds len(shards[r]))
    metrics: dict[str, Union[float, int, None]] = {}  # the step's row of metrics.jsonl (non-finite -> null)
    payload: Literal["metadata", "full"] = "metadata"  # full: steps/step_N/rank_R.safetensors exist
    payload_bytes: int = 0  # all ranks' tensor files together
    record_format: int = RECORD_FORMAT
    created_at: float = msgspec.field(default_factory=time.time)


#: kind name -> (file name, message type). The CLI's `--kind` takes these names.
KINDS: dict[str, tuple[str, Any]] = {
    "prompts": ("prompts.jsonl", PromptTask),
    "traj": ("traj.jsonl", TrajectoryGroup),
    "weights": ("weights.jsonl", WeightsPublished),
    "completed": ("completed.jsonl", StepCompleted),
    "heartbeats": ("heartbeats.jsonl", ProducerHeartbeat),
    "lifecycle": ("lifecycle.jsonl", Union[RoleStarted, RoleStopped, ProducersScaled]),
    "errors": ("errors.jsonl", ErrorRaised),
    "dead-letter": ("dead_letters.jsonl", DeadLetter),
    "evals": ("evals.jsonl", EvalCompleted),
    "guard": ("guard.jsonl", GuardAction),
}
EVENT_KIND: dict[type, str] = {
    StepCompleted: "completed",
    ProducerHeartbeat: "heartbeats",
    RoleStarted: "lifecycle",
    RoleStopped: "lifecycle",
    ProducersScaled: "lifecycle",
    ErrorRaised: "errors",
    DeadLetter: "dead-letter",
    EvalCompleted: "evals",
    GuardAction: "guard",
}


# ---------------------------------------------------------------------------------------------------------------
# paths


def events_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / EVENTS_DIR


def step_dir(run_dir: str | os.PathLike, step: int) -> Path:
    return events_dir(run_dir) / "steps" / f"step_{step:08d}"


def shard_path(run_dir: str | os.PathLike, step: int, rank: int) -> Path:
    return step_dir(run_dir, step) / f"rank_{rank}.safetensors"


def advantages_path(run_dir: str | os.PathLike, step: int, rank: int) -> Path:
    """What rank `rank` computed from its batch at `step` (advantages; GAE's values and returns), rows as its shard's."""
    return step_dir(run_dir, step) / f"rank_{rank}.advantages.safetensors"


# ---------------------------------------------------------------------------------------------------------------
# reading (rlbus events, rlbus replay)


def read_entries(run_dir: str | os.PathLike, kind: str) -> list[Entry[Any]]:
    """Every archived message of one kind, in archive order."""
    name, typ = KINDS[kind]
    path = events_dir(run_dir) / name
    if not path.is_file():
        return []
    dec = msgspec.json.Decoder(Entry[typ])
    return [dec.decode(ln) for ln in path.read_bytes().splitlines() if ln.strip()]


def read_steps(run_dir: str | os.PathLike) -> list[StepRecord]:
    """Step records in step order (the last record of a step wins, should a file hold two)."""
    path = events_dir(run_dir) / STEPS_FILE
    if not path.is_file():
        return []
    dec = msgspec.json.Decoder(StepRecord)
    by_step = {r.step: r for r in (dec.decode(ln) for ln in path.read_bytes().splitlines() if ln.strip())}
    return [by_step[s] for s in sorted(by_step)]


def load_rank_batch(run_dir: str | os.PathLike, step: int, rank: int) -> Any:
    """The TensorDict rank `rank` trained on at `step`."""
    # Imported here: the metadata readers (rlbus events, the inspector's index) need no torch, whose import costs
    # seconds of a command's start.
    from safetensors.torch import load_file
    from tensordict import TensorDict

    path = shard_path(run_dir, step, rank)
    if not path.is_file():
        raise RecordError(run_dir, f"no tensors for step {step} rank {rank} ({path}); was the run recorded with "
                                   "logging.record=full?")
    tensors = load_file(str(path))
    return TensorDict(tensors, batch_size=[tensors["input_ids"].shape[0]])


def load_step_batch(run_dir: str | os.PathLike, record: StepRecord) -> Any:
    """The whole step's batch: every rank's shard concatenated in rank order, padded to the longest T."""
    import torch
    from tensordict import TensorDict

    parts = [load_rank_batch(run_dir, record.step, r) for r, rows in enumerate(record.shards) if rows]
    if len(parts) == 1:
        return parts[0]
    T = max(p["input_ids"].shape[1] for p in parts)
    fill = {"versions": -1}  # collate's padding value of each [B, T] field; every other field pads with 0
    out: dict[str, Any] = {}
    for k in parts[0].keys():
        pieces = []
        for p in parts:
            t = p.get(k)
            if t.dim() == 2 and t.shape[1] < T:
                # input_ids pad with the pad id; attention_mask marks it as padding, so any value would do.
                t = torch.nn.functional.pad(t, (0, T - t.shape[1]), value=fill.get(k, 0))
            pieces.append(t)
        out[k] = torch.cat(pieces)
    return TensorDict(out, batch_size=[sum(p.batch_size[0] for p in parts)])


def mask_spans(mask: list[int]) -> list[tuple[int, int, int]]:
    """Runs of equal `response_mask` values over a response: (value, start, end); 1 = sampled, 0 = inserted."""
    out: list[tuple[int, int, int]] = []
    for i, m in enumerate(mask):
        if out and out[-1][0] == m:
            out[-1] = (m, out[-1][1], i + 1)
        else:
            out.append((m, i, i + 1))
    return out


def iter_step_samples(record: StepRecord) -> Iterator[tuple[int, int, TrajectoryGroup, SampleMeta]]:
    """(rank, row, group, sample) for every row of the step."""
    for r, rows in enumerate(record.shards):
        for i, row in enumerate(rows):
            g = record.groups[row.group]
            yield r, i, g, g.samples[row.sample]
