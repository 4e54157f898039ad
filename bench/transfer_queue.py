"""TransferQueue throughput against raw ray.put / ray.get of the same trajectory tensors, in the same Ray.

    .venv/bin/python bench/transfer_queue.py                       # 256 trajectories x 2048 tokens
    .venv/bin/python bench/transfer_queue.py --trajectories 64 --tokens 512 --docs docs/benchmarks.md

A trajectory is input_ids int64, response_mask bool, logprobs float32 and versions int32, all [tokens] long.
Raw baselines: one ray.put per trajectory (a dict of numpy arrays: Ray's zero-copy path; and a dict of torch
tensors: Ray's default pickling of tensors), then one ray.get of all refs. TransferQueue: put_many, then get_list
(each key's tensors, unpadded: what trainer ranks fetch before collating). Throughput counts the tensors' bytes once per direction; the ratio
compares round trips (put + get) with the numpy baseline. Results go to bench/results/transfer_queue.json and,
with --docs, to the `## TransferQueue` section of that markdown file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

# Run as a script, sys.path[0] is bench/: put the repository root there instead, so `bench.common` imports.
sys.path[0] = str(Path(__file__).resolve().parents[1])

import ray  # noqa: E402
import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from bench.common import machine, machine_line, write_section  # noqa: E402
from rlbus.bus.ray_cluster import ensure_ray  # noqa: E402
from rlbus.bus.ray_store import pack_tensor, teardown  # noqa: E402
from rlbus.bus.transfer_queue import TransferQueue  # noqa: E402
from rlbus.schemas.config import RayConfig  # noqa: E402

SECTION = "## TransferQueue"


def make_batch(num: int, tokens: int) -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return {
        f"bench/{i}": {
            "input_ids": torch.randint(0, 150_000, (tokens,), generator=g),
            "response_mask": torch.rand(tokens, generator=g) > 0.3,
            "logprobs": -torch.rand(tokens, generator=g) * 5,
            "versions": torch.full((tokens,), i % 3, dtype=torch.int32),
        }
        for i in range(num)
    }


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def bench_raw(items: dict, repeats: int, as_numpy: bool) -> dict[str, list[float]]:
    values = [
        {f: pack_tensor(t)[1] for f, t in fields.items()} if as_numpy else dict(fields) for fields in items.values()
    ]
    puts, gets = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        refs = [ray.put(v) for v in values]
        t1 = time.perf_counter()
        got = ray.get(refs)
        if as_numpy:  # hand out tensors, as the TransferQueue does
            got = [{f: torch.from_numpy(a) for f, a in d.items()} for d in got]
        t2 = time.perf_counter()
        puts.append(t1 - t0)
        gets.append(t2 - t1)
        del refs, got
    return {"put": puts, "get": gets}


async def bench_tq(tq: TransferQueue, items: dict, repeats: int) -> dict[str, list[float]]:
    keys = list(items)
    res: dict[str, list[float]] = {"put": [], "get": []}
    for _ in range(repeats):
        t0 = time.perf_counter()
        await tq.put_many(items)
        t1 = time.perf_counter()
        listed = await tq.get_list(keys)
        t2 = time.perf_counter()
        assert len(listed) == len(keys)
        await tq.delete(keys)
        res["put"].append(t1 - t0)
        res["get"].append(t2 - t1)
    return res


def write_docs(path: Path, report: dict) -> None:
    rows = report["rows"]
    lines = [
        SECTION,
        "",
        f"Command: `{report['command']}`  ",
        machine_line(report["machine"]) + f" Ray {report['machine']['ray']} (a shared machine: absolute numbers "
        "are noisy; the ratio is measured in the same run).  ",
        f"Batch: {report['trajectories']} trajectories x {report['tokens']} tokens "
        f"({report['batch_mb']:.1f} MB: input_ids int64, response_mask bool, logprobs float32, versions int32), "
        f"{report['shards']} shards, median of {report['repeats']} repeats.",
        "",
        "| path | put GB/s | get GB/s | round trip GB/s | round trip items/s |",
        "|---|---|---|---|---|",
        *(
            f"| {r['path']} | {r['put_gbps']:.2f} | {r['get_gbps']:.2f} | {r['round_trip_gbps']:.2f} | "
            f"{r['round_trip_items_per_s']:.0f} |"
            for r in rows
        ),
        "",
        f"TransferQueue round trip (put_many + get_list) / raw numpy ray.put+ray.get: **{report['ratio']:.2f}** "
        "(target >= 0.7). Why it is faster: one actor call per shard carries the whole batch, and a get returns one "
        "flat array per field, instead of one Ray object per trajectory.",
        "",
    ]
    write_section(SECTION, "\n".join(lines), path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trajectories", type=int, default=256)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--address", default="", help="Ray address; '' starts a local loopback head for the run")
    p.add_argument("--json", default="bench/results/transfer_queue.json")
    p.add_argument("--docs", default="", help="markdown file whose `## TransferQueue` section is (re)written")
    args = p.parse_args()
    torch.set_num_threads(1)

    items = make_batch(args.trajectories, args.tokens)
    num_bytes = sum(t.numel() * t.element_size() for fields in items.values() for t in fields.values())
    cfg = RayConfig(
        address=args.address,
        num_storage_actors=args.shards,
        capacity_bytes=4 * num_bytes + 1024**2,
        object_store_memory=max(4 * num_bytes, 512 * 1024**2),
    )
    ensure_ray(cfg)
    run = f"bench-{os.getpid()}"
    tq = TransferQueue.connect(run, cfg)
    asyncio.run(bench_tq(tq, items, 1))  # warm-up: actor workers, code paths
    bench_raw(items, 1, as_numpy=True)

    results = {
        "raw ray.put/get (numpy)": bench_raw(items, args.repeats, as_numpy=True),
        "raw ray.put/get (torch)": bench_raw(items, args.repeats, as_numpy=False),
    }
    tq_times = asyncio.run(bench_tq(tq, items, args.repeats))
    results["TransferQueue put_many + get_list"] = tq_times
    teardown(run, cfg)

    rows = []
    for path, t in results.items():
        put, get = statistics.median(t["put"]), statistics.median(t["get"])
        rows.append(
            {
                "path": path,
                "put_s": put,
                "get_s": get,
                "put_gbps": num_bytes / put / 1e9,
                "get_gbps": num_bytes / get / 1e9,
                "round_trip_gbps": 2 * num_bytes / (put + get) / 1e9,
                "round_trip_items_per_s": args.trajectories / (put + get),
                "times": t,
            }
        )
    ratio = rows[2]["round_trip_gbps"] / rows[0]["round_trip_gbps"]
    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine(ray=ray.__version__),
        "trajectories": args.trajectories,
        "tokens": args.tokens,
        "batch_mb": num_bytes / 1e6,
        "shards": args.shards,
        "repeats": args.repeats,
        "rows": rows,
        "ratio": ratio,
    }

    title = f"TransferQueue vs raw Ray: {args.trajectories} x {args.tokens} tokens ({num_bytes / 1e6:.1f} MB)"
    table = Table(title=title)
    for col in ("path", "put ms", "get ms", "put GB/s", "get GB/s", "round trip GB/s", "items/s"):
        table.add_column(col, justify="left" if col == "path" else "right")
    for r in rows:
        table.add_row(
            r["path"], f"{r['put_s'] * 1e3:.1f}", f"{r['get_s'] * 1e3:.1f}", f"{r['put_gbps']:.2f}",
            f"{r['get_gbps']:.2f}", f"{r['round_trip_gbps']:.2f}", f"{r['round_trip_items_per_s']:.0f}",
        )  # fmt: skip
    console = Console(width=130)
    console.print(table)
    console.print(f"round-trip ratio TransferQueue / raw numpy: [bold]{ratio:.2f}[/bold] (target >= 0.7)")

    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    if args.docs:
        write_docs(Path(args.docs), report)


if __name__ == "__main__":
    main()
