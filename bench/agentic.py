"""Agentic RL with a slow tool: how much of its speed rlbus keeps when each tool call waits on a remote service.

    .venv/bin/python bench/agentic.py [--medians 1.0] [--seeds 0] [--steps 30] [--arms nolat async sync] [--docs]
                                      [KEY=VALUE ...]   # overrides for every arm

Workload B1: the quickstart's task and model with its calculator behind a lognormal latency (bench/agentic_tools.py:
median M seconds, sigma 1, capped at 8 s; an async tool, as an HTTP API is). Arms, run one after another in one
invocation on the same machine (each its own `rlbus up`, from scratch):

- `nolat`: the calculator without latency (the speed to keep);
- `async`: the slow calculator, rlbus's defaults for such a run (`rollout.max_inflight_tasks=0`: tasks in flight sized
  from the engine's idle time; the staleness bound follows the measured wait up to trainer.max_staleness_for_latency);
- `sync`: the slow calculator, synchronous (`trainer.max_staleness=0 trainer.max_staleness_for_latency=0`): one
  step's groups in flight, all on the current weights.

`nolat` and `async` both run `rollout.max_inflight_tasks=0` (the quickstart config pins 1, as its published figures
were measured). Per run, after a warm-up of 3 steps: steps/min (from the stamps of the metrics rows), the trainer's
idle share (its wait for data over the window), the p95 step interval, the mean weight publish time, the staleness
bound in force at the end and the mean staleness, and the reward over the last 10 steps. Results go to
bench/results/agentic.json (--results), and with --docs to the `## Agentic: a slow tool` section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path[0] = str(Path(__file__).resolve().parents[1])  # run as a script: the repository root, for `bench.*`

from bench.common import TIMED_OUT, git_commit, machine, shown, tail_up, write_section  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "quickstart.yaml"
RESULTS = ROOT / "bench" / "results" / "agentic.json"
HEADING = "## Agentic: a slow tool"
WARMUP = 3
SLOW_TOOL = "rollout.tools=[bench.agentic_tools:RemoteCalculator]"
ARMS: dict[str, list[str]] = {
    "nolat": ["rollout.max_inflight_tasks=0"],
    "async": [SLOW_TOOL, "rollout.max_inflight_tasks=0"],
    "sync": [SLOW_TOOL, "rollout.max_inflight_tasks=0", "trainer.max_staleness=0",
             "trainer.max_staleness_for_latency=0"],
}


def summarise(rows: list[dict], stamps: list[float]) -> dict[str, Any]:
    """Rates over the steps after the warm-up, from the moment the warm-up's last row landed."""
    steps = [(r, t) for r, t in zip(rows, stamps) if "reward/mean" in r]
    if len(steps) <= WARMUP + 1:
        return {"error": f"only {len(steps)} step(s)"}
    measured = steps[WARMUP:]
    window = measured[-1][1] - steps[WARMUP - 1][1]
    intervals = sorted(b[1] - a[1] for a, b in zip(steps[WARMUP - 1:], measured))
    wait = sum(r.get("time/wait_data", 0.0) for r, _ in measured)
    rewards = [r["reward/mean"] for r, _ in steps]
    return {
        "steps": len(steps),
        "steps_per_min": round(60.0 * len(measured) / window, 2),
        "trainer_idle": round(wait / window, 3),
        "p95_step_interval_s": round(intervals[min(len(intervals) - 1, int(0.95 * len(intervals)))], 2),
        "publish_s": round(statistics.fmean(r.get("time/publish_weights", 0.0) for r, _ in measured), 4),
        "staleness_bound_end": steps[-1][0].get("staleness/bound"),
        "staleness_mean": round(statistics.fmean(r.get("staleness/mean", 0.0) for r, _ in measured), 2),
        "first5": round(statistics.fmean(rewards[:5]), 3),
        "last10": round(statistics.fmean(rewards[-10:]), 3),
        "rewards": [round(x, 3) for x in rewards],
        "window_s": round(window, 1),
    }


def run_arm(arm: str, median: float, seed: int, steps: int, work: Path, timeout: float,
            overrides: list[str] = ()) -> dict[str, Any]:
    run_dir = work / f"{arm}-m{median:g}-s{seed}"
    argv = [sys.executable, "-m", "rlbus.cli", "up", str(CONFIG), f"name=agentic-{arm}-s{seed}",
            f"logging.run_dir={run_dir}", f"trainer.total_steps={steps}", f"trainer.seed={seed}", f"feeder.seed={seed}",
            f"data.seed={seed}", "logging.plot=false", "eval.interval=0", *overrides, *ARMS[arm]]
    env = dict(os.environ, RLBUS_TOOL_MEDIAN_S=str(median), RLBUS_TOOL_SIGMA="1.0", RLBUS_TOOL_CAP_S="8.0",
               RLBUS_TOOL_SEED=str(seed))
    rows, stamps, rc, started, ended = tail_up(argv, run_dir, timeout, env=env)
    out: dict[str, Any] = {"arm": arm, "median_s": median if arm != "nolat" else 0.0, "seed": seed, "rc": rc,
                           "wall_s": round(ended - started, 1)}
    out.update(summarise(rows, stamps))
    if rc not in (0, TIMED_OUT) or "error" in out:
        log = (run_dir / "launcher.out").read_text(errors="replace").strip().splitlines()
        out["log_tail"] = log[-30:]
    return out


def by_arm(d: dict[str, Any]) -> str:
    """The docs page's section: each arm and tool median over its seeds (every seed's row stays in `report`,
    printed on the console, and the results file)."""
    ok = [r for r in d["runs"] if "steps_per_min" in r]
    base = {r["seed"]: r["steps_per_min"] for r in ok if r["arm"] == "nolat"}
    keys = list(dict.fromkeys((r["arm"], r["median_s"]) for r in d["runs"]))
    lines = [f"Command: `{d['command'].strip()}` (commit `{d['commit']}`, {d['date']}). Machine: "
             f"{d['machine']['cpu_model']}, {d['machine']['cores']} cores, load {d['machine']['load_avg_1m']} at the "
             "start. The quickstart's task and model; the calculator behind a lognormal latency (sigma 1, capped at "
             f"8 s); {d['steps']} steps, rates after {WARMUP} warm-up steps.", "",
             ("| arm | tool median | seeds | steps/min, mean (range) | of no-latency | mean staleness | "
              "reward last 10 |"),
             "|---|---:|---:|---|---:|---:|---:|"]
    for arm, median in keys:
        rs = [r for r in ok if (r["arm"], r["median_s"]) == (arm, median)]
        failed = sum(1 for r in d["runs"] if (r["arm"], r["median_s"]) == (arm, median) and r not in rs)
        if not rs:
            lines.append(f"| {arm} | {median:g} s | {failed} failed | | | | |")
            continue
        rate = [r["steps_per_min"] for r in rs]
        share = [r["steps_per_min"] / base[r["seed"]] for r in rs if r["seed"] in base]
        lines.append(f"| {arm} | {median:g} s | {len(rs)}" + (f" ({failed} failed)" if failed else "")
                     + f" | {statistics.fmean(rate):.1f} ({min(rate):.1f}-{max(rate):.1f}) | "
                     + (f"{statistics.fmean(share):.0%}" if share else "-")
                     + f" | {statistics.fmean(r['staleness_mean'] for r in rs):.2f} | "
                     f"{statistics.fmean(r['last10'] for r in rs):.3f} |")
    lines += ["", f"Every seed's row (trainer idle, p95 step interval, staleness bound): {shown(Path(d['results']))}."]
    return "\n".join(lines)


def report(d: dict[str, Any]) -> str:
    lines = [f"Command: `{d['command']}` (commit `{d['commit']}`, {d['date']}). Machine: {d['machine']['cpu_model']}, "
             f"{d['machine']['cores']} cores, load {d['machine']['load_avg_1m']} at the start. The quickstart's "
             "task and model; the calculator behind a lognormal latency (sigma 1, capped at 8 s); "
             f"{d['steps']} steps, rates after {WARMUP} warm-up steps.", "",
             "| arm | tool median | seed | steps/min | of no-latency | trainer idle | p95 step interval | "
             "staleness bound (end) | mean staleness | reward first 5 | reward last 10 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    base = {r["seed"]: r["steps_per_min"] for r in d["runs"] if r["arm"] == "nolat" and "steps_per_min" in r}
    for r in d["runs"]:
        if "steps_per_min" not in r:
            lines.append(f"| {r['arm']} | {r['median_s']:g} s | {r['seed']} | failed: {r.get('error', r['rc'])} "
                         "| | | | | | | |")
            continue
        share = f"{r['steps_per_min'] / base[r['seed']]:.0%}" if r["seed"] in base else "-"
        lines.append(f"| {r['arm']} | {r['median_s']:g} s | {r['seed']} | {r['steps_per_min']:.1f} | {share} | "
                     f"{r['trainer_idle']:.0%} | {r['p95_step_interval_s']:.2f} s | {r['staleness_bound_end']} | "
                     f"{r['staleness_mean']:.2f} | {r['first5']:.3f} | {r['last10']:.3f} |")
    lines += ["", f"Results: {shown(Path(d['results']))}."]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--medians", type=float, nargs="+", default=[1.0], help="tool latency medians (seconds)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--docs", action="store_true", help="write the section of docs/benchmarks.md")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                    help="config overrides for every arm (an arm's own settings win)")
    args = ap.parse_args()
    d: dict[str, Any] = {"command": "python bench/agentic.py " + " ".join(sys.argv[1:]), "commit": git_commit(),
                         "date": time.strftime("%Y-%m-%d"), "machine": machine(), "steps": args.steps,
                         "results": str(args.results), "runs": []}
    with tempfile.TemporaryDirectory(prefix="rlbus-agentic-") as tmp:
        for seed in args.seeds:
            for median in args.medians:
                for arm in args.arms:
                    if arm == "nolat" and median != args.medians[0]:
                        continue  # one no-latency run per seed
                    r = run_arm(arm, median, seed, args.steps, Path(tmp), args.timeout, args.overrides)
                    print(json.dumps({k: v for k, v in r.items() if k not in ("rewards", "log_tail")}), flush=True)
                    d["runs"].append(r)
                    args.results.parent.mkdir(parents=True, exist_ok=True)
                    args.results.write_text(json.dumps(d, indent=1) + "\n")
    print(report(d))
    if args.docs:
        write_section(HEADING, by_arm(d))
    return 0


if __name__ == "__main__":
    sys.exit(main())
