"""The pipeline benchmark's reports (bench/pipeline.py): the console table, the Markdown table with the async/sync
ratios, and the `## Pipeline` section of docs/benchmarks.md with its reading of the numbers.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from bench.common import write_section
from bench.step_breakdown import breakdown_markdown

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


def docs_section(bench: Bench, table: list[str]) -> str:
    """The `## Pipeline` section: setup, table, the synchrony check and a reading of the numbers."""
    ok = [r for r in bench.results if r.ok]
    sync = [r for r in ok if r.mode == "sync"]
    rat = ratios(bench.results)
    m, e = bench.machine, bench.sim_engine
    loads = [r.load_before for r in ok] or [0.0]
    sync_exact = all(r.staleness_max == 0 for r in sync)
    waste = ", ".join(f"{r.workload} {r.num_producers}p: {r.regenerated} regenerated + {r.dropped_stale} dropped"
                      for r in sync) or "none measured"
    best = max(rat.items(), key=lambda kv: kv[1], default=None)
    lines = [
        "## Pipeline",
        "",
        "The same workload with the synchronous schedule (`trainer.max_staleness=0`) and the asynchronous one "
        "(`max_staleness` 1 and 2), side by side in one run. Every row is a real `rlbus up` (trainer and producers "
        "as their own processes); the bench stamps each metrics row as it lands and measures the steps after a "
        f"{bench.warmup}-step warm-up: steps/min over the wall time from the last warm-up row to the last row; "
        "trainer busy = (time/fetch + time/record + time/train + time/publish_weights) summed over those steps / "
        "that wall time; staleness = trainer version - oldest token's version, mean of the rows.",
        "",
        f"Command: `{bench.command}`  ",
        f"Machine: {m['cpu_model']}, {m['cores']} cores visible, shared with other work while measured (1-minute "
        f"load {min(loads):.1f} to {max(loads):.1f} at the starts of the runs, {bench.load_end:.1f} at the end); "
        f"{m['platform']}; Python {m['python']}, torch {m['torch']}. The bench took {bench.wall_s / 60:.0f} min.",
        "",
        f"- **simulated** (`configs/bench_simulated.yaml`): the `simulated` engine draws each response length from a "
        f"Pareto distribution (median {e['mean_tokens']} tokens, shape {e['tail_alpha']}, capped at "
        f"{e['max_new_tokens']}) and sleeps {e['seconds_per_token'] * 1000:.0f} ms per token of a group's longest "
        f"sample, no model math; groups of {e['n']}, {e['groups_per_step']} groups per step, single-turn loop; a "
        "random-weights tiny model (0.84M parameters) gives the tokenizer and the trainer's real math.",
        f"- **quickstart** (`configs/quickstart.yaml` unchanged but for `trainer.total_steps={bench.steps}`, "
        f"`logging.plot=false` and `model.path={bench.quickstart_model}`): HF generation on CPU with the "
        "calculator tool.",
        "- One nats-server and one Ray head serve every run (given to `rlbus up` as `bus.url` / `ray.address`); "
        "each run has its own name, so its streams and Ray actors are its own.",
        "",
        *table,
        "",
        *breakdown_markdown(bench.results),
        *[f"Note: {n}  " for n in bench.notes],
        *([""] if bench.notes else []),
        "async/sync = steps/min of the row / steps/min of the sync row with the same workload and producers. "
        "*regenerated* (see below) = groups a producer finished on weights the bound no longer allowed and rolled out "
        "again; *dropped stale* = groups the trainer's batcher dropped for the same reason.",
        "",
        "### Is `max_staleness=0` synchronous?",
        "",
        "By the code, yes in its schedule: the feeder admits while `released - abandoned <= (version + "
        "max_staleness + 1) * groups_per_step`, so at version v it has released exactly the prompts of step v+1 "
        "(plus re-issues of dropped ones); the trainer sets version v+1 after the step's update, publishes the "
        "weights (object store, JetStream ack, KV) and only then wakes the feeder, which releases step v+2's "
        "prompts. Generation of a step never overlaps training or the weight sync of the previous one. Measured: "
        + ("staleness/max was 0 in every row of every sync run. " if sync_exact else
           "staleness/max was NOT 0 in every sync row (see the table). ")
        + "Two differences from a textbook synchronous loop remain:",
        "",
        "1. **Wasted rollouts at each version change.** A producer starts loading new weights when their "
        "announcement arrives (a fetch from the weight store), but a prompt released right after can start "
        "generating before that load ends, on the old version. The group is finished, found beyond the bound, "
        "given back and rolled out again (or, if the producer had not seen the new version yet, dropped by the "
        f"trainer and re-issued). Counted over the sync runs: {waste}. Trained rows stay at staleness 0, but each "
        "version change can cost a step one extra (long-tailed) rollout, so the sync figures here are slower "
        "than an ideal synchronous loop and the async/sync ratios correspondingly higher. Fix (producers/"
        "service.py, not done here): before rolling out a task, wait until the engine holds a version >= "
        "`task.released_version`.",
        "2. The trainer's end-of-step bookkeeping (metrics, events) and any checkpoint run after the next batch "
        "is admitted, and the feeder's 5 s re-check can see the new version while the weights publish is still "
        "in flight; both are small next to a step here.",
        "",
        "### Reading",
        "",
    ]
    for key in sorted({r.key for r in ok}, key=lambda k: (k[0] != "simulated", k[1])):
        rows = {r.mode: r for r in ok if r.key == key}
        parts = [f"{mode} {rows[mode].steps_per_min:.1f} steps/min (trainer busy {rows[mode].trainer_busy:.0%})"
                 for mode in MODES if mode in rows]
        rs = [f"{rat[(*key, mode)]:.2f}x" for mode in MODES if (*key, mode) in rat]
        lines.append(f"- {key[0]}, {key[1]} producer(s): {'; '.join(parts)}"
                     + (f"; async/sync {' and '.join(rs)}." if rs else "."))
    if best is not None:
        (w, p, mode), v = best
        lines += ["", f"Best async/sync: **{v:.2f}x** ({w}, {p} producers, {mode}); AReaL reports up to 2.77x on "
                      "GPUs."]
    lines += [
        "",
        "What the numbers say:",
        "",
        "- With one producer generation is the bottleneck in every mode: overlapping can only hide the trainer's "
        "share of a synchronous step, so the gain is small and the trainer idles most of the time.",
        f"- With more producers than one step's groups ({e['groups_per_step']}), the synchronous schedule cannot "
        "use them: the feeder releases one step's prompts, so at most that many producers work, and each step "
        "waits for the slowest group of the step (the Pareto tail). With `max_staleness` 1 or 2 the feeder admits "
        "2 or 3 steps' prompts, every producer works, stragglers finish while the trainer trains on other groups, "
        "and the trainer becomes the bottleneck (see the busy column at 16 producers). That, not raw overlap, is where most of "
        "the gain comes from, as in AReaL.",
        "- `max_staleness` 2 over 1 matters when a step's slowest group is much slower than the rest: a deeper "
        "window lets producers run further ahead; it costs staleness (see the column), which the trainer "
        "corrects with decoupled PPO, and more groups dropped at the bound.",
        "- The quickstart's generation is real model math on the same CPU cores as the trainer, so overlapping "
        "them gains only while a core is free: with one trainer and two producers on 2 cores, generation and "
        "training of a step are of similar size here (see the wait and train columns) and async overlaps them. "
        + ("Its model was the random-weights one (responses run to max_new_tokens, no tool calls), so these are "
           "not the trained quickstart's step times. " if "bench-random" in bench.quickstart_model else ""),
        "- Every synchronous row includes the wasted rollouts counted above (the *regenerated* column): against an "
        "exact synchronous loop, the async/sync ratios would be lower, most for the rows with many regenerated "
        "groups.",
        "- Caveats: 2 shared cores for the trainer, up to 16 producer processes, nats-server and Ray, and other "
        "people's work (see the load column); the trainer's time/train grows with that load. Few steps per run "
        "(the bench fits in about 20 minutes), so single runs swing by tens of percent; the simulated engine "
        "only sleeps, so what is measured is the schedule and the system's overhead, not an inference engine. "
        "Results: `bench/results/pipeline.json`.",
        "",
    ]
    return "\n".join(lines)


def retitle(section: str, heading: str) -> str:
    """The section under another heading (several pipeline runs can keep their own sections)."""
    return heading + section.removeprefix("## Pipeline") if heading != "## Pipeline" else section


def write_docs(bench: Bench, args: argparse.Namespace, console: Console) -> None:
    """The section under --section in --docs (nothing with --docs '')."""
    if args.docs:
        section = retitle(docs_section(bench, markdown_table(bench.results)), args.section)
        write_section(args.section, section, Path(args.docs))
        console.print(f"docs: {args.docs} ({args.section})")
