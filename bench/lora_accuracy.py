"""LoRA against full fine-tuning at equal wall clock: held-out accuracy by the time each side's trainer reached it.

Reads two bench/env_task.py results files, runs of the same task and seeds, one trained through a LoRA adapter:

    .venv/bin/python bench/env_task.py configs/gcd_smollm2.yaml --tag full_eval10 --seeds 0 eval.interval=10
    .venv/bin/python bench/env_task.py configs/gcd_lora_smollm2.yaml --seeds 0
    .venv/bin/python bench/lora_accuracy.py bench/results/env_task_gcd_smollm2_full_eval10.json \
        bench/results/env_task_gcd_lora_smollm2.json [--docs]

A version's time is the trainer's time to it: its steps (`time/step`) and its waits for groups before each
(`time/wait_data`), summed. Equal wall clock is the shorter run's end: each side is scored by the last version it
had evaluated by then. Runs from before bench/env_task.py recorded the waits are refused. Writes
bench/results/lora_accuracy.json (the comparison, with the full side's command,
commit and machine), a plot (docs/images/lora_accuracy.png) and, with --docs, a section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # run as a script: the repository root, for `bench.*`

from bench.common import write_section

ROOT = Path(__file__).resolve().parents[1]
HEADING = "## LoRA against full fine-tuning at equal wall clock"
PNG = ROOT / "docs" / "images" / "lora_accuracy.png"
RESULTS = ROOT / "bench" / "results" / "lora_accuracy.json"
#: The issue's goal: LoRA loses no more than this much held-out accuracy at equal wall clock.
GOAL_POINTS = 0.02


def timeline(run: dict) -> list[tuple[int, float, float]]:
    """(version, the trainer's seconds to reach it, held-out accuracy) for each evaluated version."""
    if any("wait_s" not in t for t in run["train"]):
        raise SystemExit(f"seed {run['seed']}: its steps have no wait_s (a bench/env_task.py from before it recorded "
                         "the trainer's wait for groups): run it again")
    ends = [0.0]
    for t in run["train"]:
        ends.append(ends[-1] + t["step_s"] + t["wait_s"])
    return [(e["version"], ends[min(e["version"], len(ends) - 1)], e["accuracy"]) for e in run["eval"]]


def at_time(line: list[tuple[int, float, float]], t: float) -> tuple[int, float]:
    """The version and accuracy of the last evaluation whose version was trained by `t` seconds."""
    done = [(v, acc) for v, s, acc in line if s <= t + 1e-6]
    return done[-1]


def compare(full: dict, lora: dict) -> list[dict]:
    rows = []
    lora_by_seed = {r["seed"]: r for r in lora["runs"] if r["eval"]}
    for fr in full["runs"]:
        lr = lora_by_seed.get(fr["seed"])
        if lr is None or not fr["eval"]:
            continue
        fl, ll = timeline(fr), timeline(lr)
        end = min(fl[-1][1], ll[-1][1])
        (fv, fa), (lv, la) = at_time(fl, end), at_time(ll, end)
        rows.append({"seed": fr["seed"], "full": fl, "lora": ll, "equal_s": end, "full_at": (fv, fa),
                     "lora_at": (lv, la)})  # fmt: skip
    return rows


def plot(rows: list[dict], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for r in rows:
        for side, style in (("full", "-o"), ("lora", "--s")):
            ax.plot([s / 60 for _, s, _ in r[side]], [a for _, _, a in r[side]], style,
                    label=f"{side}, seed {r['seed']}")  # fmt: skip
    ax.set(xlabel="trainer minutes (steps and waits for groups)", ylabel="held-out accuracy", ylim=(0, 1),
           title="gcd up to 20, SmolLM2-135M-Instruct: LoRA r16 against full fine-tuning")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def report(full: dict, lora: dict, rows: list[dict], command: str) -> str:
    m = full["machine"]
    versions = sorted({v for r in rows for side in ("full", "lora") for v, _, _ in r[side]})
    lines = [
        HEADING, "",
        (f"The same task, seeds and evaluation, trained with every weight (`{full['config']}`, overrides: "
         f"{' '.join(full['overrides']) or 'none'}) and through a LoRA adapter (`{lora['config']}`, overrides: "
         f"{' '.join(lora['overrides']) or 'none'}), one run after the other by `bench/env_task.py`. A version's "
         "time is the trainer's time to it (its steps and its waits for groups); equal wall clock is the shorter "
         "run's end, where each side is scored by the last version it had evaluated."), "",
        f"Command: `{command}`  ",
        (f"Machine: {m['cpu_model']}, {m['cores']} cores, 1-minute load {m['load_avg_1m']} (full) and "
         f"{lora['machine']['load_avg_1m']} (LoRA) at the start; rlbus at `{full['commit']}` and `{lora['commit']}`, "
         f"{full['date']} and {lora['date']}."), "",
        "| seed | side | " + " | ".join(f"v{v}: accuracy (min)" for v in versions) + " | at equal wall clock |",
        "|---:|---|" + "---:|" * (len(versions) + 1),
    ]
    for r in rows:
        for side in ("full", "lora"):
            at = {v: (s, a) for v, s, a in r[side]}
            cells = [f"{at[v][1]:.3f} ({at[v][0] / 60:.1f})" if v in at else "" for v in versions]
            v, a = r[f"{side}_at"]
            lines.append(f"| {r['seed']} | {side} | " + " | ".join(cells) + f" | {a:.3f} (v{v}, "
                         f"{r['equal_s'] / 60:.1f} min) |")  # fmt: skip
    diffs = [r["lora_at"][1] - r["full_at"][1] for r in rows]
    speed = [r["full"][-1][1] / r["lora"][-1][1] for r in rows]
    if diffs:
        lines += ["", (f"LoRA minus full at equal wall clock: mean {statistics.fmean(diffs) * 100:+.1f} points "
                       f"(per seed: {', '.join(f'{d * 100:+.1f}' for d in diffs)}); goal: no worse than "
                       f"{-GOAL_POINTS * 100:.0f} points. Full fine-tuning's steps took {statistics.fmean(speed):.2f}x "
                       "LoRA's time over the same steps. Results: "
                       f"`{full['results']}`, `{lora['results']}`.")]  # fmt: skip
    lines += ["", f"![LoRA against full fine-tuning](images/{PNG.name})", ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("full", help="bench/env_task.py results of full fine-tuning")
    ap.add_argument("lora", help="bench/env_task.py results of the same task through a LoRA adapter")
    ap.add_argument("--docs", action="store_true", help="write the section into docs/benchmarks.md")
    args = ap.parse_args()
    full, lora = (json.loads(Path(p).read_text()) for p in (args.full, args.lora))
    rows = compare(full, lora)
    if not rows:
        print("no seed has evaluated runs on both sides", file=sys.stderr)
        return 1
    plot(rows, PNG)
    cmd = shlex.join(["python", "bench/lora_accuracy.py", *sys.argv[1:]])
    RESULTS.write_text(json.dumps({"command": cmd, "commit": full["commit"], "date": full["date"],
                                   "machine": full["machine"], "sources": [full["results"], lora["results"]],
                                   "rows": rows}, indent=1) + "\n")  # fmt: skip
    text = report(full, lora, rows, cmd)
    print(text)
    if args.docs:
        write_section(HEADING, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
