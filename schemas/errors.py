"""The rlbus error hierarchy. Every error says what went wrong and where; none is caught blindly."""

from __future__ import annotations


class RlbusError(Exception):
    """Base of every error rlbus raises on purpose."""


class ConfigError(RlbusError, ValueError):
    """A run configuration is invalid. The message starts with the dotted path of the field at fault."""

    def __init__(self, field: str, reason: str):
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {reason}" if field else reason)


class BusError(RlbusError):
    """Talking to NATS / JetStream failed (connect, publish not acknowledged, stream set-up)."""


class SchemaError(RlbusError):
    """A message could not be decoded into its type, or carries a schema version this reader does not know."""


class TransferQueueError(RlbusError):
    """The Ray-backed TransferQueue failed."""


class TransferQueueFull(TransferQueueError):
    """A put would exceed the TransferQueue's bounded capacity (items or bytes)."""


class PayloadMissing(TransferQueueError):
    """Keys announced on the bus have no tensors in the TransferQueue (deleted, or Ray restarted)."""

    def __init__(self, keys: list[str]):
        self.keys = list(keys)
        shown = ", ".join(self.keys[:5]) + (" ..." if len(self.keys) > 5 else "")
        super().__init__(f"{len(self.keys)} payload(s) missing from the TransferQueue: {shown}")


class WeightsMissing(TransferQueueError):
    """A weight version is not (or no longer) held by the weight store."""


class WeightsLost(WeightsMissing):
    """The weight store names a version whose object died with the trainer that published it."""


class WeightsChecksumMismatch(TransferQueueError):
    """Weights fetched for a version do not have the digest they were announced (or stored) with."""

    def __init__(self, version: int, *, expected: str, actual: str):
        self.version, self.expected, self.actual = version, expected, actual
        super().__init__(f"weights of version {version} have checksum {actual}, expected {expected}")


class WeightLoadError(RlbusError):
    """A rollout engine was handed a state dict that does not fit its model (names or shapes differ)."""

    def __init__(self, version: int, *, missing: list[str], unexpected: list[str], bad_shape: list[str]):
        self.version = version
        self.missing, self.unexpected, self.bad_shape = list(missing), list(unexpected), list(bad_shape)
        parts = [f"{label} {names[:5]}{' ...' if len(names) > 5 else ''}"
                 for label, names in (("missing", missing), ("unexpected", unexpected), ("wrong shape", bad_shape))
                 if names]
        super().__init__(f"weights of version {version} do not fit the engine's model: " + "; ".join(parts))
