"""Does a model learn an environment's task, seed after seed? `rlbus up CONFIG` once per seed, from scratch, with the
held-out accuracy the run's evaluator measured at each scored weight version.

    .venv/bin/python bench/env_task.py configs/gcd_smollm2.yaml --seeds 0 1 2 [--docs] [k=v ...]

A seed sets `trainer.seed` and `feeder.seed` (the trainer's torch seed and the prompt order); the environment's
`env.seed` stays, so every seed is scored on the same held-out questions. Each run's directory is removed afterwards
(a 30-step SmolLM2 run writes about 2 GB of checkpoints and weights), once its metrics and its ledger
(`rlbus events RUN_DIR --ledger --json`) are read. Writes bench/results/env_task_<config name>.json, a curve beside
it (docs/images/, .png) and, with --docs, the config's section of docs/benchmarks.md (bench/report.py's table reads the results).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # run as a script: the repository root, for `bench.*`

from bench.common import git_commit, machine, run_ledger, write_section
from bench.quickstart_seeds import run_seed

ROOT = Path(__file__).resolve().parents[1]
#: The issue's goal: held-out accuracy up by at least this much from version 0 to the last version, every seed.
GOAL_POINTS = 0.20


def run_one(config: Path, seed: int, overrides: list[str], work: Path, timeout: float) -> dict:
    """One seed by bench/quickstart_seeds.py's `run_seed` (the same argv and metrics reading), then its ledger."""
    got = run_seed(seed, overrides, work, timeout, config=config)
    run_dir = work / f"qs-s{seed}"  # run_seed's run directory
    series = got.get("series", {})
    out: dict = {
        "seed": seed, "rc": got["rc"], "wall_s": round(got["wall_s"], 1),
        "train": [{"step": i + 1, "reward": round(r, 4), "step_s": round(t or 0.0, 1), "wait_s": round(w or 0.0, 1)}
                  for i, (r, t, w) in enumerate(zip(got.get("rewards", []), series.get("time/step", []),
                                                    series.get("time/wait_data", [])))],
        "eval": [{"version": e["version"], "accuracy": round(e["eval/accuracy"], 4),
                  "pass@n": round(next((v for k, v in e.items() if k.startswith("eval/pass@")), float("nan")), 4),
                  "prompts": e["eval/num_prompts"], "response_tokens": round(e["eval/response_length"], 1),
                  "seconds": round(e["eval/seconds"], 1)} for e in got.get("evals", [])],
    }
    out["ledger"] = run_ledger(run_dir)
    if "error" in got:
        out["error"] = got["error"]
    shutil.rmtree(run_dir, ignore_errors=True)
    return out


def gain(run: dict) -> float | None:
    ev = run["eval"]
    return ev[-1]["accuracy"] - ev[0]["accuracy"] if len(ev) >= 2 and ev[0]["version"] == 0 else None


def plot(d: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc, rew) = plt.subplots(1, 2, figsize=(10, 3.6))
    for r in d["runs"]:
        acc.plot([e["version"] for e in r["eval"]], [e["accuracy"] for e in r["eval"]], marker="o",
                 label=f"seed {r['seed']}")
        rew.plot([t["step"] for t in r["train"]], [t["reward"] for t in r["train"]], alpha=0.8,
                 label=f"seed {r['seed']}")
    acc.set(xlabel="weight version", ylabel="held-out accuracy", title="held-out accuracy (evaluator)", ylim=(0, 1))
    rew.set(xlabel="trainer step", ylabel="reward (incl. format reward)", title="training reward")
    for ax in (acc, rew):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(d["title"], fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def heading(d: dict) -> str:
    return f"## Learning a reasoning-gym task: {d['title']}"


def image(d: dict) -> Path:
    """The curves' file, beside the docs page that shows them."""
    return ROOT / "docs" / "images" / Path(d["results"]).with_suffix(".png").name


def report(d: dict) -> str:
    runs = [r for r in d["runs"] if r["eval"]]
    versions = sorted({e["version"] for r in runs for e in r["eval"]})
    lines = [
        heading(d), "",
        (f"`{d['command']}`: `rlbus up {d['config']}` once per seed, each from scratch; a seed sets `trainer.seed` "
         "and `feeder.seed`, the held-out questions are the same for every seed, and producers' sampling is not "
         "seeded. Accuracy is the share of right answers among the evaluator's samples of each held-out question "
         "at the training temperature. "
         f"Machine: {d['machine']['cpu_model']}, {d['machine']['cores']} cores, 1-minute load "
         f"{d['machine']['load_avg_1m']} at the start (trainer, producers and evaluator share the cores); rlbus at `{d['commit']}`, {d['date']}; config overrides: "
         f"{' '.join(d['overrides']) or 'none'}."), "",
        "| seed | " + " | ".join(f"v{v}" for v in versions) + " | gain | pass@n last | response tokens first, last | "
        "steps, minutes of steps | ledger |",
        "|---:|" + "---:|" * len(versions) + "---:|---:|---:|---:|---|",
    ]
    for r in d["runs"]:
        at = {e["version"]: e for e in r["eval"]}
        g = gain(r)
        led = r.get("ledger")
        led_s = ("clean" if led and not led["problems"] else f"problems: {led['problems']}" if led else "unread")
        if not r["eval"]:
            lines.append(f"| {r['seed']} | failed (exit {r['rc']}) |" + " |" * (len(versions) + 4))
            continue
        lines.append(
            f"| {r['seed']} | " + " | ".join(f"{at[v]['accuracy']:.3f}" if v in at else "" for v in versions)
            + f" | {'' if g is None else f'{g:+.3f}'} | {r['eval'][-1]['pass@n']:.2f} | "
            f"{r['eval'][0]['response_tokens']:.0f}, {r['eval'][-1]['response_tokens']:.0f} | "
            f"{len(r['train'])}, {sum(t['step_s'] for t in r['train']) / 60:.1f} | {led_s} |")
    notes = [f"Seed {r['seed']}: {r['note']}." for r in d["runs"] if r.get("note")]
    notes += [d["conditions"] + "."] if d.get("conditions") else []
    gains = [g for g in map(gain, runs) if g is not None]
    if gains:  # the result first, then the notes, in one paragraph
        last = [r["eval"][-1]["accuracy"] for r in runs]
        notes.insert(0, f"Gain from version 0 to the last: mean {statistics.fmean(gains):+.3f}, min {min(gains):+.3f}, "
                     f"max {max(gains):+.3f} over {len(gains)} seed(s); last accuracy mean {statistics.fmean(last):.3f}"
                     + (f" (sd {statistics.stdev(last):.3f})" if len(last) > 1 else "")
                     + f"; {sum(g >= GOAL_POINTS for g in gains)} of {len(gains)} seeds gained at least "
                     f"{GOAL_POINTS * 100:.0f} points. Results: `{d['results']}`.")
    lines += ["", " ".join(notes)] if notes else []
    lines += ["", f"![{d['title']}](images/{image(d).name})", ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds a run may take")
    ap.add_argument("--title", default="", help="the docs heading's and the plot's title")
    ap.add_argument("--docs", action="store_true", help="write the section into docs/benchmarks.md")
    ap.add_argument("--from-json", default="", help="re-render the report and plot of a results file")
    ap.add_argument("--tag", default="", help="results in env_task_<config name>_<tag>.json (a variant's runs)")
    ap.add_argument("overrides", nargs="*", help="config overrides k=v for every run")
    args = ap.parse_intermixed_args()
    config = Path(args.config)
    results = ROOT / "bench" / "results" / f"env_task_{config.stem}{'_' + args.tag if args.tag else ''}.json"
    if args.from_json:
        results = Path(args.from_json).resolve()
        d = json.loads(results.read_text())
    else:
        title = args.title or config.stem
        d = {"command": shlex.join(["python", "bench/env_task.py", *sys.argv[1:]]), "config": str(config),
             "title": title, "machine": machine(),
             "commit": git_commit(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "date": time.strftime("%Y-%m-%d"),
             "overrides": args.overrides,
             "results": str(results.relative_to(ROOT)), "runs": []}
        with tempfile.TemporaryDirectory(prefix="rlbus-env-task-") as work:
            for seed in args.seeds:
                run = run_one(config, seed, args.overrides, Path(work), args.timeout)
                d["runs"].append(run)
                results.write_text(json.dumps(d, indent=1) + "\n")  # after every seed: a stop loses one run at most
                print(f"seed {seed}: exit {run['rc']}, {run['wall_s']:.0f} s, held-out "
                      + ", ".join(f"v{e['version']} {e['accuracy']:.3f}" for e in run["eval"])
                      + f", ledger {run.get('ledger')}", flush=True)
    plot(d, image(d))
    text = report(d)
    print(text)
    if args.docs:
        write_section(heading(d), text)
    return 0 if all(r["rc"] == 0 for r in d["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
