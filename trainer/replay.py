"""Replay recorded steps into a fresh trainer: reproduce a spike or a NaN on a laptop, without a single rollout.

    rlbus replay runs/quickstart --from-step 12 --steps 3
    rlbus replay runs/quickstart --from-step 12 algorithm.clip_ratio_high=0.28 trainer.lr=1e-6      # what-if

Rebuilds the TrainEngine from the newest checkpoint before step K (or from `model.path` when K's predecessors go
back to step 0), feeds it the recorded batches of steps ckpt+1 .. K+M-1 in order (those before K silently), and
compares each replayed step's metrics with the recorded ones (metrics.jsonl, else the step record). CPU, no bus, no
Ray, one rank: a run recorded on several ranks is replayed on the ranks' shards concatenated in rank order.
Needs `logging.record=full` (the tensors) and a checkpoint at or before K - 1 (`trainer.keep_checkpoints`). A step
the stability guard tightened is replayed at the LR scale it trained under (its `guard/lr_scale`); after a guard
rollback, the records and checkpoints are those of the steps redone.

Tests: `pytest tests/integration/test_replay.py`.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console
from rich.table import Table

from rlbus.common.threads import apply_torch_threads
from rlbus.consumers.event_log import RecordError, StepRecord, load_step_batch, read_steps
from rlbus.schemas.config import RunConfig
from rlbus.schemas.config_io import load_config
from rlbus.trainer.checkpoint import CheckpointError, list_checkpoints, load_checkpoint
from rlbus.trainer.engine import TrainEngine
from rlbus.trainer.guard import set_lr_scale
from rlbus.trainer.metrics import read_metrics

#: Replayed metrics that depend on wall-clock time or on the process (memory, the thread count the replay itself
#: sets), never compared.
_TIMING_PREFIXES = ("timing/", "time/", "perf/tokens_per_s", "perf/peak_rss_gb", "perf/torch_threads")


class MetricDiff(msgspec.Struct, kw_only=True):
    step: int
    name: str
    recorded: float | None  # None: not recorded (or recorded as non-finite)
    replayed: float

    @property
    def equal(self) -> bool:
        """Bit for bit (NaN equals NaN: a replayed NaN reproduces a recorded one)."""
        rec = math.nan if self.recorded is None else self.recorded
        return rec == self.replayed or (math.isnan(rec) and math.isnan(self.replayed))

    @property
    def abs_diff(self) -> float:
        rec = math.nan if self.recorded is None else self.recorded
        return abs(self.replayed - rec)


class ReplayResult(msgspec.Struct, kw_only=True):
    from_checkpoint: int  # step of the checkpoint the engine was restored from (0 = the base model)
    steps: list[int]  # steps compared
    metrics: dict[int, dict[str, float]]  # replayed metrics per compared step
    diffs: list[MetricDiff]
    torch_threads: int = 0  # intra-op threads the steps ran on (`replay_threads`)

    @property
    def identical(self) -> bool:
        return all(d.equal for d in self.diffs)


def replay_config(run_dir: str | Path, overrides: list[str] = ()) -> RunConfig:
    """The run's recorded config, on one CPU rank, with the user's overrides last (they may say otherwise)."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise RecordError(run_dir, f"{path} not found (the trainer writes it at start)")
    # A run recorded before trainer.skip_zero_grad_updates existed stepped AdamW on every update: replay it so.
    older = [] if "skip_zero_grad_updates:" in path.read_text() else ["trainer.skip_zero_grad_updates=false"]
    return load_config(path, ["trainer.num_ranks=1", "trainer.device=cpu", *older, *overrides])


def _checkpoint_before(run_dir: Path, step: int) -> tuple[int, Path | None]:
    best: tuple[int, Path | None] = (0, None)
    for p in list_checkpoints(run_dir / "checkpoints"):
        s = int(p.name.split("_", 1)[1])
        if s < step and s >= best[0] and (p / ".metadata").is_file():
            best = (s, p)
    return best


def _recorded_metrics(run_dir: Path, records: dict[int, StepRecord]) -> dict[int, dict[str, Any]]:
    rows = {int(r["step"]): r for r in read_metrics(run_dir) if "step" in r}
    return {s: rows.get(s, rec.metrics) for s, rec in records.items()}


def replay_threads(cfg: RunConfig, record: StepRecord, overrides: list[str] = ()) -> int:
    """Run this process's torch on the intra-op threads the recorded trainer's rank 0 used and return the count.

    CPU matrix products sum in a thread-dependent order, so bit for bit needs the same count. It is the step's
    `perf/torch_threads` metric where recorded; for older runs, the count the trainer's rank 0 chose (common/threads.py)
    from its config, here. A `trainer.torch_threads` override wins (a what-if on another thread count).
    """
    override = any(o.split("=", 1)[0].strip() == "trainer.torch_threads" for o in overrides)
    threads = record.metrics.get("perf/torch_threads")
    if threads and not override:  # held, and registered: other rlbus processes leave it these CPUs
        return apply_torch_threads(int(threads), 1, role="rlbus replay (the recorded count)")
    processes = record.world_size + cfg.rollout.num_producers
    # adapt=False: the recorded run's split, not the processes running now, and held (no refresh)
    return apply_torch_threads(cfg.trainer.torch_threads, processes, role="rlbus replay", takes_remainder=True,
                               adapt=False)


def replay(run_dir: str | Path, from_step: int, num_steps: int = 1, overrides: list[str] = (),
           *, engine: TrainEngine | None = None) -> tuple[ReplayResult, TrainEngine]:
    """Replay steps `from_step` .. `from_step + num_steps - 1`; returns the comparison and the engine after them.

    `engine`, when given, is used as is (already built, nothing restored): for callers that set it up themselves.
    """
    run_dir = Path(run_dir)
    if from_step < 1 or num_steps < 1:
        raise ValueError("--from-step must be >= 1 and --steps >= 1")
    cfg = replay_config(run_dir, overrides)
    records = {r.step: r for r in read_steps(run_dir)}
    last = from_step + num_steps - 1
    ckpt_step, ckpt = _checkpoint_before(run_dir, from_step)
    needed = list(range(ckpt_step + 1, last + 1))
    absent = [s for s in needed if s not in records]
    if absent:
        raise RecordError(run_dir, f"steps {absent} have no step record (recorded: {sorted(records) or 'none'})")
    thin = [s for s in needed if records[s].payload != "full"]
    if thin:
        raise RecordError(run_dir, f"steps {thin} were recorded without tensors (logging.record=metadata)")
    threads = replay_threads(cfg, records[needed[0]], overrides)
    if engine is None:
        engine = build_engine(cfg, ckpt)
    recorded = _recorded_metrics(run_dir, {s: records[s] for s in range(from_step, last + 1)})
    replayed: dict[int, dict[str, float]] = {}
    diffs: list[MetricDiff] = []
    for s in needed:
        # The LR scale the stability guard had this step train under (trainer/guard.py); 1.0 = the schedule's own.
        set_lr_scale(engine, float(records[s].metrics.get("guard/lr_scale") or 1.0))
        # Several recorded ranks: each update trains every rank's own mini-batch, as they did (engine.update_parts).
        engine.rank_rows = [len(rows) for rows in records[s].shards if rows]
        metrics = engine.train_step(load_step_batch(run_dir, records[s]))
        if s < from_step:
            continue  # brings the state to K; not compared
        replayed[s] = metrics
        for name, value in sorted(metrics.items()):
            if name.startswith(_TIMING_PREFIXES):
                continue
            rec = recorded[s].get(name)
            diffs.append(MetricDiff(step=s, name=name, recorded=None if rec is None else float(rec),
                                    replayed=float(value)))
    return ReplayResult(from_checkpoint=ckpt_step, steps=list(range(from_step, last + 1)), metrics=replayed,
                        diffs=diffs, torch_threads=threads), engine


def build_engine(cfg: RunConfig, ckpt: Path | None) -> TrainEngine:
    """A one-rank TrainEngine at the state of checkpoint `ckpt` (None: the base model, seeded as the trainer is)."""
    engine = TrainEngine.from_config(cfg)
    if ckpt is not None:
        load_checkpoint(engine, ckpt)  # model, optimizer, LR schedule, update count and RNG
        _apply_optimizer_overrides(engine, cfg)
    return engine


def _apply_optimizer_overrides(engine: TrainEngine, cfg: RunConfig) -> None:
    """A checkpoint restores the optimizer's hyper-parameters with its state; a what-if's own values win.

    Touched only where they differ from the restored ones, so a plain replay keeps the restored floats bit for bit.
    """
    t = cfg.trainer
    sched = engine.scheduler
    # (lr, weight decay) of each param group: the policy's; the shared critic's value head (its second) the critic's
    settings = [(t.lr, t.weight_decay), (cfg.critic.lr, cfg.critic.weight_decay)]
    for i, group in enumerate(engine.optimizer.param_groups):
        lr, weight_decay = settings[i]
        if sched.base_lrs[i] != lr:  # keep the schedule's position: scale the current LR by the same factor
            group["lr"] = lr * (group["lr"] / sched.base_lrs[i])
            group["initial_lr"] = sched.base_lrs[i] = lr
        if group["weight_decay"] != weight_decay:
            group["weight_decay"] = weight_decay
        if tuple(group["betas"]) != tuple(t.betas):
            group["betas"] = tuple(t.betas)


def render(result: ReplayResult, console: Console, *, show_all: bool = False) -> None:
    title = (f"replay of steps {result.steps[0]}..{result.steps[-1]} from "
             f"{'checkpoint step ' + str(result.from_checkpoint) if result.from_checkpoint else 'the base model'}, "
             f"{result.torch_threads} torch thread(s)")
    table = Table(title=title)
    for col in ("step", "metric", "recorded", "replayed", "|diff|", ""):
        table.add_column(col, justify="right" if col not in ("metric", "") else "left")
    for d in result.diffs:
        if d.equal and not show_all:
            continue
        rec = "-" if d.recorded is None else f"{d.recorded:.9g}"
        table.add_row(str(d.step), d.name, rec, f"{d.replayed:.9g}", f"{d.abs_diff:.3g}",
                      "[green]=[/green]" if d.equal else "[red]differs[/red]")
    if table.row_count:
        console.print(table)
    same = sum(d.equal for d in result.diffs)
    verdict = "[green]bit for bit identical[/green]" if result.identical else "[yellow]differs[/yellow]"
    console.print(f"{same}/{len(result.diffs)} metrics equal over {len(result.steps)} step(s): {verdict}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rlbus replay", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", help="a run directory recorded with logging.record=full")
    p.add_argument("--from-step", type=int, required=True, help="first step to compare (K)")
    p.add_argument("--steps", type=int, default=1, help="number of steps to compare from K (M)")
    p.add_argument("--all", action="store_true", help="show equal metrics too, not only the differences")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the comparison as JSON")
    p.add_argument("--strict", action="store_true", help="exit 1 unless every metric is reproduced bit for bit")
    p.add_argument("overrides", nargs="*", help="config overrides for a what-if run, e.g. trainer.lr=1e-6")
    args = p.parse_intermixed_args(argv)
    console = Console()
    try:
        result, _ = replay(args.run_dir, args.from_step, args.steps, args.overrides)
    except (RecordError, CheckpointError) as e:  # missing, or refused as unsafe: say what, no traceback
        console.print(f"[red]rlbus replay:[/red] {e}")
        return 2
    render(result, console, show_all=args.all)
    if args.json:
        out = {"from_checkpoint": result.from_checkpoint, "steps": result.steps, "identical": result.identical,
               "diffs": [{"step": d.step, "metric": d.name, "recorded": d.recorded, "replayed": d.replayed,
                          "equal": d.equal} for d in result.diffs]}
        Path(args.json).write_text(json.dumps(out, indent=1, default=lambda x: None))
    return 1 if args.strict and not result.identical else 0
