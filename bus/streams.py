"""The run's JetStream objects as data: its streams, its KV bucket and its durable consumers, as
`Bus.ensure_streams` creates them and `rlbus schema` documents them (docs/wire.md)."""

from __future__ import annotations

from typing import Any

from nats.js.api import AckPolicy, ConsumerConfig, KeyValueConfig, RetentionPolicy, StorageType, StreamConfig

from rlbus.schemas.config import DUPLICATE_WINDOW_S, BusConfig
from rlbus.schemas.subjects import Subjects

__all__ = ["DUPLICATE_WINDOW_S", "PRODUCERS_KEY", "TRAINER_KEY", "consumer_configs", "kv_config", "stream_configs"]

#: KV keys of the unacked lists a role keeps for its successor (bus/handover.py): the trainer's, and each named
#: producer's under `unacked.producer.<id>` (a producer's credential may write those keys and no other: bus/auth.py).
TRAINER_KEY = "unacked.trainer"
PRODUCERS_KEY = "unacked.producer"


def stream_configs(s: Subjects, cfg: BusConfig) -> list[StreamConfig]:
    """The run's streams as `Bus.ensure_streams` creates them (also what `rlbus schema` documents)."""
    common: dict[str, Any] = {"storage": StorageType.FILE, "num_replicas": cfg.replicas,
                              "duplicate_window": DUPLICATE_WINDOW_S}
    # Prompts are a work queue: a task leaves the stream once a producer acks it; no age limit, never lost.
    out = [StreamConfig(name=s.prompts_stream, subjects=[s.prompts], retention=RetentionPolicy.WORK_QUEUE, **common)]
    for name, subject in ((s.traj_stream, s.traj), (s.weights_stream, s.weights), (s.events_stream, s.events)):
        out.append(StreamConfig(name=name, subjects=[subject], retention=RetentionPolicy.LIMITS,
                                max_age=cfg.max_age_s or None, **common))
    # JetStream says a prompt ran out of deliveries only in an advisory, a core message that nobody may be
    # listening to (the trainer down); captured in a work queue, each waits for the feeder, however long it is away.
    out.append(StreamConfig(name=s.advisories_stream, subjects=[s.exhausted_advisory],
                            retention=RetentionPolicy.WORK_QUEUE, **common))
    return out


def kv_config(s: Subjects, cfg: BusConfig) -> KeyValueConfig:
    """The weights bucket: key `latest` holds the newest WeightsPublished, for late joiners."""
    return KeyValueConfig(bucket=s.weights_bucket, history=1, storage=StorageType.FILE, replicas=cfg.replicas)


def consumer_configs(s: Subjects, cfg: BusConfig,
                     traj_max_ack_pending: int | None = None) -> list[tuple[str, ConsumerConfig]]:
    """The run's durable consumers, each with the stream it reads."""
    return [
        (s.prompts_stream, ConsumerConfig(
            name=s.prompts_consumer,
            durable_name=s.prompts_consumer,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=cfg.ack_wait_s,
            max_deliver=cfg.max_deliver,
            filter_subject=s.prompts,
        )),
        (s.traj_stream, ConsumerConfig(
            name=s.traj_consumer,
            durable_name=s.traj_consumer,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=cfg.ack_wait_s,
            max_deliver=-1,  # a group is retried until the trainer acks it; it never expires into a dead letter
            filter_subject=s.traj,
            max_ack_pending=traj_max_ack_pending,
        )),
        (s.advisories_stream, ConsumerConfig(
            name=s.advisories_consumer,
            durable_name=s.advisories_consumer,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=cfg.ack_wait_s,
            max_deliver=-1,  # an advisory is handled (its prompt dead-lettered) before it is acked
            filter_subject=s.exhausted_advisory,
        )),
    ]
