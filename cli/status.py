"""`rlbus status CONFIG [overrides]`: what a run is doing, read from the bus alone.

    rlbus status configs/quickstart.yaml bus.url=nats://127.0.0.1:4222 bus.creds_file=.rlbus/bus/creds/quickstart/observer.json

Shows the trainer's step and version (last StepCompleted, the KV bucket's latest weights), every producer's id,
weight version and its lag behind the trainer's, its rate (groups per minute over the last RATE_WINDOW_S of its
heartbeats) and last heartbeat, its tasks in flight against the limit it allows itself now, its engine's idle share,
its failure counts since its process started (tasks failed by infrastructure / by the environment, tool calls
retried; "-" where its heartbeat predates them), the queue depths, the staleness of recent steps, and the stability
guard's last action (events.guard).

    .venv/bin/python -m pytest -q tests/unit/test_status.py tests/integration/test_status.py
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from rlbus.bus.client import Bus
from rlbus.schemas.config import RunConfig
from rlbus.cli.progress import describe_guard_action
from rlbus.cli.ui_index import sizing_reported
from rlbus.schemas.wire import GuardAction, ProducerHeartbeat, StepCompleted, WeightsPublished

#: Heartbeats this recent give a producer's rate.
RATE_WINDOW_S = 60.0
#: A producer silent for this many heartbeat intervals shows as silent.
SILENT_AFTER_INTERVALS = 3


def last_per_producer(beats: list[ProducerHeartbeat]) -> list[ProducerHeartbeat]:
    latest: dict[str, ProducerHeartbeat] = {}
    for hb in beats:  # in stream order: a later heartbeat of the same producer wins
        latest[hb.producer_id] = hb
    return list(latest.values())


def producer_rates(beats: list[ProducerHeartbeat]) -> dict[str, float]:
    """Groups per minute of each producer, from the first and last of its heartbeats given (in stream order).

    Only the heartbeats of its latest process count (a restarted producer counts from zero again); with a single
    heartbeat, the rate the producer itself reported.
    """
    runs: dict[str, list[ProducerHeartbeat]] = {}
    for hb in beats:
        mine = runs.setdefault(hb.producer_id, [])
        if mine and ((mine[-1].pid, mine[-1].host) != (hb.pid, hb.host) or hb.groups_done < mine[-1].groups_done):
            mine.clear()  # a new process under the same id
        mine.append(hb)
    out = {}
    for producer_id, mine in runs.items():
        first, last = mine[0], mine[-1]
        dt = last.created_at - first.created_at
        out[producer_id] = (last.groups_done - first.groups_done) / dt * 60.0 if dt > 0 else last.groups_per_min
    return out


def version_lag(trainer_version: int | None, hb: ProducerHeartbeat) -> int | None:
    """How many versions the producer's engine is behind the trainer's newest (None before any is published)."""
    return None if trainer_version is None else trainer_version - hb.version


def sizing_cells(hb: ProducerHeartbeat) -> tuple[str, str, str, str]:
    """The producers table's "in flight / limit", "engine idle", "failures infra / env" and "tool retries" cells;
    "-" for what a heartbeat from before these fields does not say."""
    if not sizing_reported(hb):
        return f"{hb.inflight} / -", "-", "-", "-"
    return (f"{hb.inflight} / {hb.inflight_limit}", f"{hb.engine_idle:.0%}", f"{hb.infra_failures} / {hb.env_failures}",
            str(hb.tool_retries))


async def recent(bus: Bus, subject: str, typ: Any, since_s: float, timeout: float = 30.0) -> list[Any]:
    """What the stream holds for `subject` from `since_s` seconds ago to now."""
    return await bus.snapshot(subject, typ, since_s=since_s, timeout=timeout)


async def gather_status(cfg: RunConfig) -> dict[str, Any]:
    async with await Bus.connect(cfg.bus, cfg.name, name="status") as bus:
        s = bus.subjects
        steps = await bus.snapshot(s.event("step"), StepCompleted, deliver="last")
        guard = await bus.snapshot(s.event("guard"), GuardAction, deliver="last")
        beats = last_per_producer(await bus.snapshot(s.event("heartbeat.*"), ProducerHeartbeat,
                                                     deliver="last_per_subject"))
        window = await recent(bus, s.event("heartbeat.*"), ProducerHeartbeat, RATE_WINDOW_S) if beats else []
        latest = await bus.kv_get("latest", WeightsPublished)
        prompts = await bus.stream_msgs(s.prompts_stream)
        pending, held = await bus.consumer_pending(s.traj_stream, s.traj_consumer)
    version = latest.version if latest else (steps[-1].version if steps else None)
    rates = producer_rates(window)
    return {"step": steps[-1] if steps else None, "guard": guard[-1] if guard else None, "heartbeats": beats,
            "weights": latest,
            "prompts_queued": prompts, "groups_waiting": pending, "groups_held": held,
            "rates": {hb.producer_id: rates.get(hb.producer_id, 0.0) for hb in beats},
            "lags": {hb.producer_id: version_lag(version, hb) for hb in beats}}


def render(cfg: RunConfig, st: dict[str, Any]) -> list[Any]:
    step: StepCompleted | None = st["step"]
    weights: WeightsPublished | None = st["weights"]
    head = Table(title=f"run {cfg.name}", show_header=False)
    head.add_column()
    head.add_column()
    head.add_row("trainer step", f"{step.step}/{cfg.trainer.total_steps}" if step else "no step yet")
    head.add_row("weights version", str(weights.version) if weights else "none published")
    if step:
        m = step.metrics
        head.add_row("reward (last step)", f"{m.get('reward/mean', float('nan')):.3f}")
        head.add_row("staleness mean / max", f"{m.get('staleness/mean', 0):.2f} / {m.get('staleness/max', 0):.0f}")
        head.add_row("last step", f"{time.time() - step.created_at:.0f}s ago")
    guard: GuardAction | None = st.get("guard")
    if guard is not None:  # the stability guard's last action (trainer/guard.py)
        age = time.time() - guard.created_at
        head.add_row("guard (last action)", f"{describe_guard_action(guard)} ({age:.0f}s ago)")
    head.add_row("prompts queued", str(st["prompts_queued"]))
    head.add_row("groups waiting / held by trainer", f"{st['groups_waiting']} / {st['groups_held']}")
    prod = Table(title=f"producers (groups/min over the last {RATE_WINDOW_S:.0f}s of heartbeats)")
    for col in ("id", "host:pid", "version", "lag", "groups/min", "groups", "in flight / limit", "engine idle",
                "failures infra / env", "tool retries", "status", "last heartbeat"):
        prod.add_column(col)
    silent_after = SILENT_AFTER_INTERVALS * cfg.rollout.heartbeat_interval_s
    for hb in sorted(st["heartbeats"], key=lambda h: h.producer_id):
        age = time.time() - hb.created_at
        lag = st["lags"].get(hb.producer_id)
        prod.add_row(hb.producer_id, f"{hb.host}:{hb.pid}", str(hb.version), "-" if lag is None else str(lag),
                     f"{st['rates'].get(hb.producer_id, 0.0):.1f}", str(hb.groups_done), *sizing_cells(hb),
                     "silent" if age > silent_after else hb.status, f"{age:.0f}s ago")
    return [head, prod]


def main(cfg: RunConfig) -> int:
    st = asyncio.run(gather_status(cfg))
    console = Console()
    for table in render(cfg, st):
        console.print(table)
    return 0
