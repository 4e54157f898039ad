"""LoRA against full fine-tuning at equal wall clock: held-out accuracy of each side's models by the time it had them.

    .venv/bin/python bench/lora_accuracy.py [configs/gcd_smollm2.yaml] [--lora configs/gcd_lora_smollm2.yaml] \
        [--seeds 0 1 2] [--save-every 5] [--append] [--docs]

For each seed, `rlbus up` of the full fine-tuning config and of the LoRA config, one after the other (the order
alternating by seed), run and scored as bench/peer_env.py runs and scores its rlbus side: the evaluator off (so it
takes no core from the run), a checkpoint every --save-every steps, each exported afterwards and scored, one at a
time on a quiet machine, on the held-out split as the evaluator samples it. A model's time is when the trainer
published its version, from the moment the bench started the process. The two configs must train the same task with
the same rollout, algorithm, evaluation and budget; only the model's LoRA settings and the learning rate may differ.

Equal wall clock is the shorter run's last publish: each side is scored by the last model it had published by then.
The target is 0.9 x the lower side's mean final accuracy; a side's time to it is that of its first model that
reaches it. Writes bench/results/lora_accuracy.json, a plot (docs/images/lora_accuracy.png) and, with --docs, a
section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgspec

sys.path[0] = str(Path(__file__).resolve().parents[1])  # run as a script: the repository root, for `bench.*`

from bench.common import TARGET_SHARE, appended, git_commit, machine, more_seeds, time_to, write_section
from bench.peer_env import run_rlbus, score_saved, scored
from rlbus.schemas.config_io import load_config

ROOT = Path(__file__).resolve().parents[1]
HEADING = "## LoRA against full fine-tuning at equal wall clock"
PNG = ROOT / "docs" / "images" / "lora_accuracy.png"
RESULTS = ROOT / "bench" / "results" / "lora_accuracy.json"
SIDES = ("full", "lora")
#: The issue's goal: LoRA loses no more than this much held-out accuracy at equal wall clock.
GOAL_POINTS = 0.02


def check_pair(full_cfg, lora_cfg) -> None:
    """Refuse two configs that differ in more than the LoRA settings and the learning rate in what shapes learning
    (the bus, Ray, logging and launcher settings may differ)."""
    if not lora_cfg.model.lora.enabled or full_cfg.model.lora.enabled:
        raise SystemExit("--lora: its config must set model.lora (a rank above 0), and the full one must not")
    same = {"model": lambda c: msgspec.structs.replace(c.model, lora=type(c.model.lora)()),
            "eval": lambda c: msgspec.structs.replace(c.eval, interval=0)}  # the bench turns the evaluator off
    for part in ("model", "env", "data", "rollout", "algorithm", "critic", "feeder", "guard", "eval"):
        get = same.get(part, lambda c, part=part: getattr(c, part))
        if get(full_cfg) != get(lora_cfg):
            raise SystemExit(f"the two configs' `{part}` differ: only model.lora and trainer.lr may")
    may_differ = {"lr", "checkpoint_interval", "keep_checkpoints"}  # the bench sets the checkpoints itself
    for field in msgspec.structs.fields(full_cfg.trainer):
        name = field.name
        if name not in may_differ and getattr(full_cfg.trainer, name) != getattr(lora_cfg.trainer, name):
            raise SystemExit(f"the two configs' `trainer.{name}` differ: only model.lora and trainer.lr may")


def timeline(run: dict, v0: float) -> list[tuple[int, float, float]]:
    """(step, seconds from process start to its publish, held-out accuracy) of each scored model, version 0 first."""
    return [(0, 0.0, v0)] + [(s["step"], s["t"], s["accuracy"]) for s in run["saved"]]


def at_time(line: list[tuple[int, float, float]], t: float) -> tuple[int, float]:
    """The step and accuracy of the last model published by `t` seconds."""
    return [(step, acc) for step, s, acc in line if s <= t + 1e-6][-1]


def compare(d: dict) -> list[dict]:
    """One row per seed with a finished run on both sides: the timelines and the accuracy at equal wall clock."""
    rows = []
    done = {(r["side"], r["seed"]): r for r in d["runs"] if r["rc"] == 0 and r["saved"]}
    for seed in sorted({seed for _, seed in done}):
        if not all((side, seed) in done for side in SIDES):
            continue
        lines = {side: timeline(done[side, seed], d["v0"]["eval/accuracy"]) for side in SIDES}
        end = min(line[-1][1] for line in lines.values())
        rows.append({"seed": seed, **lines, "equal_s": end,
                     **{f"{side}_at": at_time(lines[side], end) for side in SIDES}})  # fmt: skip
    return rows


def summary(d: dict, rows: list[dict]) -> dict:
    """Mean final accuracy a side, the target, each run's time to it, LoRA minus full at equal wall clock, and how
    much longer full fine-tuning's runs took to their last publish."""
    final = {side: statistics.fmean(r[side][-1][2] for r in rows) for side in SIDES}
    target = round(TARGET_SHARE * min(final.values()), 4)
    runs = {side: [r for r in d["runs"] if r["side"] == side and r["rc"] == 0] for side in SIDES}
    times = {side: [time_to(r, target) for r in runs[side]] for side in SIDES}
    return {"final": final, "target": target, "times": times,
            "diffs": [r["lora_at"][1] - r["full_at"][1] for r in rows],
            "length": [r["full"][-1][1] / r["lora"][-1][1] for r in rows]}  # fmt: skip


def plot(rows: list[dict], title: str, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for r in rows:
        for side, style in (("full", "-o"), ("lora", "--s")):
            ax.plot([s / 60 for _, s, _ in r[side]], [a for _, _, a in r[side]], style,
                    label=f"{side}, seed {r['seed']}")  # fmt: skip
    ax.set(xlabel="minutes from process start", ylabel="held-out accuracy", ylim=(0, 1), title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def _mean_time(ts: list[float | None]) -> str:
    got = [t for t in ts if t is not None]
    return f"{statistics.fmean(got):.0f} s ({len(got)} of {len(ts)} runs reached it)" if got else "never reached"


def report(d: dict, rows: list[dict]) -> str:
    m, s = d["machine"], summary(d, rows) if rows else {}
    steps = sorted({step for r in rows for side in SIDES for step, _, _ in r[side]} - {0})
    lines = [
        HEADING, "",
        (f"The same task, seeds and held-out split, trained with every weight (`{d['config']}`) and through a LoRA "
         f"adapter (`{d['lora_config']}`, {d['lora']}), each `rlbus up` from scratch, one after the other, the order "
         "alternating by seed; overrides for both: "
         f"{' '.join(f'`{o}`' for o in d['overrides']) or 'none'}. The evaluator is off during the runs: every "
         f"{d['save_every']} steps a checkpoint is exported and scored afterwards, alone on the machine, on the "
         f"held-out split as the evaluator samples it (version 0: {d['v0']['eval/accuracy']:.3f}). A model's time is "
         "its version's publish, from the process's start. Equal wall clock is the shorter run's last publish, "
         f"where each side is scored by the last model it had published. Command: `{d['command']}`. Machine: "
         f"{m['cpu_model']}, {m['cores']} cores, 1-minute load {m['load_avg_1m']} at the start; rlbus at "
         f"`{d['commit']}`, {d['date']}." + "".join(f" {x}" for x in more_seeds(d))), "",
        "| seed | side | " + " | ".join(f"step {k}: accuracy (s)" for k in steps)
        + " | at equal wall clock | wall s |",
        "|---:|---|" + "---:|" * (len(steps) + 2),
    ]
    walls = {(r["side"], r["seed"]): r["wall_s"] for r in d["runs"]}
    for r in rows:
        for side in SIDES:
            at = {step: (t, a) for step, t, a in r[side]}
            cells = [f"{at[k][1]:.3f} ({at[k][0]:.0f})" if k in at else "" for k in steps]
            step, acc = r[f"{side}_at"]
            lines.append(f"| {r['seed']} | {side} | " + " | ".join(cells)
                         + f" | {acc:.3f} (step {step} at {r['equal_s']:.0f} s) | {walls[side, r['seed']]:.0f} |")
    if d.get("note"):
        lines += ["", d["note"]]
    failed = [r for r in d["runs"] if r["rc"] != 0]
    if failed:
        lines += ["", *(f"- {r['side']} seed {r['seed']}: failed (exit {r['rc']})" for r in failed)]
    if rows:
        per_seed = ", ".join(f"{x * 100:+.1f}" for x in s["diffs"])
        met = sum(x >= -GOAL_POINTS for x in s["diffs"])
        lines += ["", (f"LoRA minus full fine-tuning at equal wall clock: mean "
                       f"{statistics.fmean(s['diffs']) * 100:+.1f} points (per seed: {per_seed}); the goal is no "
                       f"worse than {-GOAL_POINTS * 100:.0f} points, which {met} of {len(s['diffs'])} seeds meet. "
                       f"Mean final accuracy: full {s['final']['full']:.3f}, LoRA {s['final']['lora']:.3f}. Time to "
                       f"held-out accuracy {s['target']:.3f} (0.9 x the lower side's mean final): full "
                       f"{_mean_time(s['times']['full'])}, LoRA {_mean_time(s['times']['lora'])}. Full fine-tuning's "
                       f"runs took {statistics.fmean(s['length']):.2f}x LoRA's time to their last publish. Results: "
                       f"`{RESULTS.relative_to(ROOT)}`.")]
    lines += ["", f"![LoRA against full fine-tuning](images/{PNG.name})", ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config", nargs="?", default="configs/gcd_smollm2.yaml", help="full fine-tuning's config")
    ap.add_argument("--lora", default="configs/gcd_lora_smollm2.yaml", help="the same task's LoRA config")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--save-every", type=int, default=5, help="steps between saved models (each is scored)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds a run may take")
    ap.add_argument("--docs", action="store_true", help="write the section into docs/benchmarks.md")
    ap.add_argument("--from-json", default="", help="only report these results")
    ap.add_argument("--append", action="store_true", help="add these seeds' runs to the results of the same pair")
    ap.add_argument("overrides", nargs="*", help="config overrides k=v for both sides")
    args = ap.parse_intermixed_args()
    if "=" in args.config:  # no config named: the first override landed in its place
        args.overrides, args.config = [args.config, *args.overrides], ap.get_default("config")
    if args.from_json:
        d = json.loads(Path(args.from_json).read_text())
    else:
        configs = {"full": Path(args.config), "lora": Path(args.lora)}
        cfgs = {side: load_config(p, args.overrides) for side, p in configs.items()}
        check_pair(cfgs["full"], cfgs["lora"])
        lo = cfgs["lora"].model.lora
        d = {"command": shlex.join(["python", "bench/lora_accuracy.py", *sys.argv[1:]]), "config": str(configs["full"]),
             "lora_config": str(configs["lora"]), "overrides": args.overrides, "save_every": args.save_every,
             "lora": (f"rank {lo.rank}, alpha {lo.alpha:g}, LR {cfgs['lora'].trainer.lr:g} against "
                      f"{cfgs['full'].trainer.lr:g}"),
             "machine": machine(), "commit": git_commit(), "date": time.strftime("%Y-%m-%d"), "runs": []}
        if args.append and RESULTS.is_file():
            d = appended(json.loads(RESULTS.read_text()), d, same=("config", "lora_config", "overrides", "save_every"),
                         drop=("note", "summary"))
        steps = cfgs["full"].trainer.total_steps
        with tempfile.TemporaryDirectory(prefix="rlbus-lora-accuracy-") as tmp:
            work = Path(tmp)
            if "v0" not in d:
                d["v0"] = scored(cfgs["full"], Path(cfgs["full"].model.path))
            for k, seed in enumerate(args.seeds):
                for side in SIDES if k % 2 == 0 else SIDES[::-1]:
                    load = round(os.getloadavg()[0], 2)
                    run = run_rlbus(configs[side], args.overrides, seed, steps, args.save_every, work, args.timeout,
                                    side)
                    score_saved(cfgs["full"], run)
                    d["runs"].append({**run, "load1_at_start": load})
                    print(f"{side} seed {seed}: exit {run['rc']}, {run['wall_s']:.0f} s, "
                          + ", ".join(f"step {x['step']} {x['accuracy']:.3f} at {x['t']:.0f} s" for x in run["saved"]),
                          flush=True)
                    RESULTS.write_text(json.dumps(d, indent=1) + "\n")
    rows = compare(d)
    title = f"{Path(d['config']).stem}: LoRA against full fine-tuning"
    if rows:
        plot(rows, title, PNG)
        d["summary"] = {**summary(d, rows), "at_equal_wall_clock": [
            {"seed": r["seed"], "s": r["equal_s"], "full": r["full_at"], "lora": r["lora_at"]} for r in rows]}
        RESULTS.write_text(json.dumps(d, indent=1) + "\n")  # bench/report.py reads the summary
    text = report(d, rows)
    print(text)
    if args.docs:
        write_section(HEADING, text)
    return 0 if rows and all(r["rc"] == 0 for r in d["runs"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
