"""The live view of a run (`rlbus up`) and its end-of-run summary, drawn with rich.

The monitor reads the run's own records, never the processes' memory: the last line of metrics.jsonl for the step,
reward, throughput and staleness; producer heartbeats and queue depths from the bus.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from pathlib import Path
from typing import Any

import nats.errors
from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from rlbus.bus.client import Bus
from rlbus.schemas.config import RunConfig
from rlbus.schemas.errors import BusError
from rlbus.schemas.wire import Event, GuardAction, ProducerHeartbeat, RoleStarted
from rlbus.trainer.metrics import read_metrics

#: A producer whose last heartbeat is older than this many heartbeat intervals counts as offline.
OFFLINE_AFTER_INTERVALS = 3
CLOSE_TIMEOUT_S = 10.0  # how long the view's end waits for its watchers and its bus connection
log = logging.getLogger("rlbus.progress")


def last_metrics(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return {}
    with path.open("rb") as f:
        f.seek(0, 2)
        f.seek(max(0, f.tell() - 65536))
        lines = f.read().decode(errors="replace").strip().splitlines()

    # The last training row, with the newest eval/* of the evaluator's own rows (eval.interval) added to it.
    found: dict[str, Any] = {}
    for line in reversed(lines):
        with contextlib.suppress(json.JSONDecodeError):
            row = json.loads(line)
            if "eval/accuracy" in row:
                found.setdefault("eval/accuracy", row["eval/accuracy"])
                found.setdefault("eval/step", row.get("step"))
            else:
                return {**row, **found}
    return found


class RunMonitor:
    """Async context manager: while open, refreshes a rich Live panel twice a second."""

    cfg: RunConfig
    heartbeats: dict[str, tuple[float, ProducerHeartbeat]]
    started: dict[str, float]  # "trainer" / a producer id -> wall time of its last RoleStarted (the supervisor reads it)
    queue: dict[str, int]
    guard: GuardAction | None  # the stability guard's last action (trainer/guard.py), shown under the table
    guard_count: int  # its actions so far
    _children: list[Any]
    _console: Console
    _bus: Any
    _tasks: list[asyncio.Task]
    _progress: Progress
    _task_id: Any
    _live: Live | None

    def __init__(self, cfg: RunConfig, children: list[Any], console: Console):
        self.cfg, self._children, self._console = cfg, children, console
        self.heartbeats, self.started, self.queue = {}, {}, {}
        self.guard, self.guard_count = None, 0
        self._bus, self._tasks, self._live = None, [], None
        self._progress = Progress(TextColumn("[bold]step"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                  TextColumn("eta"), TimeRemainingColumn(), console=console)
        self._task_id = self._progress.add_task("train", total=cfg.trainer.total_steps)

    async def __aenter__(self) -> "RunMonitor":
        self._bus = await Bus.connect(self.cfg.bus, self.cfg.name, name="monitor")
        # In the background: on a bus of the user's the trainer creates the streams, and the supervisor must see to
        # a trainer that dies first (and to Ctrl-C) instead of waiting here for streams that will not come.
        self._tasks = [asyncio.create_task(self._begin())]
        return self

    async def _begin(self) -> None:
        while True:
            try:
                await self._bus.await_streams()
                break
            except BusError as e:
                self._console.print(f"[yellow]{e}; still waiting[/yellow]")
        self._live = Live(self._render(), console=self._console, refresh_per_second=2, transient=False)
        self._live.__enter__()
        self._tasks += [asyncio.create_task(self._watch_heartbeats()), asyncio.create_task(self._watch_starts()),
                        asyncio.create_task(self._watch_guard()), asyncio.create_task(self._refresh())]

    async def __aexit__(self, *exc) -> None:
        begin = self._tasks[0]
        begin.cancel()  # first, so that it adds no task after the others are cancelled
        await asyncio.gather(begin, return_exceptions=True)
        self.stop()
        for t in self._tasks[1:]:
            t.cancel()
        # Bounded: the view is only an observer, and a connection to a bus that restarted under it must not keep
        # the launcher from exiting once the run is over.
        if self._tasks[1:]:
            await asyncio.wait(self._tasks[1:], timeout=CLOSE_TIMEOUT_S)
        if self._bus is not None:
            try:
                await asyncio.wait_for(self._bus.close(), timeout=CLOSE_TIMEOUT_S)
            except Exception as e:  # a timeout too: nothing is left to do with the connection
                log.warning("the live view's bus connection did not close (%s: %s)", type(e).__name__, e)

    def stop(self) -> None:
        if self._live is not None:
            self._live.update(self._render())
            self._live.__exit__(None, None, None)
            self._live = None

    async def _watch_heartbeats(self) -> None:
        async for hb in self._bus.watch(self._bus.subjects.event("heartbeat.*"), ProducerHeartbeat, deliver="new"):
            self.heartbeats[hb.producer_id] = (time.monotonic(), hb)

    async def _watch_starts(self) -> None:
        # From the start of the stream: a role may come up before this watch does.
        async for e in self._bus.watch(self._bus.subjects.event("lifecycle"), Event, deliver="all"):
            if isinstance(e, RoleStarted):
                key = "trainer" if e.role == "trainer" else e.role_id
                self.started[key] = max(self.started.get(key, 0.0), e.created_at)

    async def _watch_guard(self) -> None:
        async for e in self._bus.watch(self._bus.subjects.event("guard"), GuardAction, deliver="all"):
            self.guard, self.guard_count = e, self.guard_count + 1

    async def _refresh(self) -> None:
        s = self._bus.subjects
        while True:
            try:
                self.queue["prompts"] = await self._bus.stream_msgs(s.prompts_stream)
                pending, ack_pending = await self._bus.consumer_pending(s.traj_stream, s.traj_consumer)
                self.queue["traj"] = pending
                self.queue["traj_held"] = ack_pending
            except (BusError, nats.errors.Error, asyncio.TimeoutError):
                pass  # the bus is restarting (the supervisor sees to it); the view shows the last numbers meanwhile
            if self._live is not None:
                self._live.update(self._render())
            await asyncio.sleep(1.0)

    def online(self) -> int:
        limit = OFFLINE_AFTER_INTERVALS * self.cfg.rollout.heartbeat_interval_s
        now = time.monotonic()
        return sum(1 for t, hb in self.heartbeats.values() if now - t < limit and hb.status != "draining")

    def _render(self) -> Group:
        m = last_metrics(self.cfg.run_dir)
        self._progress.update(self._task_id, completed=m.get("step", 0))
        table = Table.grid(padding=(0, 3))
        for _ in range(9):
            table.add_column()

        def fmt(key: str, spec: str = ".3f") -> str:
            v = m.get(key)
            return "-" if v is None else format(v, spec)

        # clip: the share of tokens whose PPO ratio left [1 - low, 1 + high] (actor/clipfrac); it stays 0 with one
        # update per step (trainer.mini_batches 1), where the ratio is 1 by construction. mismatch: the k3 estimate
        # of KL(behaviour || proximal), how far the producers' policy is from the trainer's.
        table.add_row("reward", "eval", "clip", "mismatch", "tokens/s", "staleness", "producers", "prompts queued",
                      "groups waiting")
        table.add_row(fmt("reward/mean"), fmt("eval/accuracy"), fmt("actor/clipfrac"), fmt("mismatch/kl_k3", ".1e"),
                      fmt("perf/tokens_per_s", ".0f"), fmt("staleness/mean", ".2f"),
                      f"{self.online()}/{len(self._children)}", str(self.queue.get("prompts", "-")),
                      str(self.queue.get("traj", "-")))
        if self.guard is None:
            return Group(self._progress, table)
        return Group(self._progress, table, guard_line(self.guard, self.guard_count))


def guard_line(e: GuardAction, count: int) -> str:
    """The live view's line for the stability guard's last action (rich markup)."""
    return f"[yellow]guard ({count} action{'s' if count != 1 else ''}): {describe_guard_action(e)}[/yellow]"


def describe_guard_action(e: GuardAction) -> str:
    """One line of what the guard did (the live view and `rlbus status`)."""
    return (f"step {e.step} {', '.join(e.rules)} -> {', '.join(e.actions)}"
            + (f"; rolled back to step {e.rollback_to}" if e.rollback_to >= 0 else "")
            + (f"; LR x{e.lr_scale:g}" if e.lr_scale != 1.0 else "")
            + (f", max_staleness {e.max_staleness}" if e.max_staleness >= 0 else "")
            + (f" until step {e.tightened_until}" if e.tightened_until else ""))


def summary_table(run_dir: Path) -> Table:
    """First and last steps of a run side by side, plus what the run directory holds."""

    every = read_metrics(run_dir)
    rows = [r for r in every if "eval/accuracy" not in r]  # the evaluator's rows are apart
    evals = [r for r in every if "eval/accuracy" in r]
    table = Table(title=f"run {run_dir}", show_lines=False)
    table.add_column("metric")
    table.add_column("first 5 steps", justify="right")
    table.add_column("last 10 steps", justify="right")
    if not rows:
        return table

    def avg(rs: list[dict], key: str) -> str:
        vals = [r[key] for r in rs if isinstance(r.get(key), (int, float))]
        return f"{sum(vals) / len(vals):.3f}" if vals else "-"

    for key in ("reward/mean", "tool_calls/mean", "response_length/mean", "staleness/mean", "actor/pg_loss",
                "actor/entropy", "actor/clipfrac", "actor/grad_norm", "perf/tokens_per_s", "time/step",
                "time/wait_data"):  # time/step leaves out the wait for data: a producer-bound run shows here
        table.add_row(key, avg(rows[:5], key), avg(rows[-10:], key))
    if evals:  # held-out accuracy: the first evaluation against the last
        table.add_row(f"eval/accuracy (step {evals[0]['step']} / {evals[-1]['step']})",
                      f"{evals[0]['eval/accuracy']:.3f}", f"{evals[-1]['eval/accuracy']:.3f}")
    table.caption = f"{len(rows)} steps; " + ", ".join(run_outputs(run_dir))
    return table


#: What a run may write in its run directory, named in its closing summary when it is there.
RUN_OUTPUTS = ("metrics.jsonl", "tensorboard/", "curves.png", "checkpoints/", "final_model/")


def run_outputs(run_dir: Path) -> list[str]:
    """The entries of RUN_OUTPUTS the run directory holds (logging.tensorboard / logging.plot false write none)."""
    return [name for name in RUN_OUTPUTS if (run_dir / name.rstrip("/")).exists()]
