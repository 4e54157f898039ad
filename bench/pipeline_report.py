"""The pipeline benchmark's reports (bench/pipeline.py): the console table, the Markdown table with the async/sync
ratios, and the `## Pipeline` section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from bench.common import shown, write_section
from bench.report import command as typed

if TYPE_CHECKING:
    from bench.pipeline import Bench, RunResult

#: The schedules compared: trainer.max_staleness of each.
MODES = {"sync": 0, "async-1": 1, "async-2": 2}


def ratios(results: list[RunResult]) -> dict[tuple[str, int, str], float]:
    """async / sync steps-per-minute for each (workload, producers, async mode)."""
    sync = {r.key: r for r in results if r.mode == "sync" and r.ok}
    return {(r.workload, r.num_producers, r.mode): r.steps_per_min / sync[r.key].steps_per_min
            for r in results if r.mode != "sync" and r.ok and r.key in sync}


def console_table(results: list[RunResult]) -> Table:
    rat = ratios(results)
    t = Table(title="Pipeline: synchronous (max_staleness 0) vs asynchronous")
    for col in ("workload", "producers", "mode", "steps/min", "async/sync", "trainer busy", "wait data s",
                "train s", "staleness", "startup s", "load"):
        t.add_column(col, justify="left" if col in ("workload", "mode") else "right")
    for r in results:
        if not r.ok:
            t.add_row(r.workload, str(r.num_producers), r.mode, "failed", "", "", "", "", "", "", "")
            continue
        ratio = rat.get((r.workload, r.num_producers, r.mode))
        t.add_row(r.workload, str(r.num_producers), r.mode, f"{r.steps_per_min:.1f}",
                  "-" if ratio is None else f"{ratio:.2f}x", f"{r.trainer_busy:.0%}", f"{r.wait_data_s:.2f}",
                  f"{r.train_s:.2f}", f"{r.staleness_mean:.2f}", f"{r.startup_s:.0f}", f"{r.load_before:.1f}")
    return t


def markdown_table(results: list[RunResult]) -> list[str]:
    rat = ratios(results)
    out = ["| workload | producers | mode | steps/min | async/sync | trainer busy | wait for data (s/step) | "
           "train (s/step) | staleness mean / max | regenerated | dropped stale | load at start |",
           "|---|---:|---|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for r in results:
        if not r.ok:
            out.append(f"| {r.workload} | {r.num_producers} | {r.mode} | failed | | | | | | | | |")
            continue
        ratio = rat.get((r.workload, r.num_producers, r.mode))
        out.append(f"| {r.workload} | {r.num_producers} | {r.mode} | {r.steps_per_min:.1f} | "
                   f"{'-' if ratio is None else f'**{ratio:.2f}x**'} | {r.trainer_busy:.0%} | {r.wait_data_s:.2f} | "
                   f"{r.train_s:.2f} | {r.staleness_mean:.2f} / {r.staleness_max:.0f} | {r.regenerated} | {r.dropped_stale} | "
                   f"{r.load_before:.1f} |")
    return out


def docs_section(bench: Bench, table: list[str], results: str = "bench/results/pipeline.json") -> str:
    """The `## Pipeline` section: what runs, the command and machine, the table, and the synchrony check. The step
    breakdown (one row a run) is in the results file and its plot."""
    ok = [r for r in bench.results if r.ok]
    sync = [r for r in ok if r.mode == "sync"]
    rat = ratios(bench.results)
    m, e = bench.machine, bench.sim_engine
    loads = [r.load_before for r in ok] or [0.0]
    workloads = {r.workload for r in bench.results}
    best = max(rat.items(), key=lambda kv: kv[1], default=None)
    about = {
        "simulated": (f"*simulated* (`configs/bench_simulated.yaml`): response lengths drawn from a Pareto "
                      f"distribution (median {e['mean_tokens']} tokens, shape {e['tail_alpha']}, capped at "
                      f"{e['max_new_tokens']}), {e['seconds_per_token'] * 1000:.0f} ms a token of a group's longest "
                      f"sample, no model math; groups of {e['n']}, {e['groups_per_step']} a step"),
        "quickstart": (f"*quickstart* (`configs/quickstart.yaml`, {bench.steps} steps, model "
                       f"`{bench.quickstart_model}`): HF generation on CPU with the calculator tool"),
    }
    lines = [
        "## Pipeline",
        "",
        "The synchronous schedule (`trainer.max_staleness=0`) against the asynchronous one (`max_staleness` 1 and 2) "
        "on one workload, each row a real `rlbus up` (trainer and producers as their own processes, one "
        f"nats-server and Ray head for all). Workload: {'; '.join(about[w] for w in sorted(workloads) if w in about)}"
        f". Measured: the steps after a {bench.warmup}-step warm-up; trainer busy = its fetch, record, train and "
        "publish time over the wall time; staleness = trainer version - oldest token's version. Command: "
        f"`{typed(bench.command)}`. Machine: {m['cpu_model']}, {m['cores']} cores, 1-minute load {min(loads):.1f} "
        f"to {max(loads):.1f} at the runs' starts; the bench took {bench.wall_s / 60:.0f} min.",
        "",
        *table,
        "",
        *[f"Note: {n}  " for n in bench.notes],
        *([""] if bench.notes else []),
    ]
    best_s = "" if best is None else (f"Best async/sync: **{best[1]:.2f}x** ({best[0][0]}, {best[0][1]} "
                                      f"producer(s), {best[0][2]}); AReaL reports up to 2.77x on GPUs. ")
    lines += [
        best_s + "*regenerated*: groups a producer finished on weights the bound no longer allowed and rolled out "
        "again; *dropped stale*: groups the trainer dropped for that reason. `max_staleness=0` is synchronous in its "
        "schedule: the feeder admits while `released - abandoned <= (version + max_staleness + 1) * groups_per_step`"
        ", and the trainer wakes it only after publishing the new version's weights; "
        + ("staleness max was 0 in every sync row." if sync and all(r.staleness_max == 0 for r in sync) else
           "staleness max was NOT 0 in every sync row (see the table).")
        + f" Every run's step breakdown: `{results}`.",
        "",
    ]
    return "\n".join(lines)


def retitle(section: str, heading: str) -> str:
    """The section under another heading (several pipeline runs can keep their own sections)."""
    return heading + section.removeprefix("## Pipeline") if heading != "## Pipeline" else section


def write_docs(bench: Bench, args: argparse.Namespace, console: Console) -> None:
    """The section under --section in --docs (nothing with --docs '')."""
    if args.docs:
        results = shown(Path(args.from_json or args.results).resolve())
        section = retitle(docs_section(bench, markdown_table(bench.results), results), args.section)
        write_section(args.section, section, Path(args.docs))
        console.print(f"docs: {args.docs} ({args.section})")
