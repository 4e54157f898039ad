"""Partial rollout against finish-then-drop, on the pipeline bench's long-tail workload.

    .venv/bin/python bench/partial_rollout.py [--repeats 2] [--steps 16] [--producers 4] [--max-staleness 1]

Every run is a real `rlbus up` of configs/bench_simulated.yaml (bench/pipeline.py's simulated workload: Pareto
response lengths, median 64 tokens, capped at 512, 10 ms a token; groups of 4, 8 groups a step) at
`trainer.max_staleness` 1, each producer holding 4 tasks at once (as configs/quickstart_vllm.yaml does), sharing one nats-server and Ray head (bench/pipeline.py's Infrastructure). Modes:

  drop-chunk    partial_rollout off, an engine that finishes the call in flight on the weights it began with
                (the HF engine's behaviour): a group whose oldest token the bound no longer admits is finished,
                then given back and rolled out again (or dropped by the trainer)
  drop-inflight partial_rollout off, loads reach calls in flight (vLLM's behaviour), same finish-then-drop
  partial       partial_rollout on, loads reach calls in flight: a sample the bound no longer admits is
                interrupted and restarted alone on the newest weights, the rest of its group goes on

Measured after a warm-up, per run: steps/min (bench/pipeline.py's `measure`), and the share of generated tokens
thrown away for staleness:

    discarded = tokens of groups producers gave back + tokens of restarted samples (the turn cut short included:
                the simulated engine counts it) + the batcher's dropped-stale groups x mean tokens per group
    trained   = sum over steps of response_length/mean x batch/groups x n  (single-turn: every response token is
                generated)
    share     = discarded / (discarded + trained)

(the producers' totals come from the summary line each logs when it stops). Writes bench/results/partial_rollout.json
and the `## Partial rollout` section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from bench.common import machine, write_section  # noqa: E402
from bench.pipeline import (  # noqa: E402
    BENCH_MODEL,
    DOCS,
    ROOT,
    SIM_CONFIG,
    Infrastructure,
    RunSpec,
    ensure_bench_model,
    infrastructure,
    last_error,
    measure,
    tail_run,
)

RESULTS = ROOT / "bench" / "results" / "partial_rollout.json"
#: mode -> overrides
MODES = {
    "drop-chunk": ["rollout.partial_rollout=false", "rollout.engine.inflight_updates=false"],
    "drop-inflight": ["rollout.partial_rollout=false", "rollout.engine.inflight_updates=true"],
    "partial": ["rollout.partial_rollout=true", "rollout.engine.inflight_updates=true"],
}
SUMMARY = re.compile(r"discarded for staleness: (\d+) generated tokens \((\d+) groups given back, (\d+) samples "
                     r"restarted\)")


@dataclass
class Result:
    mode: str
    repeat: int
    ok: bool
    steps_per_min: float = 0.0
    staleness_mean: float = 0.0
    discarded_tokens: int = 0
    dropped_stale_groups: int = 0
    groups_given_back: int = 0
    samples_restarted: int = 0
    trained_tokens: int = 0
    discarded_share: float = 0.0
    producers_reporting: int = 0
    load_before: float = 0.0
    error: str = ""


def producer_totals(run_dir: Path) -> tuple[int, int, int, int]:
    """(discarded tokens, groups given back, samples restarted, producers whose summary line was found)."""
    tokens = groups = restarted = found = 0
    for log in (run_dir / "logs").glob("producer-*.log"):
        hits = SUMMARY.findall(log.read_text(errors="replace"))
        if hits:  # a restarted producer writes one line per life
            for t, g, r in hits:
                tokens, groups, restarted = tokens + int(t), groups + int(g), restarted + int(r)
            found += 1
    return tokens, groups, restarted, found


def run_one(mode: str, repeat: int, args, infra: Infrastructure, runs_dir: Path, n: int) -> Result:
    spec = RunSpec("simulated", f"async-{args.max_staleness}", args.producers, SIM_CONFIG,
                   [f"model.path={BENCH_MODEL}", f"rollout.num_producers={args.producers}",
                    f"trainer.total_steps={args.steps}", f"rollout.engine.seed={repeat}",
                    f"data.seed={repeat}", f"rollout.max_inflight_tasks={args.inflight}", *MODES[mode]])
    name = f"partial-{mode}-{repeat}-{os.getpid()}"
    run_dir = runs_dir / name
    load = os.getloadavg()[0]
    rows, stamps, rc, _, _ = tail_run(spec, name, run_dir, infra.overrides(name), args.timeout)
    infra.forget_run(name)
    if rc != 0 or len(rows) <= args.warmup + 1:
        return Result(mode, repeat, ok=False, load_before=load, error=f"exit {rc}, {len(rows)} steps: "
                      f"{last_error(run_dir)}")
    m = measure(spec, rows, stamps, args.warmup)
    discarded, given_back, restarted, found = producer_totals(run_dir)
    per_group = [r["response_length/mean"] * n for r in rows]
    dropped = int(rows[-1]["batch/dropped_stale"])
    discarded += round(dropped * statistics.mean(per_group))
    trained = round(sum(r["response_length/mean"] * r["batch/groups"] * n for r in rows))
    return Result(mode, repeat, ok=True, steps_per_min=m.steps_per_min, staleness_mean=m.staleness_mean,
                  discarded_tokens=discarded, dropped_stale_groups=dropped, groups_given_back=given_back,
                  samples_restarted=restarted, trained_tokens=trained,
                  discarded_share=discarded / max(discarded + trained, 1), producers_reporting=found,
                  load_before=load)


def summarize(results: list[Result]) -> dict[str, dict[str, float]]:
    out = {}
    for mode in MODES:
        ok = [r for r in results if r.mode == mode and r.ok]
        if ok:
            out[mode] = {
                "runs": len(ok),
                "steps_per_min": statistics.mean(r.steps_per_min for r in ok),
                "steps_per_min_min": min(r.steps_per_min for r in ok),
                "steps_per_min_max": max(r.steps_per_min for r in ok),
                "discarded_share": statistics.mean(r.discarded_share for r in ok),
                "discarded_share_min": min(r.discarded_share for r in ok),
                "discarded_share_max": max(r.discarded_share for r in ok),
            }
    return out


def table(results: list[Result]) -> Table:
    t = Table(title="Partial rollout vs finish-then-drop (simulated long tail)")
    for col in ("mode", "repeat", "steps/min", "discarded share", "discarded tok", "trained tok", "given back",
                "dropped stale", "restarted", "staleness", "load"):
        t.add_column(col, justify="left" if col == "mode" else "right")
    for r in results:
        if not r.ok:
            t.add_row(r.mode, str(r.repeat), "failed", r.error[:40], *[""] * 7)
            continue
        t.add_row(r.mode, str(r.repeat), f"{r.steps_per_min:.1f}", f"{r.discarded_share:.1%}",
                  str(r.discarded_tokens), str(r.trained_tokens), str(r.groups_given_back),
                  str(r.dropped_stale_groups), str(r.samples_restarted), f"{r.staleness_mean:.2f}",
                  f"{r.load_before:.1f}")
    return t


def docs(command: str, results: list[Result], summary: dict, mach: dict, args, wall_s: float) -> str:
    loads = [r.load_before for r in results] or [0.0]
    lines = [
        "## Partial rollout",
        "",
        "A sample whose oldest token the staleness bound no longer admits would make its whole group be dropped. "
        "Before: the group is finished, then given back and rolled out again (or dropped by the trainer). After "
        "(`rollout.partial_rollout: true`, the default): the sample alone is interrupted in flight and restarted on "
        "the newest weights; the rest of the group goes on (producers/agent_loops/base.py, `StalenessWatch`). "
        "Workload: bench/pipeline.py's simulated long tail (`configs/bench_simulated.yaml`: Pareto lengths, median "
        f"64 tokens, capped at 512, 10 ms a token, groups of 4, 8 groups a step), {args.producers} producers "
        f"holding {args.inflight} tasks each (`rollout.max_inflight_tasks`), "
        f"`trainer.max_staleness={args.max_staleness}`, {args.steps} steps ({args.warmup} warm-up), "
        f"{args.repeats} repeat(s) per mode with engine and data seeds 0..{args.repeats - 1}. "
        f"Command: `{command}`. "
        f"Machine: {mach['cpu_model']}, {mach['cores']} cores, shared (1-minute load {min(loads):.1f} to "
        f"{max(loads):.1f} at the runs' starts); the bench took {wall_s / 60:.0f} min.",
        "",
        "| mode | runs | steps/min mean (min-max) | discarded share of generated tokens mean (min-max) |",
        "|---|---:|---|---|",
    ]
    for mode, s in summary.items():
        lines.append(f"| {mode} | {s['runs']} | {s['steps_per_min']:.1f} ({s['steps_per_min_min']:.1f}-"
                     f"{s['steps_per_min_max']:.1f}) | {s['discarded_share']:.1%} ({s['discarded_share_min']:.1%}-"
                     f"{s['discarded_share_max']:.1%}) |")
    lines += ["", "Modes: *drop-chunk*: finish-then-drop on an engine that ends the call in flight on the weights it "
              "began with (the HF engine's behaviour); *drop-inflight*: finish-then-drop where loads reach calls in "
              "flight (vLLM's); *partial*: partial rollout with loads in flight. Discarded = tokens of groups given "
              "back + of restarted samples (their interrupted turn included) + the trainer's dropped-stale groups "
              "x mean tokens per group; share = discarded / (discarded + trained). The simulated engine only "
              "sleeps, so this measures the schedule, not a model. Every run's row: "
              "`bench/results/partial_rollout.json`."]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--producers", type=int, default=4)
    ap.add_argument("--max-staleness", type=int, default=1)
    ap.add_argument("--inflight", type=int, default=4, help="rollout.max_inflight_tasks of each producer")
    ap.add_argument("--modes", nargs="+", choices=tuple(MODES), default=list(MODES))
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--results", default=str(RESULTS))
    ap.add_argument("--docs", default=str(DOCS), help="'' to leave docs/benchmarks.md alone")
    ap.add_argument("--keep-runs", action="store_true")
    args = ap.parse_args()
    command = shlex.join([".venv/bin/python", "bench/partial_rollout.py", *sys.argv[1:]])
    console = Console()
    ensure_bench_model(BENCH_MODEL, console)
    from rlbus.schemas.config_io import load_config

    n = load_config(SIM_CONFIG, [f"model.path={BENCH_MODEL}"]).rollout.n
    results: list[Result] = []
    t0 = time.monotonic()
    with infrastructure("rlbus-partial-", args.keep_runs, console) as (infra, runs_dir):
        for repeat in range(args.repeats):
            for mode in args.modes:  # modes interleaved, so a change in the machine's load hits them alike
                console.print(f"[bold]{mode}[/bold] repeat {repeat} (load {os.getloadavg()[0]:.1f})")
                r = run_one(mode, repeat, args, infra, runs_dir, n)
                results.append(r)
                console.print(f"  {r.steps_per_min:.1f} steps/min, discarded {r.discarded_share:.1%}"
                              if r.ok else f"  [red]failed: {r.error}")
    wall = time.monotonic() - t0
    console.print(table(results))
    summary = summarize(results)
    mach = machine()
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(json.dumps({"command": command, "machine": mach, "wall_s": wall,
                                              "summary": summary, "results": [asdict(r) for r in results]},
                                             indent=2) + "\n")
    if args.docs:
        write_section("## Partial rollout", docs(command, results, summary, mach, args, wall), Path(args.docs))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
