"""`rlbus status` read from a real nats-server with the observer's credential: per-producer rate, version lag,
in-flight sizing and failure counts.

    .venv/bin/python -m pytest -q tests/integration/test_status.py
"""

from __future__ import annotations

import asyncio
import time

import pytest
from rich.console import Console

from rlbus.bus.client import Bus
from rlbus.cli.status import gather_status, render
from rlbus.schemas.config import BusConfig, ModelConfig, RunConfig
from rlbus.schemas.wire import ProducerHeartbeat, StepCompleted, WeightsPublished
from tests.support.nats_server import unique_run_name


def test_status_shows_each_producers_rate_and_version_lag(nats_server):
    run = unique_run_name("status")
    nats_server.add_run(run)
    admin = BusConfig(url=nats_server.url, creds_file=str(nats_server.creds_file("admin", run)))

    async def publish() -> None:
        async with await Bus.connect(admin, run, name="test") as bus:
            await bus.ensure_streams()
            now = time.time()
            for producer_id, version, beats in (("p0", 3, [(now - 30, 2), (now - 15, 7), (now, 12)]),
                                                ("p1", 1, [(now - 20, 0), (now, 1)])):
                # p0's heartbeats carry its in-flight sizing and failure counts; p1's predate them (their defaults)
                sizing = dict(inflight=3, inflight_limit=6, engine_idle=0.25, infra_failures=4, env_failures=2,
                              tool_retries=9) if producer_id == "p0" else {}
                for t, done in beats:
                    await bus.publish(bus.subjects.event(f"heartbeat.{producer_id}"), ProducerHeartbeat(
                        producer_id=producer_id, version=version, pid=1, groups_done=done, created_at=t, **sizing))
            await bus.publish_event(StepCompleted(step=4, version=4, group_ids=["g"]))
            await bus.kv_put("latest", WeightsPublished(version=4, step=4, num_bytes=1, checksum="00"))

    asyncio.run(publish())
    cfg = RunConfig(name=run, model=ModelConfig(path="unused"),
                    bus=BusConfig(url=nats_server.url, creds_file=str(nats_server.creds_file("observer", run))))
    st = asyncio.run(gather_status(cfg))
    assert {hb.producer_id: hb.groups_done for hb in st["heartbeats"]} == {"p0": 12, "p1": 1}
    assert st["rates"] == {"p0": pytest.approx(20.0), "p1": pytest.approx(3.0)}
    assert st["lags"] == {"p0": 1, "p1": 3}
    console = Console(record=True, width=160)
    for table in render(cfg, st):
        console.print(table)
    text = console.export_text()
    assert "lag" in text and "20.0" in text and "3.0" in text
    rows = {ln.split("│")[1].strip(): [c.strip() for c in ln.split("│")[1:-1]] for ln in text.splitlines()
            if ln.count("│") > 2 and ln.split("│")[1].strip() in ("p0", "p1")}
    assert rows["p0"][6:10] == ["3 / 6", "25%", "4 / 2", "9"]  # in flight / limit, engine idle, failures, retries
    assert rows["p1"][6:10] == ["0 / -", "-", "-", "-"]

