"""Wire types: every message that crosses a process boundary on NATS. No torch here.

Rules (docs/architecture.md, "Wire contract"):
- each message type is a msgspec Struct tagged with its `kind`, decoded by a typed Decoder made once;
- evolution is append-only: a new field goes at the end with a default, so an older reader still decodes a newer
  message (unknown trailing fields / keys are ignored); a breaking change bumps `SCHEMA_VERSION` and readers
  dead-letter versions they do not know;
- tensors never travel here: a trajectory's tokens live in the TransferQueue under `SampleMeta.key`.
"""

from __future__ import annotations

import time
from typing import Any, Union

import msgspec

from rlbus.schemas import staleness
from rlbus.schemas.errors import SchemaError

#: Major version of the wire contract. Readers accept messages whose `schema_version` is in SUPPORTED_VERSIONS.
SCHEMA_VERSION = 1
SUPPORTED_VERSIONS = frozenset({1})

JsonScalar = Union[str, int, float, bool, None]


def now() -> float:
    return time.time()


class Wire(msgspec.Struct, kw_only=True, tag_field="kind", omit_defaults=False):
    """Base of every wire message: carries the schema version."""

    schema_version: int = SCHEMA_VERSION  # major version of the contract (SUPPORTED_VERSIONS)


class ChatMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str  # "system" | "user" | "assistant" | "tool"
    content: str  # the message text


class PromptTask(Wire, tag="prompt_task"):
    """One prompt to roll out `n` times (a GRPO group). Published by the feeder on `prompts` (work queue)."""

    task_id: str  # unique per release; also the JetStream Nats-Msg-Id, so a re-publish is dropped
    prompt: list[ChatMessage]  # the chat to complete
    ground_truth: str = ""  # what the reward compares the answer with
    data_source: str = ""  # the data set's data_source column (selects a reward in verl's layout)
    extra_info: dict[str, JsonScalar] = {}  # the data set's extra_info column
    n: int = 1  # samples per prompt (the group size)
    index: int = 0  # position of the example in the dataset
    epoch: int = 0  # pass over the data set this release belongs to
    attempt: int = 0  # 0 for the first release; +1 for every re-issue (payload missing, dead-lettered)
    released_version: int = 0  # trainer weight version when the feeder released it
    created_at: float = msgspec.field(default_factory=now)  # Unix time of the release


class SampleMeta(msgspec.Struct, kw_only=True, array_like=True, gc=False):
    """Metadata of one trajectory of a group.

    array_like and gc=False: a group carries n of these and the trainer decodes thousands per step; positional
    encoding halves their size. Evolution stays append-only (new fields at the end, with defaults).
    """

    key: str  # TransferQueue key of this sample's tensors
    prompt_len: int  # prompt tokens
    response_len: int  # response tokens, tool output included (the mask tells them apart)
    reward: float  # the sample's scalar reward
    num_tool_calls: int = 0  # tool calls the model made
    num_turns: int = 1  # assistant turns
    finish_reason: str = "stop"  # "stop" | "length" | "max_turns" | "error"
    min_version: int = 0  # oldest policy version among its generated tokens (-1: it has none)
    max_version: int = 0  # newest policy version among its generated tokens (-1: it has none)
    gen_time_s: float = 0.0  # seconds spent generating
    tool_time_s: float = 0.0  # seconds spent in tool calls (or environment steps)
    reward_time_s: float = 0.0  # seconds spent scoring


class TrajectoryGroup(Wire, tag="trajectory_group"):
    """A finished GRPO group, published on `traj` once its tensors are in the TransferQueue."""

    group_id: str  # == task_id of the prompt it answers (one group per task release)
    task_id: str  # the PromptTask it answers
    producer_id: str  # who rolled it out
    samples: list[SampleMeta]  # the group's n trajectories
    data_source: str = ""  # copied from the task
    index: int = 0  # copied from the task
    epoch: int = 0  # copied from the task
    attempt: int = 0  # copied from the task
    created_at: float = msgspec.field(default_factory=now)  # Unix time the group was finished

    @property
    def min_version(self) -> int:
        """Oldest token version of the group; samples without a generated token are left out (-1 if all are)."""
        return staleness.oldest(s.min_version for s in self.samples)

    @property
    def max_version(self) -> int:
        """Newest token version of the group (-1 if no sample has a generated token)."""
        return staleness.newest(s.max_version for s in self.samples)

    @property
    def keys(self) -> list[str]:
        return [s.key for s in self.samples]


class WeightsPublished(Wire, tag="weights_published"):
    """A new policy version is in the weight store. Published on `weights`; also the KV bucket's `latest`."""

    version: int  # the policy version (completed trainer steps)
    step: int  # the trainer step that produced it
    num_bytes: int  # size of the state dict
    checksum: str  # hex digest over the tensors' bytes in name order
    num_tensors: int = 0  # tensors in the state dict
    dtype: str = "float32"  # their dtype
    store: str = ""  # name of the weight-store actor holding it
    created_at: float = msgspec.field(default_factory=now)
    # The payload: every weight ("full"), model.lora's adapter alone ("adapter": a producer applies it to the base
    # weights of model.path it was built from, W + adapter_scale * B A per layer), or what changed since version
    # base_version ("delta", common/delta.py; the full copy is in the store too, for a producer that cannot apply it).
    encoding: str = "full"  # "full" | "adapter" | "delta"
    adapter_scale: float = 0.0  # "adapter": model.lora alpha / rank
    base_version: int = -1  # "delta": the version it applies to
    base_checksum: str = ""  # "delta": that version's full checksum (the link a producer's weights must match)
    full_checksum: str = ""  # under trainer.weight_sync.encoding delta: the full weights' checksum of this version
    max_staleness: int = -1  # the staleness bound in force from this version on (-1: trainer.max_staleness)
    sft_steps: int = 0  # supervised steps (trainer.sft) in these weights: > 0, version 0 is not model.path's weights

    @property
    def weights_checksum(self) -> str:
        """The checksum of the weights this version stands for (a delta's own `checksum` is of the delta)."""
        return self.full_checksum or self.checksum


class StepCompleted(Wire, tag="step_completed"):
    """The trainer finished an optimizer step. Published on `events.step`."""

    step: int  # the step just finished (1, 2, ...)
    version: int  # the policy version after it
    group_ids: list[str]  # the groups it trained on
    metrics: dict[str, float] = {}  # the step's row of metrics.jsonl (reward/mean, actor/pg_loss, ...)
    created_at: float = msgspec.field(default_factory=now)  # Unix time


class ProducerHeartbeat(Wire, tag="producer_heartbeat"):
    """A producer is alive. Published on `events.heartbeat` every few seconds."""

    producer_id: str
    version: int  # weight version its engine holds
    host: str = ""  # host name of the producer
    pid: int = 0  # its process id
    status: str = "running"  # "starting" | "running" | "draining"
    groups_done: int = 0  # groups published by this process
    tokens_generated: int = 0  # policy tokens generated by this process
    groups_per_min: float = 0.0  # groups_done over the process's lifetime
    inflight: int = 0  # prompt tasks it is rolling out now
    created_at: float = msgspec.field(default_factory=now)
    tokens_discarded: int = 0  # generated tokens thrown away as too stale (groups given back, samples restarted)
    samples_restarted: int = 0  # samples begun again from the prompt under partial rollout
    inflight_limit: int = 0  # tasks it may hold now (rollout.max_inflight_tasks, or sized from its engine's idle time)
    engine_idle: float = 0.0  # share of the last sizing window its engine had no turn to work on
    infra_failures: int = 0  # tasks given back because a tool, sandbox or judge failed (not trained)
    env_failures: int = 0  # tasks that failed because the environment raised or gave bad output
    tool_retries: int = 0  # tool attempts retried after their service failed
    spares_cancelled: int = 0  # episodes cancelled because their group had its n first (rollout.redundant_samples)


class RoleStarted(Wire, tag="role_started"):
    """Lifecycle: a process of some role came up. Published on `events.lifecycle`."""

    role: str  # "trainer" | "producer" | "evaluator" (the launcher publishes only ProducersScaled)
    role_id: str  # e.g. the producer id, "trainer-<pid>"
    host: str = ""  # host name
    pid: int = 0  # process id
    detail: str = ""  # free text (the trainer: the step and version it starts at)
    created_at: float = msgspec.field(default_factory=now)


class RoleStopped(Wire, tag="role_stopped"):
    """Lifecycle: a process of some role is going down (cleanly or not)."""

    role: str  # as in RoleStarted
    role_id: str  # as in RoleStarted
    reason: str = ""  # why it stops
    clean: bool = True  # False when it stops on an error
    created_at: float = msgspec.field(default_factory=now)


class ErrorRaised(Wire, tag="error_raised"):
    """A role hit an error worth seeing in the log (it may or may not be fatal)."""

    role: str  # as in RoleStarted
    role_id: str  # as in RoleStarted
    error: str  # exception type
    message: str  # what happened
    fatal: bool = False  # True when the role stops because of it
    created_at: float = msgspec.field(default_factory=now)
    # Whose failure, for a failed episode: "infrastructure" (a tool's service, a sandbox, a judge, their timeouts:
    # retried, never trained), "environment" (it raised or gave bad output); "" for anything else.
    failure: str = ""


class DeadLetter(Wire, tag="dead_letter"):
    """A message nobody could use, with why. Published on `events.dead_letter`; the original was terminated."""

    reason: str  # why it could not be used
    original_subject: str  # where the original was published
    payload: bytes  # the original's bytes, or their first DEAD_LETTER_EXCERPT bytes (see payload_bytes)
    stream_seq: int = 0  # where the whole original was in its stream
    num_delivered: int = 0  # deliveries of the original before it was terminated
    consumer: str = ""  # the consumer that gave up on it
    created_at: float = msgspec.field(default_factory=now)
    payload_bytes: int = 0  # size of the original (more than len(payload) when it was cut to an excerpt)


class ProducersScaled(Wire, tag="producers_scaled"):
    """The launcher changed how many producers it runs (`rlbus scale RUN_DIR N`). Published on `events.lifecycle`;
    each added producer then announces RoleStarted, each removed one RoleStopped once it has drained."""

    target: int  # producers the launcher now keeps running
    previous: int  # producers it ran before
    added: list[str] = []  # producer ids started
    removed: list[str] = []  # producer ids sent SIGTERM (they finish or give back their tasks, then exit)
    created_at: float = msgspec.field(default_factory=now)


class EvalCompleted(Wire, tag="eval_completed"):
    """The evaluator scored one weight version on the held-out prompts. Published on `events.eval`; the trainer
    writes its metrics into metrics.jsonl (a row of its own, at `step`), TensorBoard and curves.png."""

    version: int  # the weight version evaluated
    step: int  # the trainer step that version came from
    num_prompts: int  # held-out prompts scored
    metrics: dict[str, float] = {}  # eval/accuracy, eval/reward, eval/tool_calls, eval/response_length, ...
    seconds: float = 0.0  # wall time of the evaluation (weights load included)
    evaluator_id: str = ""  # the evaluator process that ran it
    created_at: float = msgspec.field(default_factory=now)  # Unix time


class Unacked(Wire, tag="unacked"):
    """The ack subjects of the deliveries a role holds unsettled, kept for its successor (bus/handover.py). The
    trainer keeps its list in the KV bucket under `unacked.trainer` and a producer started with an id under
    `unacked.producer.<id>`, so the role restarted on another machine naks them at once instead of waiting out
    ack_wait; the same list is also a file in the run directory."""

    role: str  # the role that held them (trainer, producer)
    consumer: str  # the durable consumer they were delivered by
    replies: list[str] = []  # the deliveries' ack subjects ($JS.ACK...)
    created_at: float = msgspec.field(default_factory=now)  # Unix time


class GuardAction(Wire, tag="guard_action"):
    """The trainer's stability guard acted (trainer/guard.py): a rule fired on a step's metrics, and what was done
    about it. Published on `events.guard`; archived in events/guard.jsonl; the step's metrics carry guard/* too."""

    step: int  # the step whose metrics fired the rule(s)
    rules: list[str]  # the rules that fired: entropy_collapse, mismatch_kl, grad_spike, clip_fraction, reward_drop
    actions: list[str]  # what was done: warn, tighten, rollback
    message: str  # one line for people: each rule's value against its threshold, and the action
    values: dict[str, float] = {}  # each fired rule's observed value
    thresholds: dict[str, float] = {}  # each fired rule's threshold
    lr_scale: float = 1.0  # the LR multiplier from the next step on (1 = untouched)
    max_staleness: int = -1  # the staleness bound from the next step on (-1 = the configured one)
    tightened_until: int = 0  # the last step of the tighter setting (0 = not tightened)
    rollback_to: int = -1  # rollback: the checkpoint step the trainer went back to (-1 = none)
    created_at: float = msgspec.field(default_factory=now)  # Unix time


#: A dead letter keeps at most this much of the original: a letter must fit under the server's message size limit
#: even when the original was near it (the stream sequence still says where the whole message was).
DEAD_LETTER_EXCERPT = 64 * 1024


#: Everything published on `events.*`.
Event = Union[StepCompleted, ProducerHeartbeat, RoleStarted, RoleStopped, ErrorRaised, DeadLetter, ProducersScaled,
              EvalCompleted, GuardAction]

#: `events.<kind>` subject token of each event type.
EVENT_SUBJECT_KIND: dict[type, str] = {
    StepCompleted: "step",
    ProducerHeartbeat: "heartbeat",
    RoleStarted: "lifecycle",
    RoleStopped: "lifecycle",
    ErrorRaised: "error",
    DeadLetter: "dead_letter",
    ProducersScaled: "lifecycle",
    EvalCompleted: "eval",
    GuardAction: "guard",
}


def check_version(msg: Any) -> None:
    """Raise SchemaError if `msg` carries a schema version this reader does not support."""
    v = getattr(msg, "schema_version", SCHEMA_VERSION)
    if v not in SUPPORTED_VERSIONS:
        raise SchemaError(
            f"{type(msg).__name__} has schema_version {v}; this reader supports {sorted(SUPPORTED_VERSIONS)}"
        )


def encode(msg: Any) -> bytes:
    return _ENCODER.encode(msg)


_ENCODER = msgspec.msgpack.Encoder()


class TypedDecoder:
    """A msgpack decoder for one wire type (or union), made once, that also enforces the schema version."""

    def __init__(self, typ: Any):
        self.type = typ
        self._dec = msgspec.msgpack.Decoder(typ)

    def decode(self, data: bytes) -> Any:
        try:
            msg = self._dec.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise SchemaError(f"cannot decode as {getattr(self.type, '__name__', self.type)}: {e}") from e
        check_version(msg)
        return msg
