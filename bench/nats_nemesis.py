"""NATS failures at random moments under a real `rlbus up`, and the stall each one costs (kill -> next step).

    .venv/bin/python bench/nats_nemesis.py --embedded --kills 5      # the embedded nats-server SIGKILLed 5 times
    .venv/bin/python bench/nats_nemesis.py --kills 20 --seed 1       # a three-server cluster, a random server each time

Embedded: `rlbus up` starts its own nats-server; the bench SIGKILLs it (by pid, found under the launcher) and the
launcher restarts it on its store and port. Cluster: the bench starts three servers on loopback (bus.replicas=3)
and, each round, picks a target at random among the leaders of each stream, the consumer leaders, the meta leader,
and servers with and without client connections; SIGKILLs it at a random moment, restarts it a few seconds later.
The seed is printed and replays the same schedule. A stall is the time from the kill to the first step after it
(metrics.jsonl polled every 0.1 s). Ends with the ledger check (`rlbus events RUN_DIR --ledger`). Writes
bench/results/nats_nemesis_<mode>.json; the figures are quoted in docs/reliability.md.
Signals only processes it started, by pid.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path[0] = str(Path(__file__).resolve().parents[1])  # so that `bench.common` and `tests.support` import

from bench.common import machine, machine_line
from rlbus.bus.proc import command_line, descendants

ROOT = Path(__file__).resolve().parents[1]
RLBUS = [sys.executable, "-m", "rlbus.cli"]


def _config(args: argparse.Namespace, run_dir: Path, model: Path, bus: dict[str, Any]) -> dict[str, Any]:
    if args.config:  # a user's config (e.g. the quickstart), in a run directory of the bench's own
        import yaml

        cfg = yaml.safe_load(Path(args.config).read_text())
        cfg["name"] = args.name
        cfg.setdefault("logging", {})["run_dir"] = str(run_dir)
        cfg.setdefault("trainer", {})["total_steps"] = args.steps
        cfg.setdefault("bus", {}).update(bus)
        return cfg
    return {
        "name": args.name,
        "model": {"path": str(model)},
        "data": {"type": "synthetic", "num_examples": 4096},
        "rollout": _rollout(args.engine),
        "trainer": {"total_steps": args.steps, "groups_per_step": 4, "max_staleness": 2, "micro_batch_size": 16,
                    "lr": 1e-4, "checkpoint_interval": 5},
        "bus": {"ack_wait_s": 10.0, **bus},
        "ray": {"num_storage_actors": 1, "capacity_bytes": 256 * 1024**2},
        "logging": {"run_dir": str(run_dir), "tensorboard": False, "plot": False, "record": "off"},
    }  # fmt: skip


def _rollout(engine: str) -> dict[str, Any]:
    if engine == "hf":  # the tiny model generating for real, as the system tests run it
        return {
            "engine": {"type": "hf", "max_batch_size": 4},
            "n": 2,
            "max_new_tokens": 16,
            "max_response_tokens": 40,
            "max_turns": 2,
            "max_tool_response_tokens": 8,
            "num_producers": 2,
            "heartbeat_interval_s": 1.0,
            "in_progress_interval_s": 2.0,
        }
    return {
        "engine": {"type": "simulated", "mean_tokens": 24, "tail_alpha": 2.0, "seconds_per_token": 0.004, "seed": 0},
        "agent_loop": "single_turn",
        "tools": [],
        "n": 4,
        "max_new_tokens": 64,
        "max_response_tokens": 64,
        "num_producers": 2,
        "heartbeat_interval_s": 1.0,
    }


class Steps:
    """Watches metrics.jsonl: the time each step was first seen."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / "metrics.jsonl"
        self.seen: list[tuple[int, float]] = []
        self._offset = 0

    def poll(self) -> int:
        if self.path.is_file():
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
            end = data.rfind(b"\n") + 1
            self._offset += end
            now = time.monotonic()
            for line in data[:end].splitlines():
                try:
                    self.seen.append((int(json.loads(line)["step"]), now))
                except (ValueError, KeyError):
                    pass
        return self.seen[-1][0] if self.seen else 0

    def first_after(self, t: float) -> float | None:
        return next((seen for _, seen in self.seen if seen > t), None)

    def longest_gap(self, start: float, end: float) -> float:
        """The longest time without a new step between `start` and `end` (the stall a fault caused)."""
        times = [start] + [seen for _, seen in self.seen if start < seen <= end]
        return max(b - a for a, b in itertools.pairwise(times)) if len(times) > 1 else end - start


def _wait_step(steps: Steps, step: int, timeout: float, up: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while steps.poll() < step:
        if up.poll() is not None:
            raise SystemExit(f"rlbus up exited ({up.returncode}) while waiting for step {step}")
        if time.monotonic() > deadline:
            raise SystemExit(f"no step {step} within {timeout:.0f}s")
        time.sleep(0.1)


def _stall(steps: Steps, up: subprocess.Popen, at_step: int, killed_at: float) -> tuple[float, float]:
    """(seconds from the kill to the next step, longest time without a step until three steps after the kill)."""
    _wait_step(steps, at_step + 3, 300, up)
    first = steps.first_after(killed_at)
    assert first is not None
    return first - killed_at, steps.longest_gap(killed_at, steps.seen[-1][1])


@contextlib.contextmanager
def _rlbus_up(cfg: dict[str, Any], work: Path) -> Iterator[tuple[subprocess.Popen, Steps]]:
    """`rlbus up` on `cfg`, past its third step; SIGINT (then SIGKILL) on the way out if it still runs."""
    import yaml

    cfg_path = work / "run.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    with open(work / "up.log", "wb") as log:
        up = subprocess.Popen([*RLBUS, "up", str(cfg_path)], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                              start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))  # fmt: skip
    try:
        steps = Steps(Path(cfg["logging"]["run_dir"]))
        _wait_step(steps, 3, 300, up)
        yield up, steps
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            try:
                up.wait(timeout=60)
            except subprocess.TimeoutExpired:
                up.kill()
                up.wait()


def _embedded_server_pid(launcher: int) -> int | None:
    for pid in descendants(launcher):
        argv = command_line(pid)
        if argv and argv[0].endswith("nats-server"):
            return pid
    return None


def run_embedded(args: argparse.Namespace, rng: random.Random, work: Path, model: Path) -> dict[str, Any]:
    run_dir, kills = work / "run", []
    with _rlbus_up(_config(args, run_dir, model, {}), work) as (up, steps):
        for i in range(args.kills):
            time.sleep(rng.uniform(0.0, 2.0))  # a random moment within a step or two
            pid = _embedded_server_pid(up.pid)
            if pid is None:
                raise SystemExit("no nats-server under the launcher")
            at_step = steps.poll()  # every step written before the kill is counted as before it
            os.kill(pid, signal.SIGKILL)  # the launcher's own child, by pid
            t = time.monotonic()
            first, stall = _stall(steps, up, at_step, t)
            kills.append({"kill": i, "target": "embedded nats-server", "at_step": at_step,
                          "first_step_s": round(first, 2), "stall_s": round(stall, 2)})  # fmt: skip
            print(f"kill {i}: embedded nats-server at step {at_step}; next step after {first:.1f}s, longest time "
                  f"without a step {stall:.1f}s", flush=True)  # fmt: skip
        code = up.wait(timeout=1800)
    return {"exit": code, "run_dir": str(run_dir), "kills": kills}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--embedded", action="store_true", help="kill the embedded server of `rlbus up` (else a cluster)")
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--steps", type=int, default=0, help="total steps (default: enough for the kills)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--name", default="nemesis")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--config", default="", help="run this config (e.g. configs/quickstart.yaml), not the bench's")
    p.add_argument(
        "--engine",
        choices=["simulated", "hf"],
        default="simulated",
        help="the producers' engine: simulated (generation time without compute) or the tiny model",
    )
    args = p.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    print(f"seed {seed} (--seed {seed} replays this schedule)", flush=True)
    rng = random.Random(seed)
    args.steps = args.steps or 10 + 6 * args.kills
    model = ROOT / ".rlbus" / "models" / "bench-random"
    if not (model / "config.json").is_file():
        subprocess.run([*RLBUS, "init-model", str(model), "--steps", "0", "--threads", "1"], cwd=ROOT, check=True)
    work = Path(tempfile.mkdtemp(prefix="rlbus-nemesis-"))
    mode = "embedded" if args.embedded else "cluster"
    result = run_embedded(args, rng, work, model) if args.embedded else run_cluster(args, rng, work, model)
    ledger = subprocess.run(
        [*RLBUS, "events", result["run_dir"], "--ledger"], check=False, capture_output=True, text=True, cwd=ROOT
    )
    stalls = [k["stall_s"] for k in result["kills"]]
    summary = {
        "mode": mode, "seed": seed, "machine": machine_line(machine()), **result, "ledger_exit": ledger.returncode,
        "ledger_tail": ledger.stdout[-1500:] + ledger.stderr[-1500:],
        "stall_s": {"median": statistics.median(stalls), "max": max(stalls)} if stalls else {},
    }  # fmt: skip
    out = ROOT / "bench" / "results" / f"nats_nemesis_{mode}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(summary, indent=1))
    print(
        f"{len(stalls)} kills, stall median {summary['stall_s'].get('median')} s, max {summary['stall_s'].get('max')}"
        f" s; rlbus up exit {result['exit']}; ledger exit {ledger.returncode}; {out}"
    )
    if not args.keep:
        subprocess.run(["rm", "-rf", str(work)], check=False)
    return 0 if result["exit"] == 0 and ledger.returncode == 0 else 1


#: What a cluster kill may target; each round draws one (the server it names may lead several things at once).
TARGETS = (
    "prompts stream leader",
    "traj stream leader",
    "weights stream leader",
    "events stream leader",
    "KV bucket leader",
    "prompts consumer leader",
    "traj consumer leader",
    "meta leader",
    "a server with client connections",
    "a server without client connections",
)


async def _leaders(admin: Path, run: str) -> dict[str, str]:
    """target -> server name, for the leaders the JetStream API reports (streams and consumers)."""
    import nats

    from rlbus.bus.auth import load_creds
    from rlbus.schemas.subjects import Subjects

    creds, s = load_creds(admin), Subjects.for_run(run)
    nc = await nats.connect(
        creds["url"].split(","),
        user=creds["user"],
        password=creds["password"],
        inbox_prefix=creds["inbox_prefix"],
        connect_timeout=5,
        max_reconnect_attempts=3,
    )
    js, out = nc.jetstream(timeout=5), {}
    try:
        for target, stream in (
            ("prompts stream leader", s.prompts_stream),
            ("traj stream leader", s.traj_stream),
            ("weights stream leader", s.weights_stream),
            ("events stream leader", s.events_stream),
            ("KV bucket leader", f"KV_{s.weights_bucket}"),
        ):
            info = await js.stream_info(stream)
            out[target] = info.cluster.leader if info.cluster else ""
        for target, stream, durable in (
            ("prompts consumer leader", s.prompts_stream, s.prompts_consumer),
            ("traj consumer leader", s.traj_stream, s.traj_consumer),
        ):
            info = await js.consumer_info(stream, durable)
            out[target] = info.cluster.leader if info.cluster else ""
    finally:
        await nc.close()
    return out


def _meta_leader(servers: list[Any]) -> str:
    """The server the logs last named JetStream meta leader (nats-server logs each election, on every server)."""
    stamp_re = re.compile(r"(\d{4}/\d\d/\d\d \d\d:\d\d:\d\d\.\d+)")
    best, name = "", ""
    for srv in servers:
        for line in srv.log_file.read_text(errors="replace").splitlines():
            stamp = stamp_re.search(line)
            if stamp is None or stamp[1] < best:
                continue
            if "Self is new JetStream cluster metadata leader" in line:
                best, name = stamp[1], srv._server_name
            elif (m := re.search(r"new metadata leader: ([^/\s]+)", line)) is not None:
                best, name = stamp[1], m[1]
    return name


def _connected(servers: list[Any]) -> dict[str, int]:
    """server name -> established client connections on its client port (read with `ss`)."""
    out = subprocess.run(["ss", "-tnH", "state", "established"], check=False, capture_output=True, text=True).stdout
    ports = {int(srv.url.rsplit(":", 1)[1]): srv._server_name for srv in servers}
    counts = dict.fromkeys(ports.values(), 0)
    for line in out.splitlines():
        local = line.split()[2] if len(line.split()) > 3 else ""
        port = int(local.rsplit(":", 1)[1]) if ":" in local else 0
        if port in ports:
            counts[ports[port]] += 1
    return counts


def run_cluster(args: argparse.Namespace, rng: random.Random, work: Path, model: Path) -> dict[str, Any]:
    from tests.support.nats_cluster import cluster, server_named, wait_for_meta_leader

    servers = cluster(work, args.name)
    run_dir = work / "run"
    try:
        admin = servers[0].creds_file("admin", args.name)
        wait_for_meta_leader(admin)
        from rlbus.bus.auth import load_creds

        bus = {"url": load_creds(admin)["url"], "creds_file": str(admin), "replicas": 3}
        kills = []
        with _rlbus_up(_config(args, run_dir, model, bus), work) as (up, steps):
            for i in range(args.kills):
                target = rng.choice(TARGETS)
                delay, down_s = rng.uniform(0.0, 2.0), rng.uniform(1.0, 5.0)
                leaders = asyncio.run(_leaders(admin, args.name))
                leaders["meta leader"] = _meta_leader(servers)
                conns = _connected(servers)
                if leaders.get(target) in conns:
                    name = leaders[target]
                else:  # a server with or without connections (or a leader nobody reported: any server)
                    want = target == "a server with client connections"
                    name = rng.choice([n for n in sorted(conns) if (conns[n] > 0) == want] or sorted(conns))
                victim = server_named(servers, name)
                time.sleep(delay)
                at_step = steps.poll()
                os.kill(victim.pid, signal.SIGKILL)  # a server this bench started, by pid
                t = time.monotonic()
                victim.stop()  # reap it
                time.sleep(down_s)
                victim.restart()
                first, stall = _stall(steps, up, at_step, t)
                also = sorted(k for k, v in leaders.items() if v == name and k != target)
                kills.append({"kill": i, "target": target, "server": name, "also": also, "connections": conns[name],
                              "at_step": at_step, "down_s": round(down_s, 1), "first_step_s": round(first, 2),
                              "stall_s": round(stall, 2)})  # fmt: skip
                print(f"kill {i}: {target} ({name}, also {', '.join(also) or 'nothing else'}; {conns[name]} "
                      f"connections) at step {at_step}, down {down_s:.1f}s; next step after {first:.1f}s, longest "
                      f"time without a step {stall:.1f}s", flush=True)  # fmt: skip
                wait_for_meta_leader(admin)
            code = up.wait(timeout=1800)
    finally:
        for srv in servers:
            srv.stop()
    return {"exit": code, "run_dir": str(run_dir), "kills": kills}


if __name__ == "__main__":
    sys.exit(main())
