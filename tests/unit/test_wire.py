"""Wire contract: every struct round-trips through encode/TypedDecoder, evolution is append-only, versions are checked.

    .venv/bin/python -m pytest -q tests/unit/test_wire.py
"""

from __future__ import annotations

import msgspec
import pytest

from rlbus.schemas.errors import SchemaError
from rlbus.schemas.wire import (
    EVENT_SUBJECT_KIND,
    ChatMessage,
    DeadLetter,
    ErrorRaised,
    Event,
    ProducerHeartbeat,
    PromptTask,
    RoleStarted,
    RoleStopped,
    SampleMeta,
    StepCompleted,
    TrajectoryGroup,
    TypedDecoder,
    WeightsPublished,
    encode,
)


def _sample(i: int) -> SampleMeta:
    return SampleMeta(
        key=f"g1/{i}", prompt_len=12, response_len=30 + i, reward=float(i % 2), num_tool_calls=1, num_turns=2,
        finish_reason="stop", min_version=3, max_version=4, gen_time_s=0.5, tool_time_s=0.01, reward_time_s=0.002,
    )


def _group() -> TrajectoryGroup:
    return TrajectoryGroup(
        group_id="g1", task_id="g1", producer_id="p0", samples=[_sample(i) for i in range(8)], data_source="arith",
        index=7, epoch=1, attempt=0,
    )


EVENTS = [
    StepCompleted(step=3, version=3, group_ids=["a", "b"], metrics={"loss": 0.25}),
    ProducerHeartbeat(producer_id="p0", version=2, host="h", pid=12, groups_done=5, inflight=1),
    RoleStarted(role="trainer", role_id="trainer-0", host="h", pid=1),
    RoleStopped(role="producer", role_id="p1", reason="signal", clean=False),
    ErrorRaised(role="producer", role_id="p1", error="RuntimeError", message="boom", fatal=True),
    DeadLetter(reason="bad", original_subject="rlbus.r.traj", payload=b"\x00\xff", stream_seq=9, num_delivered=2),
]

ALL = [
    PromptTask(task_id="t1", prompt=[ChatMessage(role="user", content="1+2?")], ground_truth="3", n=8,
               extra_info={"a": 1, "b": "x", "c": None, "d": 1.5, "e": True}),
    _group(),
    WeightsPublished(version=4, step=4, num_bytes=1024, checksum="ab12", num_tensors=3, store="ws"),
    *EVENTS,
]


@pytest.mark.parametrize("msg", ALL, ids=lambda m: type(m).__name__)
def test_every_wire_struct_round_trips(msg: msgspec.Struct) -> None:
    decoded = TypedDecoder(type(msg)).decode(encode(msg))
    assert decoded == msg
    assert type(decoded) is type(msg)


def test_sample_meta_round_trips_positionally() -> None:
    s = _sample(3)
    assert TypedDecoder(SampleMeta).decode(encode(s)) == s
    # array_like: encoded as a msgpack array, i.e. without field names.
    assert isinstance(msgspec.msgpack.decode(encode(s)), list)


class NewerSampleMeta(SampleMeta, kw_only=True):
    """A future SampleMeta: one field appended at the end, with a default."""

    verifier: str = "v2"


class NewerTrajectoryGroup(TrajectoryGroup, kw_only=True, tag="trajectory_group"):
    """A future TrajectoryGroup: one field appended at the end, with a default."""

    priority: float = 0.0


def test_current_reader_decodes_newer_array_like_struct() -> None:
    newer = NewerSampleMeta(**msgspec.structs.asdict(_sample(2)), verifier="math-v2")
    # The appended field is encoded last, after every field the current reader knows.
    assert msgspec.msgpack.decode(encode(newer))[-1] == "math-v2"
    assert len(msgspec.msgpack.decode(encode(newer))) == len(msgspec.structs.fields(SampleMeta)) + 1
    assert TypedDecoder(SampleMeta).decode(encode(newer)) == _sample(2)


def test_current_reader_decodes_newer_map_struct_with_newer_samples() -> None:
    fields = msgspec.structs.asdict(_group())
    fields["samples"] = [NewerSampleMeta(**msgspec.structs.asdict(s), verifier="x") for s in _group().samples]
    newer = NewerTrajectoryGroup(**fields, priority=2.5)
    raw = msgspec.msgpack.decode(encode(newer))
    assert raw["priority"] == 2.5 and raw["kind"] == "trajectory_group"
    decoded = TypedDecoder(TrajectoryGroup).decode(encode(newer))
    assert type(decoded) is TrajectoryGroup
    expected = msgspec.structs.replace(_group(), created_at=newer.created_at)
    assert decoded == expected


def test_newer_reader_fills_defaults_for_older_message() -> None:
    decoded = TypedDecoder(NewerTrajectoryGroup).decode(encode(_group()))
    assert decoded.priority == 0.0 and decoded.group_id == "g1"


@pytest.mark.parametrize("msg", ALL, ids=lambda m: type(m).__name__)
def test_unknown_schema_version_raises(msg: msgspec.Struct) -> None:
    future = msgspec.structs.replace(msg, schema_version=99)
    with pytest.raises(SchemaError, match="schema_version 99"):
        TypedDecoder(type(msg)).decode(encode(future))


def test_garbage_and_wrong_type_raise_schema_error() -> None:
    with pytest.raises(SchemaError):
        TypedDecoder(TrajectoryGroup).decode(b"\xc1garbage")
    with pytest.raises(SchemaError):
        TypedDecoder(TrajectoryGroup).decode(encode(EVENTS[0]))  # valid msgpack, wrong kind


@pytest.mark.parametrize("event", EVENTS, ids=lambda m: type(m).__name__)
def test_event_union_decodes_each_kind(event: msgspec.Struct) -> None:
    decoded = TypedDecoder(Event).decode(encode(event))
    assert type(decoded) is type(event)
    assert decoded == event


def test_every_event_type_has_a_subject_kind() -> None:
    assert set(EVENT_SUBJECT_KIND) == set(Event.__args__)  # type: ignore[attr-defined]
