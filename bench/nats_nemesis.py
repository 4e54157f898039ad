"""NATS failures at random moments under a real `rlbus up`, and the stall each one costs (kill -> next step).

    .venv/bin/python bench/nats_nemesis.py --embedded --kills 5      # the embedded nats-server SIGKILLed 5 times
    .venv/bin/python bench/nats_nemesis.py --kills 20 --seed 1       # a three-server cluster, a random server each time
    .venv/bin/python bench/nats_nemesis.py --embedded --kills 10 --moment after-delivery --ack-wait-s 15 --busy 2
    .venv/bin/python bench/nats_nemesis.py --kills 10 --targets streams   # a cluster losing a stream leader

Embedded: `rlbus up` starts its own nats-server; the bench SIGKILLs it (by pid, found under the launcher) and the
launcher restarts it on its store and port. Cluster: the bench starts three servers on loopback (bus.replicas=3)
and, each round, picks a target at random among the leaders of each stream, the consumer leaders, the meta leader,
and servers with and without client connections; SIGKILLs it at a random moment, restarts it a few seconds later.
The seed is printed and replays the same schedule. A kill's stall is the longest time without a step from the kill
until `--window-steps` steps after it (metrics.jsonl polled every 0.1 s); the first step after it is recorded too.
`--moment after-delivery` kills right after a consumer (prompts or traj, drawn) hands out a message, read by
polling its consumer info: the delivery is in flight, and a server storing its consumer state a moment later
restarts without it (issue 42). Each kill also records the unacked deliveries at the kill and the settles the
roles' logs show given up or retried meanwhile. `--busy N` keeps N CPUs busy with spinning processes it starts and
ends by pid. Ends with the ledger check (`rlbus events RUN_DIR --ledger`). Writes
bench/results/nats_nemesis_<mode>[_<label>].json; the figures are quoted in docs/reliability.md.
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

from bench.common import git_commit, machine, machine_line
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

    def poll(self, seen_at: float | None = None) -> int:
        """Read new step lines, seen now (or at `seen_at`); the last step seen."""
        if self.path.is_file():
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
            end = data.rfind(b"\n") + 1
            self._offset += end
            now = time.monotonic() if seen_at is None else seen_at
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


def _stall(steps: Steps, up: subprocess.Popen, at_step: int, killed_at: float, window: int) -> tuple[float, float]:
    """(seconds from the kill to the next step, longest time without a step until `window` steps after the kill)."""
    _wait_step(steps, at_step + window, 300, up)
    first = steps.first_after(killed_at)
    assert first is not None
    return first - killed_at, steps.longest_gap(killed_at, steps.seen[-1][1])


def _percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of `values`, linear between order statistics."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    return ordered[lo] + (ordered[min(lo + 1, len(ordered) - 1)] - ordered[lo]) * (pos - lo)


class Settles:
    """What the roles' logs say about settles since a mark: acks / naks / terms given up at once because the
    restarted server no longer knew the delivery, and settles retried or failed (the 30 s hang of issue 42)."""

    GIVEN_UP = re.compile(r"(\+ACK|-NAK|\+TERM) of \S+ seq \d+ \(\S+\): the server no longer knows this delivery")
    RETRIED = re.compile(r"(\+ACK|-NAK|\+TERM) of \S+ seq \d+ \(\S+\): .*retrying for up to")
    FAILED = re.compile(r"(\+ACK|-NAK|\+TERM) of \S+ seq \d+ \(\S+\) failed for")

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self._offsets: dict[Path, int] = {}

    def mark(self) -> None:
        self._offsets = {f: f.stat().st_size for f in self.log_dir.glob("*.log")}

    def since_mark(self) -> dict[str, int]:
        text = ""
        for f in self.log_dir.glob("*.log"):
            with open(f, "rb") as fh:
                fh.seek(self._offsets.get(f, 0))
                text += fh.read().decode(errors="replace")
        return {"given_up": len(self.GIVEN_UP.findall(text)), "retried": len(self.RETRIED.findall(text)),
                "failed": len(self.FAILED.findall(text))}


async def _consumers(creds_file: Path, run: str, nc: Any = None) -> tuple[Any, dict[str, tuple[int, int]]]:
    """(a connection to reuse, {"prompts" / "traj": (delivered stream seq, unacked deliveries)})."""
    import nats

    from rlbus.bus.auth import load_creds
    from rlbus.schemas.subjects import Subjects

    if nc is None:
        creds = load_creds(creds_file)
        nc = await nats.connect(creds["url"].split(","), user=creds["user"], password=creds["password"],
                                inbox_prefix=creds["inbox_prefix"], connect_timeout=5, max_reconnect_attempts=0,
                                allow_reconnect=False)  # fmt: skip
    s, js, out = Subjects.for_run(run), nc.jetstream(timeout=5), {}
    for name, stream, durable in (("prompts", s.prompts_stream, s.prompts_consumer),
                                  ("traj", s.traj_stream, s.traj_consumer)):
        info = await js.consumer_info(stream, durable)
        out[name] = (int(info.delivered.stream_seq), int(info.num_ack_pending or 0))
    return nc, out


async def _kill_after_delivery(creds_file: Path, run: str, consumer: str, pid: int,
                               timeout: float = 60.0) -> dict[str, Any]:
    """SIGKILL `pid` the moment `consumer` (prompts or traj) hands out its next message (consumer info polled back
    to back, about a millisecond apart); returns what each consumer held unacked then."""
    nc, first = await _consumers(creds_file, run)
    try:
        deadline = time.monotonic() + timeout
        now = first
        while time.monotonic() < deadline:
            _, now = await _consumers(creds_file, run, nc)
            if now[consumer][0] > first[consumer][0]:
                break
        os.kill(pid, signal.SIGKILL)  # a process this bench or its launcher started, by pid
        return {"after_delivery_of": consumer, "seq": now[consumer][0] if now is not first else None,
                "unacked": {k: v[1] for k, v in now.items()}}
    finally:
        with contextlib.suppress(Exception):  # the server it watched is dead
            await nc.close()


async def _unacked(creds_file: Path, run: str) -> dict[str, int]:
    nc, now = await _consumers(creds_file, run)
    await nc.close()
    return {k: v[1] for k, v in now.items()}


def _kill_at_moment(args: argparse.Namespace, rng: random.Random, creds_file: Path, pid: int) -> dict[str, Any]:
    """SIGKILL `pid` at the kill's moment: a random one within two seconds, or (`--moment after-delivery`) at once
    after the next delivery of a consumer drawn at random. Returns what was in flight."""
    time.sleep(rng.uniform(0.0, 2.0))
    if args.moment == "after-delivery":
        return asyncio.run(_kill_after_delivery(creds_file, args.name, rng.choice(["prompts", "traj"]), pid))
    moment = {"unacked": asyncio.run(_unacked(creds_file, args.name))}
    os.kill(pid, signal.SIGKILL)  # a process this bench or its launcher started, by pid
    return moment


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
    bus = {"ack_wait_s": args.ack_wait_s} if args.ack_wait_s else {}
    with _rlbus_up(_config(args, run_dir, model, bus), work) as (up, steps):
        admin = run_dir / "bus" / "creds" / args.name / "admin.json"
        settles = Settles(run_dir / "logs")
        for i in range(args.kills):
            pid = _embedded_server_pid(up.pid)  # found first: the kill must follow its moment at once
            if pid is None:
                raise SystemExit("no nats-server under the launcher")
            settles.mark()
            try:
                moment = _kill_at_moment(args, rng, admin, pid)  # the launcher's own child
            except Exception:
                if up.poll() is None and steps.poll() < args.steps - 2:
                    raise
                print(f"the run ended before kill {i} (give it more --steps)", flush=True)
                break
            t = time.monotonic()
            at_step = steps.poll(seen_at=t - 0.001)  # what was written by the kill counts as before it
            first, stall = _stall(steps, up, at_step, t, args.window_steps)
            kills.append({"kill": i, "target": "embedded nats-server", "at_step": at_step, **moment,
                          "first_step_s": round(first, 2), "stall_s": round(stall, 2),
                          "settles": settles.since_mark()})  # fmt: skip
            print(f"kill {i}: embedded nats-server at step {at_step} ({moment}); next step after {first:.1f}s, "
                  f"longest time without a step {stall:.1f}s; settles {kills[-1]['settles']}", flush=True)
        code = up.wait(timeout=1800)
    return {"exit": code, "run_dir": str(run_dir), "kills": kills}


@contextlib.contextmanager
def _busy(n: int) -> Iterator[None]:
    """`n` spinning processes (the other work of a shared machine), started here and ended by pid."""
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for b in burners:
            b.kill()
            b.wait()


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
    p.add_argument("--ack-wait-s", type=float, default=0.0, help="bus.ack_wait_s (default: the config's)")
    p.add_argument("--moment", choices=["random", "after-delivery"], default="random",
                   help="kill at a random moment, or right after a prompts / traj delivery (embedded only)")
    p.add_argument("--targets", choices=["all", "streams"], default="all",
                   help="cluster: draw among every kind of target, or among the four streams' leaders")
    p.add_argument("--window-steps", type=int, default=10, help="a kill's stall is measured until this many steps on")
    p.add_argument("--busy", type=int, default=0, help="keep this many CPUs busy with spinning processes meanwhile")
    p.add_argument("--label", default="", help="results go to bench/results/nats_nemesis_<mode>_<label>.json")
    args = p.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    print(f"seed {seed} (--seed {seed} replays this schedule)", flush=True)
    rng = random.Random(seed)
    args.steps = args.steps or 10 + (6 + args.window_steps) * args.kills
    model = ROOT / ".rlbus" / "models" / "bench-random"
    if not (model / "config.json").is_file():
        subprocess.run([*RLBUS, "init-model", str(model), "--steps", "0", "--threads", "1"], cwd=ROOT, check=True)
    work = Path(tempfile.mkdtemp(prefix="rlbus-nemesis-"))
    mode = "embedded" if args.embedded else "cluster"
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    with _busy(args.busy):
        result = run_embedded(args, rng, work, model) if args.embedded else run_cluster(args, rng, work, model)
        load = os.getloadavg()[0]
    ledger = subprocess.run(
        [*RLBUS, "events", result["run_dir"], "--ledger"], check=False, capture_output=True, text=True, cwd=ROOT
    )
    stalls = [k["stall_s"] for k in result["kills"]]
    summary = {
        "mode": mode, "seed": seed, "argv": sys.argv[1:], "commit": git_commit(), "started": started,
        "busy_cpus": args.busy, "ack_wait_s": args.ack_wait_s or "config", "moment": args.moment,
        "machine": machine_line(machine(load_avg_end_1m=round(load, 2))), **result,
        "ledger_exit": ledger.returncode, "ledger_tail": ledger.stdout[-1500:] + ledger.stderr[-1500:],
        "stall_s": {"p50": round(_percentile(stalls, 0.5), 2), "p95": round(_percentile(stalls, 0.95), 2),
                    "max": max(stalls), "min": min(stalls)} if stalls else {},
    }  # fmt: skip
    out = ROOT / "bench" / "results" / f"nats_nemesis_{mode}{'_' + args.label if args.label else ''}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(summary, indent=1))
    print(
        f"{len(stalls)} kills, stall p50 {summary['stall_s'].get('p50')} s, p95 {summary['stall_s'].get('p95')} s, "
        f"max {summary['stall_s'].get('max')} s; rlbus up exit {result['exit']}; ledger exit {ledger.returncode}; {out}"
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
#: `--targets streams`: a cluster losing a stream's leader.
STREAM_LEADERS = TARGETS[:4]


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
        if args.ack_wait_s:
            bus["ack_wait_s"] = args.ack_wait_s
        kills = []
        targets = TARGETS if args.targets == "all" else STREAM_LEADERS
        with _rlbus_up(_config(args, run_dir, model, bus), work) as (up, steps):
            settles = Settles(run_dir / "logs")
            for i in range(args.kills):
                target = rng.choice(targets)
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
                settles.mark()
                os.kill(victim.pid, signal.SIGKILL)  # a server this bench started, by pid
                t = time.monotonic()
                victim.stop()  # reap it
                time.sleep(down_s)
                victim.restart()
                first, stall = _stall(steps, up, at_step, t, args.window_steps)
                also = sorted(k for k, v in leaders.items() if v == name and k != target)
                kills.append({"kill": i, "target": target, "server": name, "also": also, "connections": conns[name],
                              "at_step": at_step, "down_s": round(down_s, 1), "first_step_s": round(first, 2),
                              "stall_s": round(stall, 2), "settles": settles.since_mark()})  # fmt: skip
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
