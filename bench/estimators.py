"""Each advantage estimator and policy loss on one budget: one run of `rlbus up` per variant, same config and seed.

    .venv/bin/python bench/estimators.py [--config configs/smollm2_calculator.yaml] [--seed 0]
        [--variants grpo gae reinforce_plus_plus ...] [--docs docs/benchmarks.md] [k=v ...]

Every variant trains the same model on the same data, reward, samples per step and number of steps (the config's,
or `trainer.total_steps=N` among the overrides); only the estimator or the loss differs (VARIANTS below, each with
the settings its authors or verl's examples use). Per variant: the training reward at every step, held-out greedy
accuracy at every scored version (`eval.interval`), seconds per step and the trainer's peak RSS. Writes
bench/results/estimators_<config>.json, a plot of the curves next to it (.png) and, with --docs, a section of
docs/benchmarks.md. A variant runs by bench/quickstart_seeds.py's `run_seed`, so its figures read the same.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # run as a script: the repository root, for `bench.*`

from bench.common import git_commit, machine, machine_line, write_section
from bench.quickstart_seeds import run_seed

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "smollm2_calculator.yaml"

#: name -> config overrides on top of the config (which trains GRPO).
VARIANTS: dict[str, list[str]] = {
    "grpo": [],
    # PPO's critic: a second SmolLM2 with a fresh value head. gamma = lam = 1 with one reward at the end
    # (verl's PPO examples); the fresh head learns at 10x verl's default LR, and the actor waits one step for it.
    "gae": ["algorithm.adv_estimator=gae", "algorithm.gamma=1.0", "algorithm.lam=1.0", "critic.lr=1e-4",
            "critic.critic_warmup=1"],
    "reinforce_plus_plus": ["algorithm.adv_estimator=reinforce_plus_plus"],
    "reinforce_plus_plus_baseline": ["algorithm.adv_estimator=reinforce_plus_plus_baseline"],
    # GSPO's paper: a sequence-level ratio clipped at 3e-4 / 4e-4, each sequence's token mean averaged.
    "gspo": ["algorithm.loss_mode=gspo", "algorithm.clip_ratio_low=0.0003", "algorithm.clip_ratio_high=0.0004",
             "algorithm.loss_agg_mode=seq-mean-token-mean"],
    "cispo": ["algorithm.loss_mode=cispo"],
}


def heading(config: Path) -> str:
    return f"## Estimators and losses on one budget: {config.stem}"


def report(d: dict, by_step: bool = True) -> str:
    """The comparison; `by_step`: with the training reward of every step (the console's; the docs page leaves it
    to the results file and the plot)."""
    runs = d["runs"]
    lines = [
        heading(Path(d["config"])), "",
        (f"`rlbus up configs/{Path(d['config']).name}` once per variant, seed {d['seed']}, "
         f"{d['steps']} steps of the same batch (config overrides for all: {' '.join(d['overrides']) or 'none'}); "
         "only the estimator or the loss differs. Training reward is the step's batch mean; held-out accuracy is "
         "greedy (`eval.interval`). Producers' sampling is not seeded: one run per variant shows a curve, not a "
         f"ranking. Command: `{d['command']}`."),
        "",
        f"{machine_line(d['machine'])} rlbus at commit `{d['commit']}`; curves: `{d['plot']}`.",
        "",
    ]
    versions = sorted({e["version"] for r in runs for e in r.get("evals", [])})
    lines += [
        ("| variant | overrides | reward first 5 | reward last 5 | held-out accuracy "
         + " / ".join(f"v{v}" for v in versions) + " | median s/step | trainer peak RSS GB | guard fired | "
         "`rlbus up` wall s |"),
        "|---|---|---:|---:|---|---:|---:|---|---:|",
    ]
    for r in runs:
        over = " ".join(f"`{o}`" for o in VARIANTS.get(r["variant"], [])) or "(the config's GRPO)"
        if not r.get("rewards"):
            lines.append(f"| {r['variant']} | {over} | failed (exit {r['rc']}) | | | | | | {r['wall_s']:.0f} |")
            continue
        rw = r["rewards"]
        at = {e["version"]: e["eval/accuracy"] for e in r.get("evals", [])}
        held = " / ".join(f"{at[v]:.2f}" if v in at else "-" for v in versions)
        steps = [x for x in r["series"]["time/step"] if x is not None]
        rss = [x for x in r["series"].get("perf/peak_rss_gb", []) if x is not None]
        fired = (f"{r['guard_steps']}: {', '.join(r['guard_rules'])}" if r.get("guard_steps") else "0")
        step_s = f"{statistics.median(steps):.1f}" if steps else ""
        peak = f"{max(rss):.2f}" if rss else ""
        lines.append(f"| {r['variant']} | {over} | {statistics.fmean(rw[:5]):.3f} | {statistics.fmean(rw[-5:]):.3f} "
                     f"| {held} | {step_s} | {peak} | {fired} | {r['wall_s']:.0f} |")
    if not by_step:
        return "\n".join([*lines, "", "Training reward by step, and every run's series: "
                           f"`{Path(d['plot']).with_suffix('.json')}`.", ""])
    lines += ["", "Training reward by step:", "",
              "| variant | " + " | ".join(str(i + 1) for i in range(d["steps"])) + " |",
              "|---|" + "---:|" * d["steps"]]
    for r in runs:
        if r.get("rewards"):
            lines.append(f"| {r['variant']} | " + " | ".join(f"{x:.2f}" for x in r["rewards"]) + " |")
    return "\n".join(lines) + "\n"


def plot(d: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for r in d["runs"]:
        if not r.get("rewards"):
            continue
        a.plot(range(1, len(r["rewards"]) + 1), r["rewards"], marker=".", label=r["variant"])
        ev = sorted(r.get("evals", []), key=lambda e: e["version"])
        b.plot([e["version"] for e in ev], [e["eval/accuracy"] for e in ev], marker="o", label=r["variant"])
    a.set(xlabel="step", ylabel="training reward (batch mean)", ylim=(-0.02, 1.02))
    b.set(xlabel="weight version", ylabel="held-out greedy accuracy", ylim=(-0.02, 1.02))
    a.legend(fontsize=8)
    fig.suptitle(f"{Path(d['config']).stem}, seed {d['seed']}, commit {d['commit']}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(CONFIG))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--timeout", type=float, default=3600.0, help="per run, seconds")
    ap.add_argument("--results", default="", help="default bench/results/estimators_<config>.json")
    ap.add_argument("--docs", default="", help="write the section into this benchmarks page")
    ap.add_argument("--from-json", default="", help="only report (and plot) these results")
    ap.add_argument("overrides", nargs="*", help="config overrides k=v for every variant")
    args = ap.parse_args()
    config = Path(args.config).resolve()
    results = Path(args.results or ROOT / "bench" / "results" / f"estimators_{config.stem}.json")
    if args.from_json:
        d = json.loads(Path(args.from_json).read_text())
    else:
        commit = git_commit()
        d = {"command": shlex.join([".venv/bin/python", "bench/estimators.py", *sys.argv[1:]]),
             "machine": machine(), "commit": commit, "config": str(config.relative_to(ROOT)), "seed": args.seed,
             "overrides": args.overrides, "runs": []}
        work = Path(tempfile.mkdtemp(prefix="rlbus-estimators-"))
        try:
            for name in args.variants:
                (work / name).mkdir()
                r = run_seed(args.seed, [*args.overrides, *VARIANTS[name]], work / name, args.timeout, config)
                r["variant"] = name
                d["runs"].append(r)
                print(json.dumps({k: v for k, v in r.items() if k not in ("series",)}), flush=True)
                results.parent.mkdir(parents=True, exist_ok=True)
                results.write_text(json.dumps(d, indent=1) + "\n")  # kept as it goes: a long run may be stopped
        finally:
            shutil.rmtree(work, ignore_errors=True)
    d["steps"] = max((len(r.get("rewards", [])) for r in d["runs"]), default=0)
    d["plot"] = str(results.with_suffix(".png").relative_to(ROOT)) if results.resolve().is_relative_to(ROOT) \
        else str(results.with_suffix(".png"))
    results.write_text(json.dumps(d, indent=1) + "\n")
    plot(d, results.with_suffix(".png"))
    print(report(d))
    if args.docs:
        write_section(heading(Path(d["config"])), report(d, by_step=False), Path(args.docs))
    return 0 if all(r.get("rewards") and r["rc"] == 0 for r in d["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
