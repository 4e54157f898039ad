"""Is the quickstart's learning stable? `rlbus up configs/quickstart.yaml` once per seed, each from scratch.

    .venv/bin/python bench/quickstart_seeds.py [--seeds 0 1 2 3 4] [--docs docs/benchmarks.md] [k=v ...]

A seed sets the trainer's torch seed, the feeder's shuffle and the synthetic data set (`trainer.seed`,
`feeder.seed`, `data.seed`); sampling in the producers is not seeded, so two runs of one seed differ too. Each run
uses the cached quickstart model and its own run directory (removed afterwards). Per seed: reward over the first 5
and last 10 steps, the lowest 5-step running mean after step 10, entropy and clip fraction over the last 10 steps.
A run *collapses* when its last-10 reward is under 0.85 (the bar; the collapses seen before ended at 0.0-0.25
with entropy near 0.003). Low entropy alone is no collapse: a policy that is right every time may be certain. Extra `k=v` arguments are config overrides for every run (e.g. `trainer.mini_batches=1` for
the before). Writes bench/results/quickstart_seeds.json and, with --docs, the `## Quickstart stability` section.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # run as a script: the repository root, for `bench.*`

from bench.common import git_commit, machine, run_up, write_section
from bench.report import command as typed
from rlbus.schemas.config import GUARD_RULES

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "quickstart.yaml"
RESULTS = ROOT / "bench" / "results" / "quickstart_seeds.json"
HEADING = "## Quickstart stability"
BAR = 0.85
#: The goal (issue: every seed ends with a last-10 reward at or above it, quiet or busy).
GOAL = 0.9
#: A near-deterministic policy: mean entropy per token under this.
LOW_ENTROPY = 0.01
#: Per-step metrics kept in the results, to judge the guard's rules on them afterwards (trainer/guard.py).
SERIES = ("reward/mean", "actor/entropy", "mismatch/kl_k3", "actor/grad_norm", "actor/clipfrac", "guard/fired",
          "time/step", "time/wait_data", "perf/peak_rss_gb")  # a step's seconds and its wait for groups before it


def summarise(rows: list[dict], discarded: list[dict] = ()) -> dict[str, float]:
    """Per-run figures from its metrics rows; `discarded`: rows of steps a guard rollback dropped
    (metrics.discarded.jsonl), which count for the guard's firings only."""
    rewards = [r["reward/mean"] for r in rows]
    late = [statistics.fmean(rewards[i - 4:i + 1]) for i in range(max(10, 4), len(rewards))]
    last = rows[-10:]
    unconverged = rows[:converged_at(rewards)]
    return {
        "steps": len(rows),
        "first5": statistics.fmean(rewards[:5]),
        "last10": statistics.fmean(rewards[-10:]),
        "min_running5_after_10": min(late) if late else float("nan"),
        "entropy_last10": statistics.fmean(r.get("actor/entropy", 0.0) for r in last),
        "clipfrac_last10": statistics.fmean(r.get("actor/clipfrac", 0.0) for r in last),
        "clipfrac_mean": statistics.fmean(r.get("actor/clipfrac", 0.0) for r in rows),
        # Entropy before the reward first converged (its 5-step running mean reached the goal): a near-deterministic
        # policy there is the collapse that one bad update can flip.
        "entropy_min_unconverged": min((r.get("actor/entropy", 1.0) for r in unconverged), default=float("nan")),
        # The same judged step by step: steps before convergence whose policy was near-deterministic while that
        # step's own reward was under the goal (certain and often wrong). The running mean above lags the reward by
        # up to 4 steps, so it also counts the steps where reward and entropy settled together.
        "early_low_entropy_steps": sum(1 for r in unconverged
                                       if r.get("actor/entropy", 1.0) < LOW_ENTROPY and r["reward/mean"] < GOAL),
        # The stability guard (trainer/guard.py): steps it fired on, which rules, rollbacks.
        "guard_steps": sum(1 for r in [*rows, *discarded] if r.get("guard/fired")),
        "guard_rules": sorted({k.removeprefix("guard/") for r in [*rows, *discarded] for k in r
                               if k.startswith("guard/") and k.removeprefix("guard/") in GUARD_RULES}),
        "guard_rollbacks": int(max((r.get("guard/rollbacks", 0) for r in rows), default=0)),
    }


def converged_at(rewards: list[float]) -> int:
    """Index of the first step whose 5-step running mean of the reward reaches GOAL (len(rewards) if none does)."""
    for i in range(len(rewards)):
        if statistics.fmean(rewards[max(0, i - 4):i + 1]) >= GOAL:
            return i
    return len(rewards)


def collapsed(s: dict[str, float]) -> bool:
    return s["last10"] < BAR


def run_seed(seed: int, overrides: list[str], work: Path, timeout: float, config: Path = CONFIG,
             keep: Path | None = None) -> dict:
    run_dir = work / f"qs-s{seed}"
    argv = [sys.executable, "-m", "rlbus.cli", "up", str(config), f"name=qs-seed{seed}", f"logging.run_dir={run_dir}",
            f"trainer.seed={seed}", f"feeder.seed={seed}", f"data.seed={seed}", "logging.plot=false", *overrides]
    t0 = time.monotonic()
    rc, output = run_up(argv, timeout)
    wall = time.monotonic() - t0
    metrics = run_dir / "metrics.jsonl"
    every = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.is_file() else []
    rows = [r for r in every if "reward/mean" in r]  # the training steps; an evaluation is a row of its own
    out = {"seed": seed, "rc": rc, "wall_s": wall, "rewards": [r["reward/mean"] for r in rows],
           "series": {k: [r.get(k) for r in rows] for k in SERIES},
           "evals": [{k: v for k, v in r.items() if k in ("step", "version") or k.startswith("eval/")}
                     for r in every if "eval/accuracy" in r]}
    if rc != 0 or not rows:
        out["error"] = output.strip().splitlines()[-40:]
        if keep is not None and run_dir.is_dir():  # the roles' logs say why
            dest = keep / f"{run_dir.name}-failed-{int(time.time())}"
            shutil.copytree(run_dir, dest, ignore=shutil.ignore_patterns("bus"))
            out["kept"] = str(dest)
        return out
    dropped = run_dir / "metrics.discarded.jsonl"
    discarded = [json.loads(x) for x in dropped.read_text().splitlines() if x.strip()] if dropped.is_file() else []
    out.update(summarise(rows, discarded))
    if discarded:  # the steps a guard rollback dropped: what it caught
        out["discarded"] = {k: [r.get(k) for r in discarded] for k in ("step", *SERIES)}
    out["collapsed"] = collapsed(out)
    if keep is not None and out["last10"] < GOAL:  # its event log, checkpoints and metrics, for `rlbus replay`
        dest = keep / f"{run_dir.name}-{int(time.time())}"
        shutil.copytree(run_dir, dest, ignore=shutil.ignore_patterns("bus"))
        out["kept"] = str(dest)
    return out


def report(d: dict) -> str:
    ok = [r for r in d["runs"] if "last10" in r]
    for r in ok:  # by the rule of this version of the script, also for results written by an older one
        r["collapsed"] = collapsed(r)
    lines = [
        HEADING, "",
        (f"`rlbus up configs/{Path(d.get('config', CONFIG)).name}` once per seed ({', '.join(str(r['seed']) for r in d['runs'])}), each "
        "from scratch with the config's model (cached); a seed sets `trainer.seed`, `feeder.seed` and `data.seed` "
        "(producers' sampling is not seeded). A run collapses when its last-10 reward is under "
        f"{BAR} (low entropy alone is not a collapse: a policy right every time may be certain)."),
        "",
        f"Command: `{d['command']}`  ",
        (f"Machine: {d['machine']['cpu_model']}, {d['machine']['cores']} cores shared with other work (1-minute load "
        f"{d['machine']['load_avg_1m']} at the start; {d.get('busy_cpus', 0)} CPU(s) kept busy by spinning processes); rlbus at commit `{d['commit']}`; config overrides: "
        f"{' '.join(d['overrides']) or 'none'}."),
        "",
        ("| seed | reward first 5 | reward last 10 | lowest 5-step mean after step 10 | entropy last 10 | "
        f"lowest entropy before the reward reached {GOAL} | clip fraction, run mean | guard fired (steps: rules) | "
        "wall s | collapsed |"),
        "|---:|---:|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for r in d["runs"]:
        if "last10" not in r:
            lines.append(f"| {r['seed']} | failed (exit {r['rc']}) | | | | | | | {r['wall_s']:.0f} | |")
            continue
        fired = (f"{r['guard_steps']}: {', '.join(r['guard_rules'])}" if r.get("guard_steps") else
                 "0" if "guard_steps" in r else "n/a")
        if r.get("guard_rollbacks"):
            fired += f"; {r['guard_rollbacks']} rollback(s)"
        lines.append(f"| {r['seed']} | {r['first5']:.3f} | {r['last10']:.3f} | {r['min_running5_after_10']:.3f} | "
                     f"{r['entropy_last10']:.3f} | {r.get('entropy_min_unconverged', float('nan')):.3f} | "
                     f"{r['clipfrac_mean']:.4f} | {fired} | {r['wall_s']:.0f} | "
                     f"{'**yes**' if r['collapsed'] else 'no'} |")
    evals = [r for r in ok if r.get("evals")]
    if evals:  # held-out evaluation (eval.interval): greedy accuracy per scored version
        versions = sorted({e["version"] for r in evals for e in r["evals"]})
        lines += ["", "Held-out `eval/accuracy` (and `eval/tool_call_rate`) by weight version:", "",
                  "| seed | " + " | ".join(f"v{v}" for v in versions) + " |",
                  "|---:|" + "---:|" * len(versions)]
        for r in evals:
            at = {e["version"]: e for e in r["evals"]}
            cells = [f"{at[v]['eval/accuracy']:.2f} ({at[v].get('eval/tool_call_rate', float('nan')):.2f})"
                     if v in at else "" for v in versions]
            lines.append(f"| {r['seed']} | " + " | ".join(cells) + " |")
    if ok:
        last = [r["last10"] for r in ok]
        early = [r for r in ok if r.get("entropy_min_unconverged", 1.0) < LOW_ENTROPY]
        lines += ["", (f"Last-10 reward: mean {statistics.fmean(last):.3f}, min {min(last):.3f}, max {max(last):.3f}; "
                      f"{sum(x >= GOAL for x in last)} of {len(d['runs'])} at or above {GOAL} (the goal); "
                      f"{sum(r['collapsed'] for r in ok)} of {len(ok)} collapsed (under {BAR}); "
                      f"{len(early)} with entropy under {LOW_ENTROPY} before the reward reached {GOAL}; the stability "
                      f"guard fired in {sum(1 for r in ok if r.get('guard_steps'))} run(s). Results: "
                      f"`{d.get('results', 'bench/results/quickstart_seeds.json')}`."), ""]
    return "\n".join(lines)


def docs_section(d: dict, heading: str = HEADING) -> str:
    """The docs page's section: what ran, the command, the machine and the result; every seed's row stays in the
    results file (and in `report`, printed on the console)."""
    ok = [r for r in d["runs"] if "last10" in r]
    m = d["machine"]
    by_seed = ", ".join(f"{r['last10']:.3f}" if "last10" in r else f"failed (exit {r['rc']})" for r in d["runs"])
    lines = [
        heading, "",
        (f"`rlbus up configs/{Path(d.get('config', CONFIG)).name}` once per seed, each from scratch with the config's "
         "model (cached); a seed sets `trainer.seed`, `feeder.seed` and `data.seed` (producers' sampling is not "
         f"seeded); config overrides: {' '.join(d['overrides']) or 'none'}. Command: `{typed(d['command'])}`. "
         f"Machine: {m['cpu_model']}, {m['cores']} cores, 1-minute load {m['load_avg_1m']} at the start"
         + (f", {d['busy_cpus']} cores kept busy by spinning processes" if d.get("busy_cpus") else "")
         + f"; rlbus at `{d['commit']}`."),
    ]
    evals = [r for r in ok if r.get("evals")]
    if evals:  # held-out evaluation (eval.interval): greedy accuracy per scored version
        versions = sorted({e["version"] for r in evals for e in r["evals"]})
        lines += ["", "Held-out greedy `eval/accuracy` by weight version:", "",
                  "| seed | " + " | ".join(f"v{v}" for v in versions) + " |", "|---:|" + "---:|" * len(versions)]
        for r in evals:
            at = {e["version"]: e for e in r["evals"]}
            lines.append(f"| {r['seed']} | " + " | ".join(f"{at[v]['eval/accuracy']:.2f}" if v in at else ""
                                                          for v in versions) + " |")
    if ok:
        last = [r["last10"] for r in ok]
        lines += ["", (f"Last-10 reward: mean {statistics.fmean(last):.3f}, min {min(last):.3f}, max {max(last):.3f}; "
                       f"{sum(x >= GOAL for x in last)} of {len(d['runs'])} at or above {GOAL} (the goal); "
                       f"{sum(collapsed(r) for r in ok)} collapsed (under {BAR}); the stability guard fired in "
                       f"{sum(1 for r in ok if r.get('guard_steps'))} run(s). By seed: {by_seed}. Every seed's "
                       f"row: `{d.get('results', 'bench/results/quickstart_seeds.json')}`.")]
    return "\n".join([*lines, ""])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--results", default=str(RESULTS))
    ap.add_argument("--docs", default="", help="write the section into this benchmarks page")
    ap.add_argument("--heading", default=HEADING, help="the docs section's heading")
    ap.add_argument("--keep", default="", help="copy the run directories of runs under the goal here")
    ap.add_argument("--from-json", default="")
    ap.add_argument("--config", default=str(CONFIG), help="the run config (configs/quickstart_vllm.yaml: on vLLM)")
    ap.add_argument("--busy", type=int, default=0, help="keep this many CPUs busy with spinning processes meanwhile")
    ap.add_argument("overrides", nargs="*", help="config overrides k=v for every run")
    args = ap.parse_args()
    if args.from_json:
        d = json.loads(Path(args.from_json).read_text())
    else:
        commit = git_commit()
        d = {"command": shlex.join([".venv/bin/python", "bench/quickstart_seeds.py", *sys.argv[1:]]),
             "machine": machine(), "commit": commit, "date": time.strftime("%Y-%m-%d"), "config": args.config,
             "overrides": args.overrides, "runs": [],
             "results": str(Path(args.results).resolve().relative_to(ROOT)) if Path(args.results).resolve()
             .is_relative_to(ROOT) else args.results}
        work = Path(tempfile.mkdtemp(prefix="rlbus-qs-seeds-"))
        # A busy machine: other processes that want every cycle they can get, started here and ended by pid.
        spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
        d["busy_cpus"] = args.busy
        try:
            for seed in args.seeds:
                r = run_seed(seed, args.overrides, work, args.timeout, Path(args.config),
                             keep=Path(args.keep) if args.keep else None)
                d["runs"].append(r)
                print(json.dumps({k: v for k, v in r.items() if k not in ("rewards", "series")}), flush=True)
        finally:
            for p in spinners:
                p.kill()
                p.wait()
            shutil.rmtree(work, ignore_errors=True)
        Path(args.results).parent.mkdir(parents=True, exist_ok=True)
        Path(args.results).write_text(json.dumps(d, indent=1) + "\n")
    print(report(d).replace(HEADING, args.heading, 1))
    if args.docs:
        write_section(args.heading, docs_section(d, args.heading), Path(args.docs))
    ok = [r for r in d["runs"] if "last10" in r]
    return 0 if len(ok) == len(d["runs"]) and not any(r["collapsed"] for r in ok) else 1


if __name__ == "__main__":
    sys.exit(main())
