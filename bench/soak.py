"""A bounded soak: a long `rlbus up` on the simulated engine with many producers, producers SIGKILLed now and then,
and the resources that must stay flat sampled all along: every process's RSS, the TransferQueue's stored items
(back to the groups in flight, not growing with the run), the streams' sizes (bounded by `bus.max_age_s`).

    .venv/bin/python bench/soak.py                       # ~12 minutes here: 8 producers, 16000 groups
    .venv/bin/python bench/soak.py --steps 60 --docs ""  # a quick look, nothing written to the docs

Writes bench/results/soak.json and the "Soak" section of docs/reliability.md. The bench starts the nats-server and
the Ray head itself (so it can read the TransferQueue and the streams while the run goes on) and signals only
processes it started, by pid. Ends with the ledger check (`rlbus events RUN_DIR --ledger`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path[0] = str(Path(__file__).resolve().parents[1])  # so that `bench.common` imports

from bench.common import machine, machine_line, write_section  # noqa: E402
from rlbus.bus.proc import command_line, descendants  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RELIABILITY = ROOT / "docs" / "reliability.md"
RLBUS = [sys.executable, "-m", "rlbus.cli"]


def _rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except FileNotFoundError:
        return None
    return None


def _roles(launcher: int) -> dict[str, int]:
    """role name -> pid of the launcher's live roles (`rlbus.cli trainer`, `rlbus.cli producer ... --id pN`)."""
    out = {}
    for pid in descendants(launcher):
        argv = command_line(pid)
        if len(argv) > 3 and argv[3] == "trainer":
            out["trainer"] = pid
        elif len(argv) > 3 and argv[3] == "producer":
            out[f"producer {argv[argv.index('--id') + 1]}" if "--id" in argv else f"producer {pid}"] = pid
    return out


def _config(args: argparse.Namespace, run_dir: Path, model: Path) -> dict[str, Any]:
    return {
        "name": args.name,
        "model": {"path": str(model)},
        "data": {"type": "synthetic", "num_examples": 4096},
        "rollout": {"engine": {"type": "simulated", "mean_tokens": 24, "tail_alpha": 2.0,
                               "seconds_per_token": 0.004, "seed": 0},
                    "agent_loop": "single_turn", "tools": [], "n": 4, "max_new_tokens": 96,
                    "max_response_tokens": 96, "num_producers": args.producers, "heartbeat_interval_s": 2.0},
        "trainer": {"total_steps": args.steps, "groups_per_step": 8, "max_staleness": 2, "micro_batch_size": 32,
                    "lr": 1e-4, "checkpoint_interval": 10},
        "bus": {"ack_wait_s": 10.0, "max_age_s": args.max_age_s},
        "ray": {"num_storage_actors": 2, "capacity_bytes": 512 * 1024**2},
        "logging": {"run_dir": str(run_dir), "tensorboard": False, "plot": False, "record": "off"},
    }


async def _bus_sizes(bus_cfg: Any, run: str) -> dict[str, int]:
    from rlbus.bus.client import Bus

    async with await Bus.connect(bus_cfg, run, name="soak") as bus:
        s = bus.subjects
        return {name: await bus.stream_msgs(stream) for name, stream in
                (("prompts", s.prompts_stream), ("traj", s.traj_stream), ("weights", s.weights_stream),
                 ("events", s.events_stream))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=2000, help="optimizer steps (8 groups each)")
    ap.add_argument("--producers", type=int, default=8)
    ap.add_argument("--kill-every-s", type=float, default=25.0, help="mean seconds between producer SIGKILLs")
    ap.add_argument("--sample-every-s", type=float, default=5.0)
    ap.add_argument("--max-age-s", type=float, default=300.0, help="bus.max_age_s of the run's streams (>= 300)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the kill schedule")
    ap.add_argument("--name", default="soak")
    ap.add_argument("--results", default=str(ROOT / "bench" / "results" / "soak.json"))
    ap.add_argument("--docs", default=str(RELIABILITY), help='page to write the "Soak" section to ("" = none)')
    ap.add_argument("--render", default="", help="only rewrite the docs section from a results file")
    args = ap.parse_args()
    if args.render:
        result = json.loads(Path(args.render).read_text())
        write_section("## Soak", _section(result, args), Path(args.docs))
        return 0

    import msgspec

    from rlbus.bus.ray_cluster import ensure_ray, start_ray_head, stop_ray_head
    from rlbus.bus.server import EmbeddedServer
    from rlbus.bus.transfer_queue import TransferQueue
    from rlbus.schemas.config import BusConfig, RayConfig
    from rlbus.trainer.metrics import read_metrics

    root = Path(tempfile.mkdtemp(prefix="rlbus-soak-"))
    model = ROOT / ".rlbus" / "models" / "bench-random"
    if not (model / "config.json").is_file():
        subprocess.run([*RLBUS, "init-model", str(model), "--steps", "0", "--threads", "1"], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL)
    run_dir = root / "run"
    server = EmbeddedServer(root / "bus", runs=[args.name]).start()
    head = start_ray_head(object_store_memory=1_000_000_000)
    os.environ.update(head.env)
    ray_cfg = RayConfig(address=head.address, num_storage_actors=2, capacity_bytes=512 * 1024**2)
    ensure_ray(ray_cfg)
    cfg = _config(args, run_dir, model)
    cfg["bus"].update(url=server.url, creds_file=str(server.creds_file("admin", args.name)))
    cfg["ray"]["address"] = head.address
    cfg_path = root / "soak.yaml"
    cfg_path.write_text(json.dumps(cfg))  # JSON is YAML
    admin = msgspec.structs.replace(BusConfig(), url=server.url, creds_file=str(server.creds_file("admin", args.name)))
    rng = random.Random(args.seed)
    samples: list[dict[str, Any]] = []
    kills: list[dict[str, Any]] = []
    log = open(root / "up.log", "wb")
    t0 = time.monotonic()
    up = subprocess.Popen([*RLBUS, "up", str(cfg_path)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
    tq = None
    next_kill = t0 + rng.expovariate(1 / args.kill_every_s) + 20
    next_sample = t0
    try:
        while up.poll() is None:
            now = time.monotonic()
            roles = _roles(up.pid)
            rows = read_metrics(run_dir) if now >= next_sample and "trainer" in roles else []
            if rows:  # from the first step on: the streams and shards exist by then
                next_sample = now + args.sample_every_s
                if tq is None:
                    tq = TransferQueue.connect(args.name, ray_cfg)  # the run's shards, by name
                stats = tq.stats_sync() if tq is not None else {"items": 0, "bytes": 0}
                sample = {"t": round(now - t0, 1), "step": rows[-1]["step"] if rows else 0,
                          "rss_mb": {r: _rss_mb(p) for r, p in roles.items()} | {"nats-server": _rss_mb(server.pid)},
                          "tq_items": stats["items"], "tq_bytes": stats["bytes"],
                          "streams": asyncio.run(_bus_sizes(admin, args.name))}
                samples.append(sample)
                print(f"t={sample['t']:6.1f}s step {sample['step']:4d} tq {sample['tq_items']:4d} items "
                      f"streams {sample['streams']} trainer {sample['rss_mb'].get('trainer') or 0:.0f} MB", flush=True)
            producers = [r for r in roles if r.startswith("producer")]
            if now >= next_kill and producers:
                victim = rng.choice(sorted(producers))
                os.kill(roles[victim], signal.SIGKILL)  # a child of the launcher this bench started, by pid
                kills.append({"t": round(now - t0, 1), "producer": victim})
                print(f"t={now - t0:6.1f}s SIGKILL {victim}", flush=True)
                next_kill = now + rng.expovariate(1 / args.kill_every_s)
            time.sleep(0.5)
        wall = time.monotonic() - t0
        code = up.returncode
    finally:
        try:
            if up.poll() is None:
                up.send_signal(signal.SIGTERM)
                up.wait(timeout=120)
        except subprocess.TimeoutExpired:  # the launcher did not stop: end the process group this bench started
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()
        finally:
            log.close()
    try:
        ledger = subprocess.run([*RLBUS, "events", str(run_dir), "--ledger", "--json"], capture_output=True,
                                text=True)
    finally:
        stop_ray_head(head)
        server.stop()
    rows = read_metrics(run_dir)
    groups = sum(int(r.get("groups", 8)) for r in rows) if rows else 0
    result = {"machine": machine(), "config": cfg, "exit_code": code, "wall_s": round(wall, 1),
              "steps": rows[-1]["step"] if rows else 0, "groups_trained": len(rows) * 8, "groups_counted": groups,
              "kills": kills, "samples": samples, "ledger_exit": ledger.returncode,
              "ledger": json.loads(ledger.stdout) if ledger.stdout.strip().startswith("{") else ledger.stdout[-2000:]}
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(json.dumps(result, indent=1) + "\n")
    print(f"exit {code}, {result['steps']} steps in {wall:.0f}s, {len(kills)} producer kills, "
          f"ledger exit {ledger.returncode}; {args.results}")
    if args.docs:
        write_section("## Soak", _section(result, args), Path(args.docs))
    return 0 if code == 0 and ledger.returncode == 0 else 1


def _flat(values: list[float]) -> str:
    """The median of each quarter of the run, and the peak."""
    values = [v for v in values if v is not None]
    if len(values) < 4:
        return "n/a"
    q = len(values) / 4
    quarters = [statistics.median(values[round(i * q):round((i + 1) * q)]) for i in range(4)]
    return " / ".join(f"{v:.0f}" for v in quarters) + f" (peak {max(values):.0f})"


def _section(r: dict[str, Any], args: argparse.Namespace) -> str:
    s = r["samples"]
    # Memory after warm-up: the first quarter starts once every process has loaded what it keeps.
    roles = sorted({k for x in s for k in x["rss_mb"]}, key=lambda k: (not k.startswith("trainer"), k))
    lines = [
        "## Soak",
        "",
        f"`python bench/soak.py --steps {args.steps} --producers {args.producers} --kill-every-s "
        f"{args.kill_every_s:g} --max-age-s {args.max_age_s:g} --seed {args.seed}`: the simulated engine, "
        f"{args.producers} producers, {r['steps']} steps x 8 groups of 4 ({r['groups_trained']} groups) in "
        f"{r['wall_s']:.0f} s, {len(r['kills'])} producer SIGKILLs at random moments; exit code {r['exit_code']}, "
        f"ledger check exit {r['ledger_exit']}. Sampled every {args.sample_every_s:g} s ({len(s)} samples).",
        "",
        "| what | median of each quarter of the run (peak) |",
        "|---|---|",
    ]
    for role in roles:
        if role.startswith("producer"):
            continue
        lines.append(f"| RSS of {role}, MB | {_flat([x['rss_mb'].get(role) for x in s])} |")
    prod = [statistics.mean([v for k, v in x["rss_mb"].items() if k.startswith("producer") and v]) for x in s
            if any(k.startswith("producer") and v for k, v in x["rss_mb"].items())]
    lines.append(f"| RSS of a producer (mean over the live ones), MB | {_flat(prod)} |")
    lines.append(f"| TransferQueue items stored | {_flat([x['tq_items'] for x in s])} |")
    for stream in ("prompts", "traj", "weights", "events"):
        lines.append(f"| `{stream}` stream messages | {_flat([x['streams'][stream] for x in s])} |")
    trainer = [x["rss_mb"].get("trainer") for x in s if x["rss_mb"].get("trainer")]
    if len(trainer) >= 8:
        q = len(trainer) // 4
        grew = statistics.median(trainer[-q:]) - statistics.median(trainer[:q])
        lines += ["", f"The trainer's RSS moved {grew:+.0f} MB from the first quarter to the last, "
                      f"{1024 * grew / max(1, r['steps']):+.0f} KB per step over the run's {r['steps']} steps "
                      "(not yet traced to a cause)."]
    lines += ["", machine_line(r["machine"]), "",
              "The TransferQueue holds the groups in flight and those trained since the last checkpoint: a task's keys "
              "(a killed producer's unpublished ones too) are freed once the checkpoint that makes its step durable "
              "is written. The `traj`, `weights` and `events` streams grow until their oldest messages reach "
              f"`bus.max_age_s` ({args.max_age_s:g} s) and stay flat from there; the `prompts` work queue holds only "
              "what admission released and no producer took yet."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
