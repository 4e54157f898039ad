"""The docs/benchmarks.md section of bench/peer_trl.py: the comparison, its command and machine, the summary table and
the task's notes (every seed's row stays in the results file and on the console)."""

from __future__ import annotations

import statistics
from pathlib import Path

from bench.common import shown
from bench.peer_tasks import TASKS
from bench.peer_trl import TARGET_RULES, Bench, producers_label, spread
from bench.report import command as typed


def docs_section(b: Bench, results: Path) -> str:
    """The section of docs/benchmarks.md for `b`: the comparison, its command and machine, the summary table and
    the task's notes. Per-seed rows, reward and entropy by step, start-up stages and step times are in `report`
    (printed on the console) and in the results file."""
    s = b.summary()
    t, r = s["trl"], s["rlbus"]

    def ratio(key: str) -> str:
        a, c = [x for x in r[key] if x is not None], [x for x in t[key] if x is not None]
        return f"**{statistics.fmean(a) / statistics.fmean(c):.2f}x**" if a and c else "-"

    task = TASKS[b.task]
    loads = [x.load_before for x in b.runs]
    trl_name = "TRL 1.16 GRPOTrainer" + (f" ({b.trl_threads} torch thread{'s' if b.trl_threads != 1 else ''})"
                                         if b.trl_threads else "")
    lines = [
        task.heading, "",
        (f"TRL's `GRPOTrainer` (one process) against `rlbus up` ({producers_label(task, b.rlbus_overrides)}, "
         "`max_staleness` 1) on the same model, data, reward and budget, alternating which goes first per seed. "
         + task.about.format(steps=b.steps, model=b.model, system=task.system,
                             lr=f"{task.lr:.0e}".replace("e-0", "e-"))
         + f" Command: `{typed(b.command)}`. Machine: {b.machine['cpu_model']}, {b.machine['cores']} cores, 1-minute "
         f"load {min(loads):.1f} to {max(loads):.1f} at the runs' starts; "
         + ", ".join(f"{k} {v}" for k, v in b.versions.items()) + f"; rlbus at `{b.rlbus_commit}`"
         + (f", rlbus overrides `{' '.join(b.rlbus_overrides)}`" if b.rlbus_overrides else "") + "."),
        "",
        ("| | steps/min (steady) | whole process (s) | start-up to first step (s) | "
         f"time to reward {b.target:.3f} (s) | reward first 5 | reward last 10 |"),
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in ((trl_name, t), (f"`rlbus up`, {producers_label(task, b.rlbus_overrides)}", r)):
        lines.append(f"| {name} | {spread(row['steps_per_min'])} | {spread(row['wall_s'])} | "
                     f"{spread(row['startup_s'])} | {spread(row['reach_s'])} | {spread(row['first5'], '.3f')} | "
                     f"{spread(row['last10'], '.3f')} |")
    lines += [f"| rlbus / TRL | {ratio('steps_per_min')} | {ratio('wall_s')} | {ratio('startup_s')} | "
              f"{ratio('reach_s')} | | |", "",
              (f"Mean ± standard deviation over seeds {', '.join(map(str, b.seeds))}. Steady: the steps after the "
               f"first {b.warmup}. Time to reward {b.target:.3f}: from process start until the 10-step running mean "
               f"reaches it ({TARGET_RULES[task.target_rule]}). Every seed, step, start-up stage and step time: "
               f"`{shown(results)}`.")]
    lines += ["", task.notes, ""] if task.notes else [""]
    return "\n".join(lines)
