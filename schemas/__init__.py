"""Wire and config types shared by every role. Imports no torch, no ray, no nats."""

from rlbus.schemas.errors import (
    BusError,
    ConfigError,
    PayloadMissing,
    RlbusError,
    SchemaError,
    TransferQueueError,
    TransferQueueFull,
    WeightsMissing,
)
from rlbus.schemas.subjects import Subjects
from rlbus.schemas.wire import (
    SCHEMA_VERSION,
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

__all__ = [
    "SCHEMA_VERSION", "BusError", "ChatMessage", "ConfigError", "DeadLetter", "ErrorRaised", "Event",
    "PayloadMissing", "ProducerHeartbeat", "PromptTask", "RlbusError", "RoleStarted", "RoleStopped",
    "SampleMeta", "SchemaError", "StepCompleted", "Subjects", "TrajectoryGroup", "TransferQueueError",
    "TransferQueueFull", "TypedDecoder", "WeightsMissing", "WeightsPublished", "encode",
]
