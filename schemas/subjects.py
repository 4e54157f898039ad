"""Subject, stream, consumer and bucket names of one run. Everything of a run lives under `rlbus.<run>.`."""

from __future__ import annotations

import re

import msgspec

_RUN_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def check_run_name(run: str) -> str:
    """A run name becomes a subject token and a stream name: letters, digits, `_` and `-` only."""
    if not _RUN_NAME.match(run):
        raise ValueError(f"run name {run!r} must be 1-64 characters of letters, digits, '_' or '-'")
    return run


class Subjects(msgspec.Struct, frozen=True):
    """Names for one run. `Subjects.for_run("quickstart").traj == "rlbus.quickstart.traj"`."""

    run: str
    prefix: str
    prompts: str
    traj: str
    weights: str
    events: str  # wildcard covering every events.* subject
    dead_letter: str
    # JetStream objects
    prompts_stream: str
    traj_stream: str
    weights_stream: str
    events_stream: str
    advisories_stream: str  # keeps the server's max-deliveries advisories of `prompts_consumer` until handled
    exhausted_advisory: str  # the server's subject of those advisories (JetStream's own `$JS.EVENT...` name)
    prompts_consumer: str  # shared durable pull consumer of every producer
    traj_consumer: str  # the trainer's durable pull consumer
    advisories_consumer: str  # the feeder's durable pull consumer of `advisories_stream`
    weights_bucket: str  # KV bucket; key "latest" holds the newest WeightsPublished

    @classmethod
    def for_run(cls, run: str) -> "Subjects":
        check_run_name(run)
        p = f"rlbus.{run}"
        up = run.replace("-", "_").upper()
        return cls(
            run=run,
            prefix=p,
            prompts=f"{p}.prompts",
            traj=f"{p}.traj",
            weights=f"{p}.weights",
            events=f"{p}.events.>",
            dead_letter=f"{p}.events.dead_letter",
            prompts_stream=f"RLBUS_{up}_PROMPTS",
            traj_stream=f"RLBUS_{up}_TRAJ",
            weights_stream=f"RLBUS_{up}_WEIGHTS",
            events_stream=f"RLBUS_{up}_EVENTS",
            advisories_stream=f"RLBUS_{up}_ADVISORIES",
            exhausted_advisory=f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.RLBUS_{up}_PROMPTS.producers",
            prompts_consumer="producers",
            traj_consumer="trainer",
            advisories_consumer="feeder",
            weights_bucket=f"rlbus_{run.replace('-', '_')}_weights",
        )

    def event(self, kind: str) -> str:
        """The subject of one event kind, e.g. `rlbus.<run>.events.step`."""
        return f"{self.prefix}.events.{kind}"
