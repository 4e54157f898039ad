"""`rlbus events RUN_DIR`: read a run's event log -- list, filter, decode one trajectory, export, or tail it live.

    rlbus events runs/quickstart                                   # everything, as a table per kind
    rlbus events runs/quickstart --kind steps --steps 10:12        # step records of steps 10..12 (inclusive)
    rlbus events runs/quickstart --kind traj --producer p0 --json  # one JSON object per line
    rlbus events runs/quickstart --group e0-i17-a0 --decode        # that group's trajectories as text
    rlbus events runs/quickstart --export trajectories.parquet     # one row per trained trajectory
    rlbus events runs/quickstart --follow                          # tail the live run (bus from launch.yaml)

The archive format is docs/event-log.md; the writer is consumers/recorder.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any, Iterator

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console
from rich.panel import Panel
from rich.table import Table
from rich.text import Text
from transformers import AutoTokenizer

from rlbus.bus.client import Bus
from rlbus.consumers.event_log import (
    EVENT_KIND,
    Entry,
    RecordError,
    StepRecord,
    iter_step_samples,
    load_rank_batch,
    mask_spans,
    read_entries,
    read_steps,
)
from rlbus.consumers.ledger import admission_bound, read_ledger
from rlbus.schemas.config_io import load_config
from rlbus.schemas.wire import Event, TrajectoryGroup, WeightsPublished

#: What `--kind` accepts: the archive kinds plus `steps` (the step records).
ALL_KINDS = ("prompts", "traj", "weights", "steps", "completed", "heartbeats", "lifecycle", "errors", "dead-letter",
             "evals", "guard")


class Filters(msgspec.Struct, kw_only=True):
    kinds: tuple[str, ...] = ALL_KINDS
    steps: tuple[int, int] | None = None  # inclusive
    producer: str = ""
    group: str = ""


def parse_steps(text: str) -> tuple[int, int]:
    """`A:B` (inclusive), `A:`, `:B` or `A`."""
    lo, sep, hi = text.partition(":")
    if not sep:
        return int(lo), int(lo)
    return int(lo) if lo else 0, int(hi) if hi else 1 << 62


# ---------------------------------------------------------------------------------------------------------------
# selecting


def _msg_fields(msg: Any) -> dict[str, Any]:
    return msgspec.to_builtins(msg)


def _step_of_group(steps: list[StepRecord]) -> dict[str, int]:
    return {g.group_id: r.step for r in steps for g in r.groups}


def select(run_dir: Path, f: Filters) -> Iterator[dict[str, Any]]:
    """Archived records passing the filters, as flat dicts with `kind` (the archive kind) first, in time order."""
    steps = read_steps(run_dir)
    trained = _step_of_group(steps)
    lo, hi = f.steps if f.steps is not None else (None, None)

    def in_steps(step: int | None) -> bool:
        return f.steps is None or (step is not None and lo <= step <= hi)

    out: list[dict[str, Any]] = []
    for kind in f.kinds:
        if kind == "steps":
            for r in steps:
                ids = [g.group_id for g in r.groups]
                if not in_steps(r.step) or (f.group and f.group not in ids) or \
                        (f.producer and all(g.producer_id != f.producer for g in r.groups)):
                    continue
                out.append({"kind": "steps", "t": r.created_at, **_step_summary(r)})
            continue
        for e in read_entries(run_dir, kind):
            row = _entry_row(kind, e, trained)
            if f.group and row.get("group_id", row.get("task_id")) != f.group:
                continue
            if f.producer and row.get("producer_id") != f.producer:
                continue
            if f.steps is not None and not in_steps(row.get("step")):
                continue
            out.append(row)
    out.sort(key=lambda r: r["t"])
    yield from out


def _entry_row(kind: str, e: Entry[Any], trained: dict[str, int]) -> dict[str, Any]:
    fields = _msg_fields(e.msg)
    fields.pop("schema_version", None)
    wire_type = fields.pop("kind", "")  # the struct's tag, e.g. role_started; `kind` here is the archive kind
    row = {"kind": kind, "type": wire_type, "t": e.recorded_at, "seq": e.seq, "subject": e.subject, **fields}
    if kind == "traj":
        row["step"] = trained.get(e.msg.group_id)  # the step that trained it, None if none (yet)
        row["samples"] = len(e.msg.samples)
        row["reward_mean"] = sum(s.reward for s in e.msg.samples) / max(1, len(e.msg.samples))
        row["min_version"], row["max_version"] = e.msg.min_version, e.msg.max_version
    elif kind == "prompts":
        row["group_id"] = e.msg.task_id
        row["step"] = trained.get(e.msg.task_id)
    elif kind == "dead-letter":
        row["payload"] = f"{len(e.msg.payload)} bytes"
    elif kind == "evals":
        row["accuracy"] = e.msg.metrics.get("eval/accuracy")
    return row


def _step_summary(r: StepRecord) -> dict[str, Any]:
    samples = [s for g in r.groups for s in g.samples]
    return {
        "step": r.step, "trained_version": r.trained_version, "version": r.version, "world_size": r.world_size,
        "groups": [g.group_id for g in r.groups], "num_groups": len(r.groups),
        "rows_per_rank": [len(rows) for rows in r.shards],
        "producers": sorted({g.producer_id for g in r.groups}),
        "min_version": min((s.min_version for s in samples), default=0),
        "reward_mean": sum(s.reward for s in samples) / max(1, len(samples)),
        "payload": r.payload, "payload_bytes": r.payload_bytes,
        "pg_loss": r.metrics.get("actor/pg_loss"), "grad_norm": r.metrics.get("actor/grad_norm"),
    }


# ---------------------------------------------------------------------------------------------------------------
# printing

_COLUMNS: dict[str, tuple[str, ...]] = {
    "prompts": ("seq", "task_id", "index", "epoch", "attempt", "released_version", "step"),
    "traj": ("seq", "group_id", "producer_id", "samples", "reward_mean", "min_version", "max_version", "step"),
    "weights": ("seq", "version", "step", "num_bytes", "checksum"),
    "steps": ("step", "num_groups", "rows_per_rank", "min_version", "reward_mean", "pg_loss", "grad_norm",
              "payload_bytes"),
    "completed": ("seq", "step", "version", "group_ids"),
    "heartbeats": ("seq", "producer_id", "version", "status", "groups_done", "groups_per_min", "inflight"),
    "lifecycle": ("seq", "type", "role", "role_id", "detail", "reason"),
    "errors": ("seq", "role", "role_id", "error", "message", "fatal"),
    "dead-letter": ("seq", "original_subject", "reason", "num_delivered", "payload"),
    "evals": ("seq", "version", "step", "num_prompts", "accuracy", "seconds"),
    "guard": ("seq", "step", "rules", "actions", "lr_scale", "max_staleness", "rollback_to"),
}


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list):
        text = ", ".join(map(str, v))
        return text if len(text) <= 60 else text[:57] + "..."
    return str(v)


def print_table(rows: list[dict[str, Any]], console: Any) -> None:
    for kind in ALL_KINDS:
        mine = [r for r in rows if r["kind"] == kind]
        if not mine:
            continue
        table = Table(title=f"{kind} ({len(mine)})", title_justify="left")
        cols = _COLUMNS[kind]
        for c in cols:
            table.add_column(c)
        for r in mine:
            table.add_row(*(_cell(r.get(c)) for c in cols))
        console.print(table)


def print_json(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        print(json.dumps(r, default=str))


# ---------------------------------------------------------------------------------------------------------------
# decoding and export


def _tokenizer(run_dir: Path) -> Any:
    cfg_path = run_dir / "config.yaml"
    if not cfg_path.is_file():
        raise RecordError(run_dir, f"{cfg_path} not found: cannot tell which tokenizer the run used")
    return AutoTokenizer.from_pretrained(load_config(cfg_path).model.path)


def decode_samples(run_dir: Path, step_rec: StepRecord, group_id: str, tok: Any) -> list[dict[str, Any]]:
    """Each trajectory of `group_id` in `step_rec`: prompt text, turns (assistant = trained, tool = masked out),
    the response mask over the response tokens, reward and versions."""
    batches: dict[int, Any] = {}
    out: list[dict[str, Any]] = []
    for rank, row, group, meta in iter_step_samples(step_rec):
        if group.group_id != group_id:
            continue
        if rank not in batches:
            batches[rank] = load_rank_batch(run_dir, step_rec.step, rank)
        b = batches[rank]
        p, n = meta.prompt_len, meta.prompt_len + meta.response_len
        ids = b["input_ids"][row, :n].tolist()
        mask = [int(x) for x in b["response_mask"][row, p:n].tolist()]
        versions = b["versions"][row, p:n].tolist()
        turns = [{"role": "assistant" if m else "tool", "tokens": e - s,
                  "text": tok.decode(ids[p + s:p + e], skip_special_tokens=False)} for m, s, e in mask_spans(mask)]
        out.append({
            "group_id": group_id, "step": step_rec.step, "rank": rank, "row": row, "key": meta.key,
            "producer_id": group.producer_id, "reward": meta.reward, "prompt_len": p, "response_len": meta.response_len,
            "num_turns": meta.num_turns, "num_tool_calls": meta.num_tool_calls, "finish_reason": meta.finish_reason,
            "min_version": meta.min_version, "max_version": meta.max_version, "trained_version": step_rec.trained_version,
            "prompt_text": tok.decode(ids[:p], skip_special_tokens=False),
            "response_text": tok.decode(ids[p:n], skip_special_tokens=False),
            "turns": turns, "response_mask": mask, "token_versions": [int(v) for v in versions],
        })
    return out


def decode_group(run_dir: Path, group_id: str) -> list[dict[str, Any]]:
    for r in read_steps(run_dir):
        if any(g.group_id == group_id for g in r.groups):
            if r.payload != "full":
                raise RecordError(run_dir, f"group {group_id} was trained at step {r.step}, recorded without "
                                           "tensors (logging.record=metadata): there is no text to decode")
            return decode_samples(run_dir, r, group_id, _tokenizer(run_dir))
    raise RecordError(run_dir, f"group {group_id} is in no recorded step (untrained, or not recorded)")


def print_decoded(samples: list[dict[str, Any]], console: Any) -> None:
    for i, s in enumerate(samples):
        body = Text()
        body.append("prompt: ", style="bold")
        body.append(s["prompt_text"] + "\n")
        for t in s["turns"]:
            style = "green" if t["role"] == "assistant" else "dim"
            body.append(f"[{t['role']}, {t['tokens']} tokens, mask={1 if t['role'] == 'assistant' else 0}] ",
                        style="bold " + style)
            body.append(t["text"] + "\n", style=style)
        body.append("mask:   " + "".join(map(str, s["response_mask"])) + "\n", style="cyan")
        title = (f"{s['group_id']} sample {i}  reward {s['reward']:g}  step {s['step']}  versions "
                 f"{s['min_version']}..{s['max_version']} (trained at {s['trained_version']})  "
                 f"{s['producer_id']}  {s['finish_reason']}")
        console.print(Panel(body, title=title, title_align="left"))


def export_parquet(run_dir: Path, out: str | Path, f: Filters) -> int:
    """One row per trained trajectory (text when its step was recorded in full); returns the row count."""

    tok = None
    rows: list[dict[str, Any]] = []
    for r in read_steps(run_dir):
        if f.steps is not None and not f.steps[0] <= r.step <= f.steps[1]:
            continue
        if r.payload == "full" and tok is None:
            tok = _tokenizer(run_dir)
        for g in r.groups:
            if (f.group and g.group_id != f.group) or (f.producer and g.producer_id != f.producer):
                continue
            if r.payload == "full":
                samples = decode_samples(run_dir, r, g.group_id, tok)
            else:  # metadata only: no text
                samples = [{"group_id": g.group_id, "step": r.step, "key": s.key, "producer_id": g.producer_id,
                            "reward": s.reward, "prompt_len": s.prompt_len, "response_len": s.response_len,
                            "num_turns": s.num_turns, "num_tool_calls": s.num_tool_calls,
                            "finish_reason": s.finish_reason, "min_version": s.min_version,
                            "max_version": s.max_version, "trained_version": r.trained_version,
                            "prompt_text": None, "response_text": None} for s in g.samples]
            for s in samples:
                rows.append({k: s.get(k) for k in (
                    "step", "group_id", "key", "producer_id", "reward", "prompt_len", "response_len", "num_turns",
                    "num_tool_calls", "finish_reason", "min_version", "max_version", "trained_version",
                    "prompt_text", "response_text")} | {"task_id": g.task_id, "data_source": g.data_source,
                                                        "index": g.index, "epoch": g.epoch, "attempt": g.attempt})
    for row in rows:
        row["text"] = None if row["prompt_text"] is None else row["prompt_text"] + row["response_text"]
    pq.write_table(pa.Table.from_pylist(rows), str(out))
    return len(rows)


# ---------------------------------------------------------------------------------------------------------------
# following a live run


def _live_config(run_dir: Path, config: str | None, overrides: list[str]) -> Any:
    path = Path(config) if config else run_dir / "launch.yaml"
    if not path.is_file():
        raise RecordError(run_dir, f"{path} not found: pass --config CONFIG bus.url=... bus.creds_file=... to "
                                   "follow a run not started by `rlbus up`")
    return load_config(path, overrides)


async def follow(run_dir: Path, f: Filters, *, config: str | None, overrides: list[str], as_json: bool,
                 console: Any) -> None:
    """Print new traj / weights / events messages as they are published, until interrupted."""

    cfg = _live_config(run_dir, config, overrides)
    queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

    async with await Bus.connect(cfg.bus, cfg.name, name="events-follow") as bus:
        s = bus.subjects

        async def pump(subject: str, typ: Any, kind: str | None) -> None:
            async for msg in bus.watch(subject, typ, deliver="new"):
                await queue.put((kind or EVENT_KIND[type(msg)], msg))

        wanted = [(s.traj, TrajectoryGroup, "traj"), (s.weights, WeightsPublished, "weights"), (s.events, Event, None)]
        tasks = [asyncio.create_task(pump(*w)) for w in wanted]
        try:
            while True:
                getter = asyncio.create_task(queue.get())
                done, _ = await asyncio.wait({getter, *tasks}, return_when=asyncio.FIRST_COMPLETED)
                for t in tasks:
                    if t in done:
                        getter.cancel()
                        t.result()  # a watcher failed: raise its error
                kind, msg = getter.result()
                if kind not in f.kinds and not (kind == "completed" and "steps" in f.kinds):
                    continue
                row = _entry_row(kind, Entry(seq=0, subject="", recorded_at=time.time(), msg=msg), {})
                if (f.group and row.get("group_id", row.get("task_id")) != f.group) or \
                        (f.producer and row.get("producer_id") != f.producer):
                    continue
                if as_json:
                    print(json.dumps(row, default=str), flush=True)
                else:
                    cols = _COLUMNS.get(kind, ())
                    console.print(f"[bold]{kind}[/bold] " + "  ".join(f"{c}={_cell(row.get(c))}" for c in cols
                                                                      if c != "seq"))
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


# ---------------------------------------------------------------------------------------------------------------


def print_ledger(run_dir: Path, console: Any, *, as_json: bool = False) -> int:
    """`--ledger`: the run's prompt accounting; 1 when a prompt is trained twice or not accounted for."""
    config = run_dir / "config.yaml"
    if not config.is_file():
        raise RecordError(run_dir, f"{config} not found (the trainer writes it at start)")
    ledger = read_ledger(run_dir)
    problems = ledger.problems(admission_bound(load_config(config)))
    if as_json:
        print(json.dumps({**ledger.counts(), "in_flight_ids": sorted(ledger.in_flight),
                          "given_up_why": ledger.given_up_why(), "problems": problems}))
    else:
        table = Table(title=f"prompt ledger of {run_dir}")
        table.add_column("prompts")
        table.add_column("count", justify="right")
        for name, n in ledger.counts().items():
            table.add_row(name, str(n))
        console.print(table)
        for why, n in ledger.given_up_why().items():
            console.print(f"given up: {n} example(s) whose releases were lost as: {why}")
        for problem in problems:
            console.print(f"[red]{problem}[/red]")
        if not problems:
            console.print("[green]every released prompt is trained once or accounted for[/green]")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rlbus events", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir")
    p.add_argument("--kind", action="append", choices=ALL_KINDS, help="only these kinds (repeatable)")
    p.add_argument("--steps", type=parse_steps, default=None, metavar="A:B", help="steps A..B, inclusive")
    p.add_argument("--producer", default="", metavar="ID")
    p.add_argument("--group", default="", metavar="ID", help="a group id (== its prompt's task id)")
    p.add_argument("--json", action="store_true", help="JSON lines instead of tables")
    p.add_argument("--decode", action="store_true", help="with --group: its trajectories as text")
    p.add_argument("--export", default=None, metavar="PATH.parquet", help="one row per trained trajectory")
    p.add_argument("--follow", action="store_true", help="tail the live run from the bus")
    p.add_argument("--ledger", action="store_true", help="every released prompt: trained once, re-issued, "
                   "dead-lettered, given up or in flight; exit 1 on any unaccounted for")
    p.add_argument("--config", default=None, help="run config for --follow (default RUN_DIR/launch.yaml)")
    p.add_argument("overrides", nargs="*", help="config overrides for --follow, e.g. bus.url=...")
    args = p.parse_intermixed_args(argv)
    console = Console()
    try:
        return _run(p, args, console)
    except RecordError as e:  # the run directory lacks what was asked: say what, no traceback
        console.print(f"[red]rlbus events:[/red] {e}")
        return 2


def _run(p: argparse.ArgumentParser, args: argparse.Namespace, console: Any) -> int:
    run_dir = Path(args.run_dir)
    f = Filters(kinds=tuple(args.kind) if args.kind else ALL_KINDS, steps=args.steps, producer=args.producer,
                group=args.group)
    if args.ledger:
        return print_ledger(run_dir, console, as_json=args.json)
    if args.follow:
        try:
            asyncio.run(follow(run_dir, f, config=args.config, overrides=args.overrides, as_json=args.json,
                               console=console))
        except KeyboardInterrupt:
            pass
        return 0
    if not (run_dir / "events").is_dir():
        raise RecordError(run_dir, "no events/ folder (was the run recorded with logging.record=off?)")
    if args.decode:
        if not args.group:
            p.error("--decode needs --group ID")
        samples = decode_group(run_dir, args.group)
        if args.json:
            print_json(samples)
        else:
            print_decoded(samples, console)
        return 0
    if args.export:
        n = export_parquet(run_dir, args.export, f)
        console.print(f"wrote {n} trajectories to {args.export}")
        return 0
    rows = list(select(run_dir, f))
    if args.json:
        print_json(rows)
    else:
        print_table(rows, console)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
