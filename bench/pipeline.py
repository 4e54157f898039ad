"""Pipeline schedule: the same workload synchronous (max_staleness 0) and asynchronous (1, 2), side by side.

    .venv/bin/python bench/pipeline.py [--workload simulated|quickstart|all] [--steps N] [--warmup 2]

Each run is a real `rlbus up` (embedded nats-server, local Ray, trainer and producers as their own processes) with
overrides; the bench tails its metrics.jsonl, stamps each step row as it lands, and computes over the steps after a
warm-up:

    steps/min      = measured steps / wall time from the last warm-up step's row to the last step's row
    trainer busy   = sum(time/fetch + time/record + time/train + time/publish_weights) / that same wall time
    staleness      = mean of staleness/mean (trainer version - oldest token's version)

`trainer.max_staleness=0` is the synchronous schedule: the feeder admits a step's prompts only once the previous
step's weights are published (trainer/feeder.py), so generation, training and weight sync never overlap (see the
`## Pipeline` section of docs/benchmarks.md for the argument and the measured check). Workloads:

  simulated   configs/bench_simulated.yaml: the `simulated` engine sleeps for Pareto-distributed response lengths
              (no model math), with 1, 4 and 16 producers; a random-weights tiny model supplies the tokenizer and
              the trainer's math.
  quickstart  configs/quickstart.yaml as it is (HF generation on CPU, tool calls), fewer steps.

Prints a table with the async/sync ratio of steps/min per workload and producer count; writes
bench/results/pipeline.json and the `## Pipeline` section of docs/benchmarks.md. Run directories go to a temporary
folder, removed at the end unless --keep-runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# Run as a script, sys.path[0] is bench/: put the repository root there instead, so `bench.common` imports.
sys.path[0] = str(Path(__file__).resolve().parents[1])

from rich.console import Console  # noqa: E402

from bench.common import machine, shown, tail_up  # noqa: E402
from bench.pipeline_report import MODES, console_table, ratios, write_docs  # noqa: E402
from bench.step_breakdown import breakdown, mean_parts, plot_compare, plot_run  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RLBUS = [sys.executable, "-m", "rlbus.cli"]
RESULTS = ROOT / "bench" / "results" / "pipeline.json"
BREAKDOWN_PNG = ROOT / "bench" / "results" / "pipeline_breakdown.png"
DOCS = ROOT / "docs" / "benchmarks.md"
SIM_CONFIG = ROOT / "configs" / "bench_simulated.yaml"
QUICKSTART_CONFIG = ROOT / "configs" / "quickstart.yaml"
#: Random-weights tiny model (tokenizer + trainer weights) for the simulated workload.
BENCH_MODEL = ROOT / ".rlbus" / "models" / "bench-random"
QUICKSTART_MODEL = ROOT / ".rlbus" / "models" / "tiny-calculator"
#: The schedules compared: label -> trainer.max_staleness.
SIM_PRODUCERS = (1, 4, 16)
#: Default attempts per run: a run that crashes (e.g. a transient bus error) is started again from scratch.
ATTEMPTS = 3


@dataclass
class RunSpec:
    workload: str
    mode: str
    num_producers: int
    config: Path
    overrides: list[str]

    @property
    def max_staleness(self) -> int:
        return MODES[self.mode]

    @property
    def label(self) -> str:
        return f"{self.workload}-p{self.num_producers}-{self.mode}"


@dataclass
class RunResult:
    workload: str
    mode: str
    max_staleness: int
    num_producers: int
    ok: bool
    attempts: int
    steps: int = 0  # step rows written
    measured_steps: int = 0
    window_s: float = 0.0  # wall time the measured steps span
    steps_per_min: float = 0.0
    trainer_busy: float = 0.0  # fraction of the window the trainer computed (fetch, record, train, publish)
    wait_data_s: float = 0.0  # mean time/wait_data per measured step
    train_s: float = 0.0  # mean time/train per measured step
    staleness_mean: float = 0.0
    staleness_max: float = 0.0
    dropped_stale: int = 0  # groups the batcher dropped as too stale, over the run
    abandoned: int = 0  # feeder releases that never became a trained group, over the run
    regenerated: int = 0  # groups producers finished on too-old weights and gave back to be redone, over the run
    tokens_per_s: float = 0.0  # trained tokens (prompt + response) per wall second over the window
    startup_s: float = 0.0  # `rlbus up` start to the first step row
    total_s: float = 0.0  # `rlbus up` start to its exit
    error: str = ""
    load_before: float = 0.0  # 1-minute load average when the run started
    step_parts: dict[str, float] = field(default_factory=dict)  # mean seconds per measured step (step_breakdown)

    @property
    def key(self) -> tuple[str, int]:
        return self.workload, self.num_producers


# ---------------------------------------------------------------------------------------------------------- runs


def run_specs(workload: str, steps: int, quickstart_model: Path, producers: tuple[int, ...] = SIM_PRODUCERS,
              modes: tuple[str, ...] = tuple(MODES), qs_producers: tuple[int, ...] = ()) -> list[RunSpec]:
    specs: list[RunSpec] = []
    if workload in ("simulated", "all"):
        for p in producers:
            for mode in modes:
                specs.append(RunSpec("simulated", mode, p, SIM_CONFIG,
                                     [f"model.path={BENCH_MODEL}", f"rollout.num_producers={p}",
                                      f"trainer.total_steps={steps}"]))
    if workload in ("quickstart", "all"):
        for p in qs_producers or (quickstart_producers(),):
            for mode in modes:
                # As configured, less the end-of-run extras (curves) that cost bench time and are not measured.
                specs.append(RunSpec("quickstart", mode, p, QUICKSTART_CONFIG,
                                     [f"model.path={quickstart_model}", f"trainer.total_steps={steps}",
                                      f"rollout.num_producers={p}", "logging.plot=false"]))
    return specs


def quickstart_producers() -> int:
    from rlbus.schemas.config_io import load_config

    return load_config(QUICKSTART_CONFIG).rollout.num_producers


def ensure_bench_model(path: Path, console: Console) -> None:
    if (path / "config.json").is_file():
        return
    console.print(f"building a random-weights tiny model at {path}")
    subprocess.run([*RLBUS, "init-model", str(path), "--steps", "0", "--threads", "1"], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL)


class Infrastructure:
    """One nats-server and one Ray head for every run of the bench, started and stopped here once.

    Each `rlbus up` gets their addresses as overrides, so it starts neither (their start and stop took a minute per
    run here and are not what is measured). Runs stay apart: a run's subjects and streams are under its own name,
    and its named Ray actors (TransferQueue shards, weight store: `rlbus-<run>-...`) are killed after it ends.
    """

    server: Any  # bus.server.EmbeddedServer
    head: Any  # bus.ray_cluster.RayHead

    def __init__(self, root: Path):
        from rlbus.bus.ray_cluster import ensure_ray, start_ray_head
        from rlbus.bus.server import EmbeddedServer
        from rlbus.schemas.config import RayConfig

        self.server = EmbeddedServer(root / "bus", port=0).start()
        self.head = start_ray_head(object_store_memory=1_000_000_000)
        os.environ.update(self.head.env)  # the runs' processes join this head the way the launcher's children do
        ensure_ray(RayConfig(address=self.head.address))  # this process kills each run's actors afterwards

    def overrides(self, name: str) -> list[str]:
        """The run `name`'s addresses: the server gets the run's users (its admin file is handed to `rlbus up`,
        which gives each child its own role's file from beside it)."""
        self.server.add_run(name)
        return [f"bus.url={self.server.url}", f"bus.creds_file={self.server.creds_file('admin', name)}",
                f"ray.address={self.head.address}"]

    def forget_run(self, name: str) -> int:
        """Kill the detached actors a finished run left in Ray; returns how many."""
        import ray

        prefix = f"rlbus-{name}-"
        killed = 0
        for a in ray.util.list_named_actors(all_namespaces=True):
            if a["name"].startswith(prefix):
                ray.kill(ray.get_actor(a["name"], namespace=a["namespace"]))
                killed += 1
        return killed

    def close(self) -> None:
        import ray

        from rlbus.bus.ray_cluster import stop_ray_head

        ray.shutdown()
        stop_ray_head(self.head)
        self.server.stop()


@contextlib.contextmanager
def infrastructure(prefix: str, keep_runs: bool, console: Console) -> Iterator[tuple[Infrastructure, Path]]:
    """One nats-server and Ray head (Infrastructure) over a temporary folder of run directories, both gone at the end
    (the folder kept, and named, with `keep_runs`)."""
    runs_dir = Path(tempfile.mkdtemp(prefix=prefix))
    infra = Infrastructure(runs_dir)
    try:
        yield infra, runs_dir
    finally:
        infra.close()
        if keep_runs:
            console.print(f"run directories: {runs_dir}")
        else:
            shutil.rmtree(runs_dir, ignore_errors=True)


def execute(spec: RunSpec, infra: Infrastructure, runs_dir: Path, warmup: int, timeout_s: float,
            console: Console, attempts: int = ATTEMPTS) -> RunResult:
    """Run `rlbus up` for `spec` (again from scratch if it crashes, up to `attempts` times) and measure it."""
    errors: list[str] = []
    for attempt in range(1, attempts + 1):
        name = f"pipe-{spec.label}-{os.getpid()}-{attempt}"
        run_dir = runs_dir / name
        load = os.getloadavg()[0]
        rows, stamps, rc, started, ended = tail_run(spec, name, run_dir, infra.overrides(name), timeout_s)
        infra.forget_run(name)
        if rc == 0 and len(rows) > warmup + 1:
            res = measure(spec, rows, stamps, warmup)
            res.attempts, res.load_before = attempt, load
            res.startup_s, res.total_s = stamps[0] - started, ended - started
            res.error = "; ".join(errors)
            res.regenerated = count_regenerated(run_dir)
            parts = breakdown(rows, stamps)  # per step, from the second row; the measured ones from row warmup+1
            res.step_parts = mean_parts(parts, skip=max(0, warmup - 1))
            plot_run(parts, [r["step"] for r in rows[1:]], f"{spec.label}: where each step's wall time goes",
                     run_dir / "step_times.png")
            return res
        tail = last_error(run_dir)
        errors.append(f"attempt {attempt}: exit {rc} after {len(rows)} step(s): {tail}")
        console.print(f"[yellow]{spec.label}: attempt {attempt} failed (exit {rc}, {len(rows)} steps): {tail}")
    return RunResult(spec.workload, spec.mode, spec.max_staleness, spec.num_producers, ok=False, attempts=attempts,
                     error="; ".join(errors))


def tail_run(spec: RunSpec, name: str, run_dir: Path, infra_overrides: list[str], timeout_s: float
             ) -> tuple[list[dict], list[float], int, float, float]:
    """Start `rlbus up` for `spec`, stamp each metrics row when it appears, wait for the exit (bench.common.tail_up)."""
    argv = [*RLBUS, "up", str(spec.config), f"name={name}", f"logging.run_dir={run_dir}",
            f"trainer.max_staleness={spec.max_staleness}", *spec.overrides, *infra_overrides]
    return tail_up(argv, run_dir, timeout_s)


def count_regenerated(run_dir: Path) -> int:
    """Groups the producers generated in vain: finished on weights the staleness bound no longer allows, nak'ed
    and rolled out again (producers/service.py logs each one; no metric or event carries the count)."""
    return sum(1 for log in (run_dir / "logs").glob("producer-*.log")
               for line in log.read_text(errors="replace").splitlines()
               if "rlbus.producer: task " in line and " abandoned: generated at v" in line)


def last_error(run_dir: Path) -> str:
    """The last line of the trainer's log that names an error, for the report."""
    log = run_dir / "logs" / "trainer.log"
    if not log.is_file():
        log = run_dir / "launcher.out"
        if not log.is_file():
            return "no log"
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    hits = [ln for ln in lines if "Error" in ln or "error" in ln]
    return (hits or lines or ["empty log"])[-1][-200:]


def measure(spec: RunSpec, rows: list[dict], stamps: list[float], warmup: int) -> RunResult:
    """Rates over rows warmup+1..N, timed from the stamp of row `warmup` (the end of warm-up) to the last stamp."""
    measured = rows[warmup:]
    window = stamps[-1] - stamps[warmup - 1] if warmup > 0 else stamps[-1] - stamps[0]
    if warmup == 0:
        measured = rows[1:]  # without a warm-up, the first row only opens the window
    busy = sum(r.get("time/fetch", 0.0) + r.get("time/record", 0.0) + r.get("time/train", 0.0)
               + r.get("time/publish_weights", 0.0) for r in measured)
    tokens = sum(r["perf/tokens_per_s"] * r["time/step"] for r in measured)
    n = len(measured)
    return RunResult(
        spec.workload, spec.mode, spec.max_staleness, spec.num_producers, ok=True, attempts=1,
        steps=len(rows), measured_steps=n, window_s=window, steps_per_min=60.0 * n / window,
        trainer_busy=busy / window, wait_data_s=sum(r["time/wait_data"] for r in measured) / n,
        train_s=sum(r.get("time/train", 0.0) for r in measured) / n,
        staleness_mean=sum(r["staleness/mean"] for r in measured) / n,
        staleness_max=max(r["staleness/max"] for r in rows),
        dropped_stale=int(rows[-1]["batch/dropped_stale"]), abandoned=int(rows[-1]["feeder/abandoned"]),
        tokens_per_s=tokens / window,
    )


# ------------------------------------------------------------------------------------------------------- results

@dataclass
class Bench:
    command: str
    steps: int
    warmup: int
    machine: dict[str, Any]
    sim_engine: dict[str, Any]
    quickstart_model: str
    results: list[RunResult] = field(default_factory=list)
    load_end: float = 0.0
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)  # anything a reader of the numbers must know

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["ratios"] = {f"{w}/p{p}/{m}": round(v, 3) for (w, p, m), v in ratios(self.results).items()}
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Bench:
        d = {k: v for k, v in d.items() if k != "ratios"}
        return cls(**{**d, "results": [RunResult(**r) for r in d["results"]]})


# ---------------------------------------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", choices=("simulated", "quickstart", "all"), default="all")
    ap.add_argument("--steps", type=int, default=7, help="trainer.total_steps of every run")
    ap.add_argument("--producers", type=int, nargs="+", default=list(SIM_PRODUCERS),
                    help="producer counts of the simulated workload")
    ap.add_argument("--modes", nargs="+", choices=tuple(MODES), default=list(MODES))
    ap.add_argument("--qs-producers", type=int, nargs="+", default=[],
                    help="producer counts of the quickstart workload (default: the config's)")
    ap.add_argument("--warmup", type=int, default=2, help="step rows left out of the measurement")
    ap.add_argument("--attempts", type=int, default=ATTEMPTS, help="starts of a run that keeps crashing")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one `rlbus up` may take")
    ap.add_argument("--quickstart-model", default="",
                    help=f"model of the quickstart workload (default {QUICKSTART_MODEL.relative_to(ROOT)} if built, "
                         "else the random-weights bench model)")
    ap.add_argument("--results", default=str(RESULTS))
    ap.add_argument("--docs", default=str(DOCS), help="'' to leave docs/benchmarks.md alone")
    ap.add_argument("--from-json", default="", help="only redo the table and docs from a results file")
    ap.add_argument("--section", default="## Pipeline", help="heading of the docs section written")
    ap.add_argument("--keep-runs", action="store_true", help="keep the run directories (path printed)")
    args = ap.parse_args()
    if args.steps < args.warmup + 2:
        ap.error("--steps must exceed --warmup by at least 2 (one step opens the window, one is measured)")
    command = shlex.join([".venv/bin/python", "bench/pipeline.py", *sys.argv[1:]])
    console = Console()
    if args.from_json:
        bench = Bench.from_json(json.loads(Path(args.from_json).read_text()))
        console.print(console_table(bench.results))
        write_docs(bench, args, console)
        return 0
    ensure_bench_model(BENCH_MODEL, console)
    qs_model = Path(args.quickstart_model) if args.quickstart_model else (
        QUICKSTART_MODEL if (QUICKSTART_MODEL / "config.json").is_file() else BENCH_MODEL)

    from rlbus.schemas.config_io import load_config

    sim = load_config(SIM_CONFIG, [f"model.path={BENCH_MODEL}"])
    bench = Bench(command=command, steps=args.steps, warmup=args.warmup, machine=machine(),
                  sim_engine={**{f: getattr(sim.rollout.engine, f) for f in sim.rollout.engine.__struct_fields__},
                              "n": sim.rollout.n, "groups_per_step": sim.trainer.groups_per_step,
                              "max_new_tokens": sim.rollout.max_new_tokens},
                  quickstart_model=shown(qs_model))
    t0 = time.monotonic()
    with infrastructure("rlbus-pipeline-", args.keep_runs, console) as (infra, runs_dir):
        for spec in run_specs(args.workload, args.steps, qs_model, tuple(args.producers),
                              tuple(args.modes), tuple(args.qs_producers)):
            console.print(f"[bold]{spec.label}[/bold] (load {os.getloadavg()[0]:.1f})")
            res = execute(spec, infra, runs_dir, args.warmup, args.timeout, console, args.attempts)
            bench.results.append(res)
            if res.ok:
                console.print(f"  {res.steps_per_min:.1f} steps/min, trainer busy {res.trainer_busy:.0%}, "
                              f"staleness {res.staleness_mean:.2f}, startup {res.startup_s:.0f}s, "
                              f"total {res.total_s:.0f}s")
    bench.wall_s, bench.load_end = time.monotonic() - t0, os.getloadavg()[0]
    console.print(console_table(bench.results))
    Path(args.results).parent.mkdir(parents=True, exist_ok=True)
    Path(args.results).write_text(json.dumps(bench.to_json(), indent=2) + "\n")
    console.print(f"results: {args.results}")
    means = {f"{r.workload}-p{r.num_producers}-{r.mode}": r.step_parts for r in bench.results if r.ok and r.step_parts}
    if means:
        console.print(f"breakdown: {plot_compare(means, 'mean step, measured steps', BREAKDOWN_PNG)}")
    write_docs(bench, args, console)
    return 0 if all(r.ok for r in bench.results) else 1


if __name__ == "__main__":
    sys.exit(main())
