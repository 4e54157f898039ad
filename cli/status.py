"""`rlbus status CONFIG [overrides]`: what a run is doing, read from the bus alone.

    rlbus status configs/quickstart.yaml bus.url=nats://127.0.0.1:4222 bus.creds_file=.rlbus/bus/creds/quickstart/observer.json

Shows the trainer's step and version (last StepCompleted, the KV bucket's latest weights), every producer's id,
weight version, groups per minute and last heartbeat, the queue depths, and the staleness of recent steps.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from rich.console import Console
from rich.table import Table

from rlbus.bus.client import Bus
from rlbus.schemas.config import RunConfig
from rlbus.schemas.wire import ProducerHeartbeat, StepCompleted, WeightsPublished


def last_per_producer(beats: list[ProducerHeartbeat]) -> list[ProducerHeartbeat]:
    latest: dict[str, ProducerHeartbeat] = {}
    for hb in beats:  # in stream order: a later heartbeat of the same producer wins
        latest[hb.producer_id] = hb
    return list(latest.values())


async def gather_status(cfg: RunConfig) -> dict[str, Any]:
    async with await Bus.connect(cfg.bus, cfg.name, name="status") as bus:
        s = bus.subjects
        steps = await bus.snapshot(s.event("step"), StepCompleted, deliver="last")
        beats = last_per_producer(await bus.snapshot(s.event("heartbeat.*"), ProducerHeartbeat,
                                                     deliver="last_per_subject"))
        latest = await bus.kv_get("latest", WeightsPublished)
        prompts = await bus.stream_msgs(s.prompts_stream)
        pending, held = await bus.consumer_pending(s.traj_stream, s.traj_consumer)
    return {"step": steps[-1] if steps else None, "heartbeats": beats, "weights": latest,
            "prompts_queued": prompts, "groups_waiting": pending, "groups_held": held}


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
    head.add_row("prompts queued", str(st["prompts_queued"]))
    head.add_row("groups waiting / held by trainer", f"{st['groups_waiting']} / {st['groups_held']}")
    prod = Table(title="producers")
    for col in ("id", "host:pid", "version", "groups/min", "groups", "in flight", "status", "last heartbeat"):
        prod.add_column(col)
    for hb in sorted(st["heartbeats"], key=lambda h: h.producer_id):
        prod.add_row(hb.producer_id, f"{hb.host}:{hb.pid}", str(hb.version), f"{hb.groups_per_min:.1f}",
                     str(hb.groups_done), str(hb.inflight), hb.status, f"{time.time() - hb.created_at:.0f}s ago")
    return [head, prod]


def main(cfg: RunConfig) -> int:
    st = asyncio.run(gather_status(cfg))
    console = Console()
    for table in render(cfg, st):
        console.print(table)
    return 0
