"""Where a step's CPU goes on a tiny task: `rlbus up` of a bench/peer_trl.py task (its rlbus side, as that bench runs
it), with the CPU time of every process of the run read from /proc (psutil) at two steps, and that of the main
thread (event loop) and the other threads (generation, or the trainer's update) of each rlbus role, per step.

    .venv/bin/python bench/peer_trl.py --task adder1 --setup        # once: the task's model
    .venv/bin/python bench/step_cost.py [--task adder1] [--layouts 2x4 1x8] [--repeats 2] [--docs]

A layout PxT runs P producers of T tasks each at once (`rollout.num_producers`, `rollout.max_inflight_tasks`); the
task's own settings otherwise. CPU is counted from the 30th to the 170th metrics row of a 200-step run; "ms/step" is
that CPU over 140 steps. On a machine whose cores are all busy, CPU is what a step costs: a wall-clock timing inside
a process also counts the time it waited for a core. Writes bench/results/step_cost_<task>.json and, with --docs,
its section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

import psutil
import yaml

from bench.common import git_commit, machine, machine_line, write_section
from bench.peer_task import write_jsonl
from bench.peer_tasks import TASKS
from bench.peer_trl import rlbus_config

ROOT = Path(__file__).resolve().parents[1]
FROM, TO = 30, 170  # metrics rows between which CPU is counted
#: (group, what it is), in the report's order; `group()` sorts a process (or an rlbus role's thread) into one.
GROUPS = [("trainer update", "the trainer's other threads: its update (and weight gather)"),
          ("trainer loop", "the trainer's event loop: batches, feeder, events, weight publish, metrics"),
          ("producers generate", "the producers' other threads: generation and weight loads"),
          ("producers loop", "the producers' event loops: tasks, TransferQueue puts, groups, acks"),
          ("TransferQueue", "its shard actors (Ray)"), ("weight store", "its actor (Ray)"),
          ("nats-server", "the embedded bus"), ("Ray and the rest", "Ray's raylet, GCS and agents, the launcher")]


def group(cmdline: str, thread: str = "") -> str:
    for role in ("trainer", "producer"):
        if f"rlbus.cli {role}" in cmdline:
            name = "producers" if role == "producer" else role
            part = "loop" if thread == "main" else "generate" if role == "producer" else "update"
            return f"{name} {part}"
    if "ray::Shard" in cmdline:
        return "TransferQueue"
    if "ray::WeightVersions" in cmdline:
        return "weight store"
    if "nats-server" in cmdline:
        return "nats-server"
    return "Ray and the rest"


def cpu_snapshot(root: int) -> dict[str, float]:
    """CPU seconds so far of every process under `root` by group (an rlbus role split into its threads)."""
    out = {g: 0.0 for g, _ in GROUPS}
    try:
        procs = psutil.Process(root).children(recursive=True)
    except psutil.Error:
        return out
    for p in procs:
        try:
            cmd = " ".join(p.cmdline())
            if "rlbus.cli trainer" in cmd or "rlbus.cli producer" in cmd:
                for th in p.threads():
                    out[group(cmd, "main" if th.id == p.pid else "other")] += th.user_time + th.system_time
            else:
                c = p.cpu_times()
                out[group(cmd)] += c.user + c.system
        except psutil.Error:
            pass
    return out


def run_once(task_name: str, layout: str, work: Path, steps: int) -> dict:
    producers, tasks = (int(x) for x in layout.split("x"))
    task = TASKS[task_name]
    run_dir = work / f"run-{layout}-{time.monotonic_ns()}"
    run_dir.mkdir(parents=True)
    cfg = rlbus_config(task, work / "peer.jsonl", 0, steps, run_dir, f"cost-{run_dir.name[-6:]}")
    cfg["rollout"].update(num_producers=producers, max_inflight_tasks=tasks)
    (run_dir / "run.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    metrics, stamps, snaps = run_dir / "metrics.jsonl", [], {}
    t0 = time.time()
    with open(run_dir / "launcher.out", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "rlbus.cli", "up", str(run_dir / "run.yaml")], cwd=ROOT,
                                stdout=log, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            n = metrics.read_text().count("\n") if metrics.exists() else 0
            stamps += [time.time() - t0] * (n - len(stamps))
            for mark in (FROM, TO):
                if n >= mark and mark not in snaps:
                    snaps[mark] = cpu_snapshot(proc.pid)
            time.sleep(0.02)
    if proc.returncode != 0 or len(snaps) < 2:
        raise SystemExit(f"{layout}: rlbus up exited {proc.returncode} after {len(stamps)} steps; see {run_dir}")
    span = TO - FROM
    rows = [json.loads(line) for line in metrics.read_text().splitlines()][FROM:TO]
    cpu = {g: 1000 * (snaps[TO][g] - snaps[FROM][g]) / span for g, _ in GROUPS}
    return {"layout": layout, "steps_per_min": 60 * span / (stamps[TO - 1] - stamps[FROM - 1]),
            "wall_ms": 1000 * (stamps[TO - 1] - stamps[FROM - 1]) / span, "cpu_ms": cpu,
            "split_ms": {k: 1000 * statistics.median(r.get(k, 0.0) for r in rows)
                         for k in ("time/wait_data", "time/fetch", "time/train", "time/publish_weights")}}


def report(d: dict, wall_split: bool = True) -> str:
    """The section; `wall_split`: with the trainer's own wall-clock parts (the console's; the docs page leaves them
    to the results file)."""
    by = {lay: [r for r in d["runs"] if r["layout"] == lay] for lay in d["layouts"]}
    mean = {lay: {g: statistics.fmean(r["cpu_ms"][g] for r in rs) for g, _ in GROUPS} for lay, rs in by.items()}
    lines = [f"## Where a tiny step's CPU goes ({d['task']})", "",
             (f"`rlbus up` of `bench/peer_trl.py --task {d['task']}`'s rlbus side (8 prompts x 8 samples, at most 8 "
              f"new tokens, HF engine), {d['steps']} steps, {d['repeats']} run(s) a layout; CPU per step from /proc "
              f"between steps {FROM} and {TO}. PxT: P producers running T tasks at once each. Command: "
              f"`{d['command']}`. {machine_line(d['machine'])} rlbus at `{d['commit']}`, {d['date']}."), "",
             "| CPU ms per step | " + " | ".join(f"{lay}" for lay in d["layouts"]) + " | what it is |",
             "|---|" + "---:|" * len(d["layouts"]) + "---|"]
    infra = [g for g, _ in GROUPS[4:]]  # TransferQueue, weight store, nats-server, Ray: one row in the docs
    for g, what in GROUPS if wall_split else [*GROUPS[:4], (", ".join(infra), "")]:
        cell = {lay: sum(mean[lay][x] for x in infra) if g not in mean[lay] else mean[lay][g] for lay in d["layouts"]}
        lines.append(f"| {g} | " + " | ".join(f"{cell[lay]:.1f}" for lay in d["layouts"]) + f" | {what} |")
    lines.append("| **all processes** | " + " | ".join(f"**{sum(mean[lay].values()):.0f}**" for lay in d["layouts"])
                 + " | two cores give 2 x the wall time |")
    for label, key in (("wall ms per step", "wall_ms"), ("steps/min", "steps_per_min")):
        lines.append(f"| {label} | " + " | ".join(
            "/".join(f"{r[key]:.0f}" for r in by[lay]) for lay in d["layouts"]) + " | each run |")
    for k in ("time/wait_data", "time/fetch", "time/train", "time/publish_weights") if wall_split else ():
        lines.append(f"| trainer's `{k}` (wall, median) | " + " | ".join(
            f"{statistics.fmean(r['split_ms'][k] for r in by[lay]):.1f}" for lay in d["layouts"]) + " | |")
    first = d["layouts"][0]
    m, wall = mean[first], statistics.fmean(r["wall_ms"] for r in by[first])
    total, maths = sum(m.values()), m["trainer update"] + m["producers generate"]
    lines += ["", (f"Read: in {first}, the run's processes used {total:.0f} ms of CPU a step in {wall:.0f} ms of wall "
                   f"time, {100 * total / (2 * wall):.0f}% of two cores, so a step is as fast as the CPU it needs. "
                   f"Generation and the update took {maths:.0f} ms ({100 * maths / total:.0f}%); the rest, "
                   f"{total - maths:.0f} ms, is spread over the event loops ({m['producers loop'] + m['trainer loop']:.0f}"
                   f" ms), the TransferQueue ({m['TransferQueue']:.0f}), the bus ({m['nats-server']:.0f}), the weight "
                   f"store ({m['weight store']:.0f}) and Ray ({m['Ray and the rest']:.0f}). The trainer's own wall-clock "
                   "parts count the time it waited for a core" + ("." if wall_split else
                                                                  f": `bench/results/step_cost_{d['task']}.json`."))]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="adder1", choices=[t for t in TASKS if TASKS[t].max_new_tokens <= 8])
    ap.add_argument("--layouts", nargs="+", default=["2x4", "1x8"])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--docs", action="store_true", help="write the section into docs/benchmarks.md")
    ap.add_argument("--from-json", default="", help="only report these results")
    args = ap.parse_args()
    results = ROOT / "bench" / "results" / f"step_cost_{args.task}.json"
    if args.from_json:
        d = json.loads(Path(args.from_json).read_text())
    else:
        task = TASKS[args.task]
        if not (task.model / "config.json").is_file():
            raise SystemExit(f"no model at {task.model}: run `.venv/bin/python bench/peer_trl.py --task {args.task} "
                             "--setup` first")
        d = {"command": shlex.join(["python", "bench/step_cost.py", *sys.argv[1:]]), "task": args.task, "steps": 200,
             "layouts": args.layouts, "repeats": args.repeats, "machine": machine(), "commit": git_commit(),
             "date": time.strftime("%Y-%m-%d"), "runs": []}
        with tempfile.TemporaryDirectory(prefix="rlbus-step-cost-") as tmp:
            work = Path(tmp)
            write_jsonl(work / "peer.jsonl", 4096, 0, task.system, task.operands)
            for _ in range(args.repeats):
                for layout in args.layouts:
                    d["runs"].append(run_once(args.task, layout, work, d["steps"]))
                    r = d["runs"][-1]
                    print(f"{layout}: {r['steps_per_min']:.0f} steps/min, CPU {sum(r['cpu_ms'].values()):.0f} ms "
                          f"a step over {r['wall_ms']:.0f} ms", flush=True)
        results.write_text(json.dumps(d, indent=1) + "\n")
    text = report(d)
    print(text)
    if args.docs:
        write_section(text.splitlines()[0], report(d, wall_split=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
