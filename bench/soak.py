"""A bounded soak: a long `rlbus up` on the simulated engine with many producers, producers SIGKILLed now and then,
and the resources that must stay flat sampled all along: every process's RSS, the TransferQueue's stored items
(back to the groups in flight, not growing with the run), the streams' sizes (bounded by `bus.max_age_s`).

    .venv/bin/python bench/soak.py                       # ~12 minutes here: 8 producers, 16000 groups
    .venv/bin/python bench/soak.py --steps 60 --docs ""  # a quick look, nothing written to the docs
    .venv/bin/python bench/soak.py --nemesis --steps 600 --faults 14 --producers 6   # faults of every kind

Writes bench/results/soak.json and the "Soak" section of docs/reliability.md. With `--nemesis`, faults of every kind
(bench/nemesis.py) are drawn from the seed instead of producer kills alone, the Ray head is on 127.0.0.2 with a
second node on 127.0.0.3, and the results go to bench/results/nemesis.json and the "Nemesis" section. The bench starts the nats-server and
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
import threading
import time
from pathlib import Path
from typing import Any

sys.path[0] = str(Path(__file__).resolve().parents[1])  # so that `bench.common` imports

from bench.common import machine, machine_line, write_section
from bench.nats_nemesis import Steps
from bench.nemesis import FAULT_KINDS, HEAD_IP, Nemesis, forged_outcome, schedule
from rlbus.bus.proc import command_line, descendants

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
        # The event log (no payloads) is what the ledger check reads: with "off" it checks nothing and passes.
        "logging": {"run_dir": str(run_dir), "tensorboard": False, "plot": False, "record": "metadata"},
    }


async def _bus_sizes(bus_cfg: Any, run: str) -> dict[str, int]:
    from rlbus.bus.client import Bus

    async with asyncio.timeout(15), await Bus.connect(bus_cfg, run, name="soak") as bus:
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
    ap.add_argument("--seed", type=int, default=None, help="seed of the kill / fault schedule (default: drawn)")
    ap.add_argument("--nemesis", action="store_true", help="faults of every kind (bench/nemesis.py), not only kills")
    ap.add_argument("--faults", type=int, default=14, help="--nemesis: how many faults")
    ap.add_argument("--kinds", default=",".join(FAULT_KINDS), help="--nemesis: the fault kinds drawn from")
    ap.add_argument("--stuck-s", type=float, default=600.0, help="give up after this long without a new step")
    ap.add_argument("--name", default="soak")
    ap.add_argument("--results", default="", help="default: bench/results/soak.json (nemesis.json with --nemesis)")
    ap.add_argument("--docs", default=str(RELIABILITY), help='page to write the "Soak" section to ("" = none)')
    ap.add_argument("--render", default="", help="only rewrite the docs section from a results file")
    ap.add_argument("--heading", default="", help='the docs section\'s heading (default "## Nemesis" / "## Soak")')
    args = ap.parse_args()
    args.results = args.results or str(ROOT / "bench" / "results" / ("nemesis.json" if args.nemesis else "soak.json"))
    heading = args.heading or ("## Nemesis" if args.nemesis else "## Soak")
    if args.render:
        result = json.loads(Path(args.render).read_text())
        write_section(heading, _section(result, args), Path(args.docs))
        return 0
    args.seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    print(f"seed {args.seed} (--seed {args.seed} replays this schedule)", flush=True)
    faults = []
    if args.nemesis:
        faults = schedule(args.seed, steps=args.steps, num_faults=args.faults, kinds=args.kinds.split(","),
                          ack_wait_s=_config(args, Path(), Path())["bus"]["ack_wait_s"])
        for f in faults:
            print(f"  fault {f.index}: {f.kind} at step {f.at_step} (pick {f.pick}, hold {f.hold_s} s)", flush=True)

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
    if args.nemesis:  # a head that a second node may join (loopback addresses of their own, as machines)
        os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
        head = start_ray_head(object_store_memory=1_000_000_000, node_ip=HEAD_IP)
    else:
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
    steps = Steps(run_dir)
    nemesis = None
    if args.nemesis:
        producer_bus = msgspec.structs.replace(admin, creds_file=str(server.creds_file("producer", args.name)),
                                               connect_timeout_s=5.0)
        nemesis = Nemesis(faults, run=args.name, run_dir=run_dir, steps=steps, server=server, head=head, node=None,
                          ray_cfg=ray_cfg, producer_bus=producer_bus, t0=time.monotonic())
        nemesis.node = nemesis.start_node()  # before the run: the trainer spreads the shards over both nodes
    polling = threading.Event()
    poller = threading.Thread(target=_poll_steps, args=(steps, polling), daemon=True)
    poller.start()
    log = open(root / "up.log", "wb")  # noqa: SIM115 -- closed in the finally below, after the launcher stopped
    t0 = time.monotonic()
    if nemesis is not None:
        nemesis.t0 = t0
    stuck = False
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
                stats, streams = {"items": None, "bytes": None}, {}
                try:  # a fault (the bus down, a shard restarting) may fail one sample; the next one is taken
                    stats = tq.stats_sync() if tq is not None else {"items": 0, "bytes": 0}
                    streams = asyncio.run(_bus_sizes(admin, args.name)) if server.is_running() else {}
                except Exception as e:  # noqa: BLE001 -- a sample is left incomplete, said so
                    print(f"t={now - t0:6.1f}s sample incomplete: {e!r}"[:300], flush=True)
                rss = {r: _rss_mb(p) for r, p in roles.items()}
                if server.pid is not None:
                    rss["nats-server"] = _rss_mb(server.pid)
                sample = {"t": round(now - t0, 1), "step": rows[-1]["step"] if rows else 0, "rss_mb": rss,
                          "tq_items": stats["items"], "tq_bytes": stats["bytes"], "streams": streams}
                samples.append(sample)
                print(f"t={sample['t']:6.1f}s step {sample['step']:4d} tq {sample['tq_items']} items "
                      f"streams {sample['streams']} trainer {sample['rss_mb'].get('trainer') or 0:.0f} MB", flush=True)
            last_step_at = steps.seen[-1][1] if steps.seen else t0
            if now - last_step_at > args.stuck_s:
                stuck = True
                print(f"t={now - t0:6.1f}s no step for {args.stuck_s:.0f} s: giving up", flush=True)
                break
            producers = [r for r in roles if r.startswith("producer")]
            if nemesis is not None:
                nemesis.tick(roles)
            elif now >= next_kill and producers:
                victim = rng.choice(sorted(producers))
                os.kill(roles[victim], signal.SIGKILL)  # a child of the launcher this bench started, by pid
                kills.append({"t": round(now - t0, 1), "producer": victim})
                print(f"t={now - t0:6.1f}s SIGKILL {victim}", flush=True)
                next_kill = now + rng.expovariate(1 / args.kill_every_s)
            time.sleep(0.5)
        wall = time.monotonic() - t0
        code = up.returncode
    finally:
        if nemesis is not None:
            nemesis.finish()
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
        ledger = subprocess.run([*RLBUS, "events", str(run_dir), "--ledger", "--json"], check=False, capture_output=True,
                                text=True)
    finally:
        polling.set()
        if nemesis is not None and nemesis.node is not None:
            stop_ray_head(nemesis.node)
        stop_ray_head(head)
        server.stop()
    rows = read_metrics(run_dir)
    groups = sum(int(r.get("groups", 8)) for r in rows) if rows else 0
    result = {"machine": machine(), "config": cfg, "exit_code": code, "wall_s": round(wall, 1),
              "steps": rows[-1]["step"] if rows else 0, "groups_trained": len(rows) * 8, "groups_counted": groups,
              "kills": kills, "samples": samples, "ledger_exit": ledger.returncode,
              "ledger": json.loads(ledger.stdout) if ledger.stdout.strip().startswith("{") else ledger.stdout[-2000:],
              "seed": args.seed, "stuck": stuck, "memory": _memory(samples, cfg["bus"]["max_age_s"])}
    # The ledger must have seen the whole run (an empty event log would pass the check vacuously).
    trained = result["ledger"].get("trained") if isinstance(result["ledger"], dict) else None
    result["ledger_complete"] = trained == args.steps * cfg["trainer"]["groups_per_step"]
    if nemesis is not None:
        result["faults"] = nemesis.report()
        try:
            result["forged"] = forged_outcome(run_dir, nemesis.records)
        except Exception as e:  # noqa: BLE001 -- the results are written whatever this reads
            result["forged"] = {"error": repr(e)[:500]}
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(json.dumps(result, indent=1) + "\n")
    print(f"exit {code}, {result['steps']} steps in {wall:.0f}s, {len(kills)} producer kills, "
          f"{len(result.get('faults', []))} faults, ledger exit {ledger.returncode} (complete: "
          f"{result['ledger_complete']}), memory flat: "
          f"{all(m['flat'] is not False for m in result['memory'].values())}; {args.results}")
    for f in result.get("faults", []):
        print(f"  {f}")
    if args.docs:
        write_section(heading, _section(result, args), Path(args.docs))
    flat = all(m["flat"] is not False for m in result["memory"].values())  # None: no verdict (a short run)
    ok = code == 0 and ledger.returncode == 0 and result["ledger_complete"] and flat and not stuck
    return 0 if ok else 1


def _poll_steps(steps: Steps, done: threading.Event) -> None:
    """metrics.jsonl read every 0.1 s on a thread of its own: the time a step is first seen is its time, however
    long the main loop's sample or fault takes."""
    while not done.wait(0.1):
        steps.poll()


#: Memory is flat when the median of the run's last quarter is within this of the first quarter's (MB, fraction).
FLAT_MB, FLAT_FRACTION = 25.0, 0.10


def _quarters(values: list[float | None]) -> list[float] | None:
    values = [v for v in values if v is not None]
    if len(values) < 4:
        return None
    q = len(values) / 4
    return [statistics.median(values[round(i * q):round((i + 1) * q)]) for i in range(4)]


def _memory(samples: list[dict[str, Any]], max_age_s: float) -> dict[str, dict[str, Any]]:
    """First- and last-quarter medians of each process's RSS (producers: the mean over the live ones) and of the
    TransferQueue's items; flat when the last is within FLAT_MB or FLAT_FRACTION of the first.

    The nats-server's from `max_age_s` into the run on: it holds the streams, which grow by design until their
    oldest messages reach `bus.max_age_s` and then stay level; its first quarter is taken from there (a run that
    ends sooner says nothing about the server, and gets no verdict)."""
    series = {role: [x["rss_mb"].get(role) if role != "nats-server" or x["t"] >= max_age_s else None for x in samples]
              for role in sorted({k for x in samples for k in x["rss_mb"] if not k.startswith("producer")})}
    series["producer (mean)"] = [
        statistics.mean(v) if (v := [r for k, r in x["rss_mb"].items() if k.startswith("producer") and r]) else None
        for x in samples]
    series["tq_items"] = [x["tq_items"] for x in samples]
    out = {}
    for name, values in series.items():
        q = _quarters(values)
        if q is None:
            if name == "nats-server":
                out[name] = {"flat": None, "why": f"the run was shorter than bus.max_age_s ({max_age_s:g} s)"}
            continue
        grew = q[3] - q[0]
        out[name] = {"first_quarter": round(q[0], 1), "last_quarter": round(q[3], 1), "grew": round(grew, 1),
                     "flat": grew <= max(FLAT_MB, FLAT_FRACTION * q[0])}
    return out


def _flat(values: list[float]) -> str:
    """The median of each quarter of the run, and the peak."""
    values = [v for v in values if v is not None]
    if len(values) < 4:
        return "n/a"
    q = len(values) / 4
    quarters = [statistics.median(values[round(i * q):round((i + 1) * q)]) for i in range(4)]
    return " / ".join(f"{v:.0f}" for v in quarters) + f" (peak {max(values):.0f})"


def _results_name(args: argparse.Namespace) -> str:
    """The results file a section is made from, as the docs name it."""
    path = Path(getattr(args, "render", "") or args.results).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _section(r: dict[str, Any], args: argparse.Namespace) -> str:
    if "faults" in r:
        return _nemesis_section(r, args)
    s = r["samples"]
    lines = [
        args.heading or "## Soak",
        "",
        (f"`python bench/soak.py --steps {args.steps} --producers {args.producers} --kill-every-s "
         f"{args.kill_every_s:g} --max-age-s {args.max_age_s:g} --seed {args.seed}`: the simulated engine, "
         f"{args.producers} producers, {r['steps']} steps x 8 groups of 4 ({r['groups_trained']} groups) in "
         f"{r['wall_s']:.0f} s, {len(r['kills'])} producer SIGKILLs at random moments; exit code {r['exit_code']}, "
         f"ledger check exit {r['ledger_exit']}. {machine_line(r['machine'])} Sampled every "
         f"{args.sample_every_s:g} s ({len(s)} samples; every sample: `{_results_name(args)}`):"),
        "",
        *_resource_table(s),
    ]
    trainer = [x["rss_mb"].get("trainer") for x in s if x["rss_mb"].get("trainer")]
    grew = ""
    if len(trainer) >= 8:
        q = len(trainer) // 4
        mb = statistics.median(trainer[-q:]) - statistics.median(trainer[:q])
        grew = (f"The trainer's RSS moved {mb:+.0f} MB from the first quarter to the last, "
                f"{1024 * mb / max(1, r['steps']):+.0f} KB per step (not yet traced to a cause). ")
    lines += ["", (grew + "The TransferQueue holds the groups in flight and those trained since the last checkpoint; "
                   f"the streams grow until their oldest messages reach `bus.max_age_s` ({args.max_age_s:g} s) and "
                   "stay level from there.")]
    return "\n".join(lines)


def _given_up(ledger: Any) -> str:
    """Why the examples given up were: each one's releases' losses, as the feeder recorded them."""
    why = ledger.get("given_up_why") if isinstance(ledger, dict) else None
    if not why:
        return ""
    return " Examples given up, by why their releases were lost: " + "; ".join(f"{w} ({n})" for w, n in why.items()) + "."


def _verdict(name: str, m: dict[str, Any]) -> str:
    if m.get("flat") is None:
        return f"{name}: no verdict ({m.get('why', 'too few samples')})"
    return f"{name} {m['first_quarter']:g} -> {m['last_quarter']:g}{'' if m['flat'] else ' (NOT flat)'}"


def _counts(ledger: Any) -> str:
    if not isinstance(ledger, dict):
        return "an unreadable ledger"
    return ", ".join(f"{v} {k}" for k, v in ledger.items() if isinstance(v, int))


def _resource_table(s: list[dict[str, Any]]) -> list[str]:
    """Median of each quarter of the run (and the peak) of every process's RSS, the TransferQueue, the streams."""
    # Memory after warm-up: the first quarter starts once every process has loaded what it keeps.
    roles = sorted({k for x in s for k in x["rss_mb"]}, key=lambda k: (not k.startswith("trainer"), k))
    lines = ["| what | median of each quarter of the run (peak) |", "|---|---|"]
    for role in roles:
        if role.startswith("producer"):
            continue
        lines.append(f"| RSS of {role}, MB | {_flat([x['rss_mb'].get(role) for x in s])} |")
    prod = [statistics.mean([v for k, v in x["rss_mb"].items() if k.startswith("producer") and v]) for x in s
            if any(k.startswith("producer") and v for k, v in x["rss_mb"].items())]
    lines.append(f"| RSS of a producer (mean over the live ones), MB | {_flat(prod)} |")
    lines.append(f"| TransferQueue items stored | {_flat([x['tq_items'] for x in s])} |")
    for stream in ("prompts", "traj", "weights", "events"):
        lines.append(f"| `{stream}` stream messages | {_flat([x['streams'].get(stream) for x in s])} |")
    return lines


def _nemesis_section(r: dict[str, Any], args: argparse.Namespace) -> str:
    faults = [f for f in r["faults"] if f.get("fired", True)]
    stalls = [f["stall_s"] for f in faults if f.get("stall_s") is not None]
    kinds = sorted({f["kind"] for f in faults})
    by_kind = ", ".join(f"{sum(f['kind'] == k for f in faults)} {k}" for k in kinds)
    mem = r["memory"]
    # What the run was given, from its own record (a render from --render FILE has no such flags of its own).
    steps = r.get("config", {}).get("trainer", {}).get("total_steps", args.steps)
    producers = r.get("config", {}).get("rollout", {}).get("num_producers", args.producers)
    planned = len(r["faults"]) if r.get("faults") else args.faults
    lines = [
        args.heading or "## Nemesis",
        "",
        f"`python bench/soak.py --nemesis --steps {steps} --faults {planned} --producers {producers} "
        f"--seed {r['seed']}` (the seed replays the schedule: `bench/nemesis.py`): the simulated engine, "
        f"{producers} producers, a Ray head on {HEAD_IP} and a second node on 127.0.0.3, "
        f"{r['steps']} steps x 8 groups of 4 in {r['wall_s']:.0f} s; {len(faults)} faults ({by_kind}) at steps drawn "
        f"from the seed; exit code {r['exit_code']}, ledger check (`rlbus events RUN_DIR --ledger`) exit "
        f"{r['ledger_exit']} over {_counts(r['ledger'])}" + (", problems: " + "; ".join(r["ledger"].get("problems", [])) if isinstance(
            r["ledger"], dict) and r["ledger"].get("problems") else "") + "." + _given_up(r["ledger"]),
        "",
        ("A stall is the time from a fault to the first step written after it (metrics.jsonl read every 0.1 s); "
         "the longest gap is the longest time without a new step until the tenth step after it; a hold is how long "
         "the fault lasted (a producer stopped, the nats-server or the node down). Every fault's row, its target "
         f"and every sample: `{_results_name(args)}`."),
        "",
        "| kind | faults | stall, s: median / max | longest gap, s: max | hold, s |",
        "|---|---:|---|---:|---|",
    ]
    for kind in kinds:
        fs = [f for f in faults if f["kind"] == kind]
        st = [f["stall_s"] for f in fs if f.get("stall_s") is not None]
        gp = [f["gap_s"] for f in fs if f.get("gap_s") is not None]
        holds = [float(f["hold_s"]) for f in fs if f.get("hold_s")]
        lines.append(f"| {kind} | {len(fs)} | "
                     + (f"{statistics.median(st):.1f} / {max(st):.1f}" if st else "")
                     + (f" ({len(fs) - len(st)} with no step after it)" if len(st) < len(fs) else "")
                     + f" | {f'{max(gp):.1f}' if gp else ''} | "
                     + ("" if not holds else f"{holds[0]:.1f}" if len(holds) == 1 else
                        f"{min(holds):.1f}-{max(holds):.1f}") + " |")
    unfired = len(r["faults"]) - len(faults)
    gaps = [f["gap_s"] for f in faults if f.get("gap_s") is not None]
    if stalls:
        lines += ["", (f"All faults: stall median {statistics.median(stalls):.1f} s, max {max(stalls):.1f} s; "
                       f"longest gap median {statistics.median(gaps):.1f} s, max {max(gaps):.1f} s."
                       + (f" {unfired} planned fault(s) did not fire: the run ended first." if unfired else ""))]
    fo = r.get("forged", {})
    if "error" in fo:
        lines += ["", f"Forged messages: their outcome could not be read: {fo['error']}"]
    elif fo and any(f.get("kind") == "forged-message" for f in faults):  # none drawn: nothing to say
        named = fo["named_real_prompts_trained_or_reissued"]
        refused = sum(1 for why in fo["forged_groups_dead_lettered"].values() if not why.startswith("NOT"))
        lines[-1] += (f" Forged messages (producer credential): {fo['garbage_on_traj_dead_lettered']} garbage messages "
                      f"on `traj` dead-lettered; {refused} of {len(fo['forged_groups_dead_lettered'])} forged groups "
                      "dead-lettered, the others dropped untrained; the real prompts they named trained or re-issued: "
                      + (f"{sum(named.values())} of {len(named)}" if named else "none named") + ".")
    if r.get("stuck"):
        last = max((f["at_step"] for f in faults), default=0)
        lines += ["", (f"**The run did not finish**: no step for {args.stuck_s:.0f} s after step {r['steps']} (last fault at "
                      f"step {last}); the bench stopped it and checked the ledger of what was done.")]
    if r.get("findings"):  # written into the results file by whoever read the logs of the run
        lines += ["", "What the run found:", "", *[f"- {x}" for x in r["findings"]]]
    lines += ["", f"Memory (median of the first quarter of the samples -> the last; flat when it grew by at most "
                  f"{FLAT_MB:g} MB or {FLAT_FRACTION:.0%}; the nats-server's from bus.max_age_s into the run, once the "
                  "streams it holds stopped growing): "
              + "; ".join(_verdict(k, m) for k, m in mem.items()) + f". {machine_line(r['machine'])}"]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
