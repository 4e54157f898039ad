"""Bus throughput: TrajectoryGroup events per second through rlbus's client, side by side with raw nats-py.

    .venv/bin/python bench/bus.py --events 5000

Starts an embedded nats-server (JetStream, file storage) and, in alternating rounds, moves N TrajectoryGroup events
(n=8 SampleMeta each, a realistic GRPO group) end to end:

- rlbus: Bus.publish (encode, Nats-Msg-Id, JetStream ack) -> Bus.pull (batched fetch, typed decode) -> Delivery.ack
  (double ack);
- raw:   js.publish of the same bytes with the same header -> pull_subscribe_bind + fetch -> msg.ack_sync, no decode.

Publisher and consumer run concurrently; the rate is N / (time until the last ack). The ratio rlbus/raw is the
client's overhead (target >= 0.8). Writes bench/results/bus.json and the "## Bus" section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Run as a script, sys.path[0] is bench/: put the repository root there instead, so `bench.common` imports.
sys.path[0] = str(Path(__file__).resolve().parents[1])

from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StorageType, StreamConfig
from rich.console import Console
from rich.table import Table

from bench.common import machine, write_section
from rlbus.bus.client import Bus
from rlbus.bus.loop import run as run_loop
from rlbus.bus.server import EmbeddedServer, find_nats_server
from rlbus.schemas.config import BusConfig
from rlbus.schemas.wire import SampleMeta, TrajectoryGroup, encode

ROOT = Path(__file__).resolve().parents[1]
TARGET_RATIO = 0.8
BATCH = 64


def make_group(i: int) -> TrajectoryGroup:
    samples = [
        SampleMeta(
            key=f"run/g{i}/{j}", prompt_len=180, response_len=420 + j, reward=float(j % 2), num_tool_calls=2,
            num_turns=3, finish_reason="stop", min_version=11, max_version=12, gen_time_s=3.2, tool_time_s=0.05,
            reward_time_s=0.001,
        )
        for j in range(8)
    ]
    return TrajectoryGroup(
        group_id=f"g{i}", task_id=f"g{i}", producer_id="producer-0", samples=samples, data_source="arith", index=i
    )


async def bench_rlbus(cfg: BusConfig, groups: list[TrajectoryGroup], round_no: int) -> float:
    async with await Bus.connect(cfg, f"bench-{round_no}", "bench") as bus:
        await bus.ensure_streams()
        s = bus.subjects
        t0 = time.perf_counter()

        async def produce() -> None:
            for g in groups:
                await bus.publish(s.traj, g, msg_id=g.group_id)

        producer = asyncio.create_task(produce())
        n = 0
        async for d in bus.pull(s.traj, s.traj_consumer, TrajectoryGroup, batch=BATCH, timeout=1.0):
            await d.ack()
            n += 1
            if n == len(groups):
                break
        elapsed = time.perf_counter() - t0
        await producer
        # Leave the server as the raw round does (no streams left over), so rounds stay comparable.
        for stream in (s.prompts_stream, s.traj_stream, s.weights_stream, s.events_stream, f"KV_{s.weights_bucket}"):
            await bus.js.delete_stream(stream)
        return len(groups) / elapsed


async def bench_raw(cfg: BusConfig, payloads: list[tuple[str, bytes]], round_no: int) -> float:
    import nats

    creds = json.loads(Path(cfg.creds_file).read_text())
    nc = await nats.connect(cfg.url, user=creds["user"], password=creds["password"])
    js = nc.jetstream()
    stream, subject = f"BENCH_RAW_{round_no}", f"bench.raw.{round_no}"
    await js.add_stream(
        StreamConfig(
            name=stream, subjects=[subject], retention=RetentionPolicy.LIMITS, storage=StorageType.FILE,
            duplicate_window=300.0,
        )
    )
    await js.add_consumer(stream, ConsumerConfig(durable_name="raw", ack_policy=AckPolicy.EXPLICIT, ack_wait=60.0))
    sub = await js.pull_subscribe_bind(durable="raw", stream=stream)
    t0 = time.perf_counter()

    async def produce() -> None:
        for msg_id, data in payloads:
            await js.publish(subject, data, headers={"Nats-Msg-Id": msg_id})

    producer = asyncio.create_task(produce())
    n = 0
    while n < len(payloads):
        try:
            msgs = await sub.fetch(BATCH, timeout=1.0)
        except nats.errors.TimeoutError:
            continue
        for m in msgs:
            await m.ack_sync()
            n += 1
    elapsed = time.perf_counter() - t0
    await producer
    await js.delete_stream(stream)
    await nc.close()
    return len(payloads) / elapsed


async def bench(num_events: int, rounds: int, store: Path) -> dict[str, Any]:
    with EmbeddedServer(store) as server:
        cfg = BusConfig(url=server.url, creds_file=str(server.creds_file))
        groups = [make_group(i) for i in range(num_events)]
        payloads = [(g.group_id, encode(g)) for g in groups]
        raw_rates: list[float] = []
        bus_rates: list[float] = []
        raw_cpu: list[float] = []
        bus_cpu: list[float] = []
        # Alternate so that drift on a shared machine (other processes, page cache) hits both sides alike. Client CPU
        # time per event (this process only) is reported too: it is the client's own cost, and it is much less
        # disturbed by other load than the wall-clock rate is.
        for r in range(rounds):
            c0 = time.process_time()
            raw_rates.append(await bench_raw(cfg, payloads, r))
            raw_cpu.append((time.process_time() - c0) / num_events * 1e6)
            c0 = time.process_time()
            bus_rates.append(await bench_rlbus(cfg, groups, r))
            bus_cpu.append((time.process_time() - c0) / num_events * 1e6)
    raw, rl = statistics.median(raw_rates), statistics.median(bus_rates)
    return {
        "events": num_events,
        "rounds": rounds,
        "batch": BATCH,
        "payload_bytes": len(payloads[0][1]),
        "raw_events_per_s": round(raw, 1),
        "rlbus_events_per_s": round(rl, 1),
        "ratio": round(rl / raw, 3),
        "target_ratio": TARGET_RATIO,
        "raw_client_cpu_us_per_event": round(statistics.median(raw_cpu), 1),
        "rlbus_client_cpu_us_per_event": round(statistics.median(bus_cpu), 1),
        "raw_rounds": [round(x, 1) for x in raw_rates],
        "rlbus_rounds": [round(x, 1) for x in bus_rates],
    }


def bus_machine() -> dict[str, Any]:
    server_version = subprocess.run(
        [str(find_nats_server()), "--version"], capture_output=True, text=True, check=True
    ).stdout.strip()
    try:
        import uvloop

        loop = f"uvloop {uvloop.__version__}"
    except ImportError:
        loop = "asyncio"
    return machine(nats_server=server_version, nats_py=importlib.metadata.version("nats-py"),
                   msgspec=importlib.metadata.version("msgspec"), event_loop=loop)


def bus_section(res: dict[str, Any], mach: dict[str, Any], command: str) -> str:
    verdict = "meets" if res["ratio"] >= TARGET_RATIO else "is below"
    return "\n".join(
        [
            "## Bus",
            "",
            "TrajectoryGroup events (n=8 SampleMeta, "
            f"{res['payload_bytes']} bytes msgpack) per second, end to end: publish (JetStream ack, Nats-Msg-Id) -> "
            "file-backed stream -> pull (fetch batch "
            f"{res['batch']}) -> decode -> double ack; publisher and consumer concurrent on one event loop. "
            "`raw` is nats-py with the same bytes, header and ack mode, without decoding. Both wait for each ack: "
            "these are the rates of one sequential producer and one consumer. "
            f"Command: `{command}`. "
            f"Machine: {mach['cpu_model']}, {mach['cores']} cores shared with other work; {mach['event_loop']}; "
            f"{mach['nats_server']}; nats-py {mach['nats_py']}; msgspec {mach['msgspec']}.",
            "",
            "| path | events/s (median of rounds) | client CPU us/event (median) | events/s per round |",
            "|---|---:|---:|---|",
            f"| raw nats-py | {res['raw_events_per_s']:,.0f} | {res['raw_client_cpu_us_per_event']:.0f} | "
            f"{', '.join(f'{x:,.0f}' for x in res['raw_rounds'])} |",
            f"| rlbus Bus | {res['rlbus_events_per_s']:,.0f} | {res['rlbus_client_cpu_us_per_event']:.0f} | "
            f"{', '.join(f'{x:,.0f}' for x in res['rlbus_rounds'])} |",
            "",
            f"Ratio rlbus/raw: **{res['ratio']:.2f}** ({verdict} the {TARGET_RATIO} target); {res['events']} events "
            f"per round, {res['rounds']} rounds alternating raw and rlbus. Rates swing by tens of percent between "
            "rounds on a shared machine; the client CPU column is the steadier measure of what the rlbus layer adds.",
            "",
        ]
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--events", type=int, default=3000, help="events per round")
    p.add_argument("--rounds", type=int, default=8, help="rounds per path (alternating); the median is reported")
    p.add_argument("--results", default=str(ROOT / "bench" / "results" / "bus.json"))
    p.add_argument("--docs", default=str(ROOT / "docs" / "benchmarks.md"), help="'' to skip writing the docs")
    args = p.parse_args()
    command = "python bench/bus.py " + " ".join(sys.argv[1:]) if sys.argv[1:] else "python bench/bus.py"

    with tempfile.TemporaryDirectory(prefix="rlbus-bench-") as store:
        res = run_loop(bench(args.events, args.rounds, Path(store)))
    mach = bus_machine()

    table = Table(title=f"Bus: TrajectoryGroup events/s ({args.events} events x {args.rounds} rounds)")
    table.add_column("path")
    table.add_column("events/s (median)", justify="right")
    table.add_column("client CPU us/event", justify="right")
    table.add_column("events/s per round", justify="right")
    for label, key in (("raw nats-py", "raw"), ("rlbus Bus", "rlbus")):
        table.add_row(
            label,
            f"{res[key + '_events_per_s']:,.0f}",
            f"{res[key + '_client_cpu_us_per_event']:.0f}",
            ", ".join(f"{x:,.0f}" for x in res[key + "_rounds"]),
        )
    ok = res["ratio"] >= TARGET_RATIO
    table.add_row("ratio", f"[{'green' if ok else 'red'}]{res['ratio']:.2f}[/]", "", f"target >= {TARGET_RATIO}")
    Console().print(table)

    out = Path(args.results)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**res, "machine": mach, "command": command}, indent=2) + "\n")
    if args.docs:
        write_section("## Bus", bus_section(res, mach, command), Path(args.docs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
