"""The inspector's index of a run directory: SQLite tables built from the event log and metrics, kept in step.

`rlbus ui` answers every page from this index, never by scanning the run's files per request, so a run of 10,000
steps and 300,000 samples opens and pages fast (bench/inspector.py). The index is built lazily the first time a run
is opened and cached as `RUN_DIR/ui/index.sqlite` (a temporary directory when the run directory is read-only); each
refresh reads only the bytes appended to each source file since the last one. A file that was rewritten rather
than appended to (a resumed or rolled-back run cuts `metrics.jsonl` and `events/steps.jsonl` back) no longer holds
the bytes the index last read at the same place, and is read again from its start.

    index = RunIndex.open(run_dir)     # build or catch up; cheap when nothing changed
    index.refresh()                    # read what was appended since (the live page calls it)
    index.db.execute("SELECT ...")

Sources: metrics.jsonl, metrics.discarded.jsonl and events/{steps,prompts,heartbeats,lifecycle,guard,weights,
errors}.jsonl (formats in docs/event-log.md). Tests: `pytest tests/unit/test_ui_index.py`.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import sqlite3
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import msgspec

from rlbus.consumers.event_log import KINDS, STEPS_FILE, Entry, StepRecord, events_dir
from rlbus.schemas.wire import ProducerHeartbeat

#: Bump when the tables change: an index of another version is rebuilt.
INDEX_VERSION = 4
INDEX_FILE = "index.sqlite"
#: The metrics drawn by the overview, stored as columns (the whole row is kept too, for the step comparison).
OVERVIEW_KEYS = ("reward/mean", "eval/accuracy", "actor/entropy", "mismatch/kl_k3", "mismatch/kl_k1",
                 "staleness/mean", "staleness/max", "perf/tokens_per_s", "time/step", "actor/grad_norm",
                 "actor/clipfrac", "actor/pg_loss", "actor/lr", "response_length/mean", "guard/lr_scale")
_TAIL = 64  # bytes before a file's read offset that must be unchanged for an append-only catch-up

SCHEMA = f"""
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS sources (name TEXT PRIMARY KEY, offset INTEGER, tail TEXT);
CREATE TABLE IF NOT EXISTS metrics (step INTEGER, is_eval INTEGER, row TEXT,
    {", ".join(f'"{k}" REAL' for k in OVERVIEW_KEYS)});
CREATE TABLE IF NOT EXISTS discarded (step INTEGER, row TEXT);
CREATE TABLE IF NOT EXISTS steps (step INTEGER PRIMARY KEY, trained_version INTEGER, version INTEGER,
    world_size INTEGER, payload TEXT, num_groups INTEGER, num_samples INTEGER, created_at REAL, pos INTEGER,
    len INTEGER);
CREATE TABLE IF NOT EXISTS samples (id INTEGER PRIMARY KEY, step INTEGER, gpos INTEGER, spos INTEGER,
    rank INTEGER, row INTEGER, group_id TEXT, task_id TEXT, producer_id TEXT, reward REAL, prompt_len INTEGER,
    response_len INTEGER, num_turns INTEGER, num_tool_calls INTEGER, finish_reason TEXT, min_version INTEGER,
    max_version INTEGER, staleness INTEGER);
CREATE TABLE IF NOT EXISTS prompts (task_id TEXT PRIMARY KEY, text TEXT, ground_truth TEXT, data_source TEXT,
    released_version INTEGER, t REAL);
CREATE TABLE IF NOT EXISTS heartbeats (t REAL, producer_id TEXT, pid INTEGER, host TEXT, version INTEGER,
    status TEXT, groups_done INTEGER, tokens_generated INTEGER, tokens_discarded INTEGER,
    samples_restarted INTEGER, inflight INTEGER, inflight_limit INTEGER, engine_idle REAL, infra_failures INTEGER,
    env_failures INTEGER, tool_retries INTEGER);
CREATE TABLE IF NOT EXISTS lifecycle (t REAL, kind TEXT, role TEXT, role_id TEXT, pid INTEGER, detail TEXT,
    clean INTEGER);
CREATE TABLE IF NOT EXISTS guard (t REAL, step INTEGER, rules TEXT, actions TEXT, message TEXT,
    rollback_to INTEGER, lr_scale REAL);
CREATE TABLE IF NOT EXISTS weights (t REAL, version INTEGER, step INTEGER, num_bytes INTEGER);
CREATE TABLE IF NOT EXISTS errors (t REAL, role TEXT, role_id TEXT, error TEXT, message TEXT, failure TEXT);
"""

#: Made after the first build's rows are in (a bulk insert into indexed tables is several times slower).
INDEXES = """
CREATE INDEX IF NOT EXISTS metrics_step ON metrics (step);
CREATE INDEX IF NOT EXISTS samples_step ON samples (step);
CREATE INDEX IF NOT EXISTS samples_reward ON samples (reward);
CREATE INDEX IF NOT EXISTS samples_staleness ON samples (staleness);
CREATE INDEX IF NOT EXISTS samples_length ON samples (response_len);
CREATE INDEX IF NOT EXISTS samples_task ON samples (task_id);
CREATE INDEX IF NOT EXISTS samples_turns ON samples (num_turns);
CREATE INDEX IF NOT EXISTS samples_tools ON samples (num_tool_calls);
CREATE INDEX IF NOT EXISTS heartbeats_producer ON heartbeats (producer_id, t);
"""

_STEP_DEC = msgspec.json.Decoder(StepRecord)


def _entries(kind: str) -> msgspec.json.Decoder:
    return msgspec.json.Decoder(Entry[KINDS[kind][1]])


def _json(line: bytes) -> Any:
    """One JSON line: msgspec's decoder, several times faster than the standard one, which reads what it refuses
    (NaN and Infinity, which a metrics row may hold)."""
    try:
        return msgspec.json.decode(line)
    except msgspec.DecodeError:
        return json.loads(line)


def _metrics_rows(lines: list[bytes]) -> Iterable[tuple]:
    for ln in lines:
        row = _json(ln)
        if "step" not in row:
            continue
        yield (int(row["step"]), int("eval/accuracy" in row), ln.decode(),
               *(_num(row.get(k)) for k in OVERVIEW_KEYS))


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


class RunIndex:
    """The SQLite index of one run directory (see the module's docstring)."""

    run_dir: Path
    path: Path
    db: sqlite3.Connection
    generation: int  # bumped whenever a source was read again from its start: pages holding old rows reload
    _starts: list[int]  # while a reader runs: the file position of each of its lines
    _readers: dict[str, tuple[Path, Callable[[list[bytes]], None], tuple[str, ...]]]

    def __init__(self, run_dir: str | os.PathLike, path: Path):
        self.run_dir = Path(run_dir)
        self.path = path
        self.db = sqlite3.connect(path, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=OFF")  # a cache: a torn index is rebuilt, never trusted
        if self._version() != INDEX_VERSION:
            self._drop_all()
        self.db.executescript(SCHEMA)
        self.db.execute("INSERT OR REPLACE INTO meta VALUES ('version', ?)", (str(INDEX_VERSION),))
        self.generation = 0
        ev = events_dir(run_dir)
        self._readers = {
            "metrics": (self.run_dir / "metrics.jsonl", self._add_metrics, ("metrics",)),
            "discarded": (self.run_dir / "metrics.discarded.jsonl", self._add_discarded, ("discarded",)),
            "steps": (ev / STEPS_FILE, self._add_steps, ("steps", "samples")),
            "prompts": (ev / KINDS["prompts"][0], self._add_prompts, ("prompts",)),
            "heartbeats": (ev / KINDS["heartbeats"][0], self._add_heartbeats, ("heartbeats",)),
            "lifecycle": (ev / KINDS["lifecycle"][0], self._add_lifecycle, ("lifecycle",)),
            "guard": (ev / KINDS["guard"][0], self._add_guard, ("guard",)),
            "weights": (ev / KINDS["weights"][0], self._add_weights, ("weights",)),
            "errors": (ev / KINDS["errors"][0], self._add_errors, ("errors",)),
        }
        self._decoders = {k: _entries(k) for k in ("prompts", "heartbeats", "lifecycle", "guard", "weights",
                                                    "errors")}

    @classmethod
    def open(cls, run_dir: str | os.PathLike) -> RunIndex:
        """The run's index, built or caught up. Cached in RUN_DIR/ui, or a temporary directory if that is read-only."""
        run_dir = Path(run_dir)
        if not any((run_dir / name).exists() for name in ("config.yaml", "metrics.jsonl", "events")):
            raise FileNotFoundError(f"{run_dir} holds no config.yaml, metrics.jsonl or events/: not a run directory")
        folder = run_dir / "ui"
        try:
            folder.mkdir(exist_ok=True)
            probe = folder / ".write-test"
            probe.touch()
            probe.unlink()
        except OSError:
            digest = hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:16]
            folder = Path(tempfile.gettempdir()) / f"rlbus-ui-{digest}"
            folder.mkdir(mode=0o700, exist_ok=True)
        index = cls(run_dir, folder / INDEX_FILE)
        index.refresh()
        index.db.executescript(INDEXES)  # a no-op once they exist
        return index

    def _version(self) -> int:
        try:
            row = self.db.execute("SELECT value FROM meta WHERE key='version'").fetchone()
        except sqlite3.OperationalError:
            return -1
        return int(row[0]) if row else -1

    def _drop_all(self) -> None:
        tables = [r[0] for r in self.db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        for t in tables:
            self.db.execute(f'DROP TABLE "{t}"')
        self.db.commit()

    # -- catching up -------------------------------------------------------------------------------------------------

    def refresh(self) -> bool:
        """Read what every source gained since the last refresh; True if anything changed."""
        changed = False
        for name, (path, add, tables) in self._readers.items():
            changed |= self._catch_up(name, path, add, tables)
        if changed:
            self.db.commit()
        return changed

    def _catch_up(self, name: str, path: Path, add: Callable[[list[bytes]], None], tables: tuple[str, ...]) -> bool:
        row = self.db.execute("SELECT offset, tail FROM sources WHERE name=?", (name,)).fetchone()
        offset, tail = row if row else (0, "")
        try:
            f = path.open("rb")
        except FileNotFoundError:
            if offset:
                self._reset(name, tables)
                return True
            return False
        with f:
            size = f.seek(0, os.SEEK_END)
            if offset and (size < offset or _tail(f, offset) != tail):
                self._reset(name, tables)  # rewritten (cut back, replaced): read it again from the start
                offset = 0
            if size == offset:
                return False
            f.seek(offset)
            data = f.read(size - offset)
        end = data.rfind(b"\n") + 1  # whole lines only: a line being written is read next time
        if end == 0:
            return False
        raw = data[:end].split(b"\n")[:-1]  # the last piece is what follows the final newline: nothing
        starts = itertools.accumulate((len(ln) + 1 for ln in raw), initial=offset)
        self._starts = [at for at, ln in zip(starts, raw) if ln.strip()]  # each line's place in the file
        add([ln for ln in raw if ln.strip()])
        offset += end
        with path.open("rb") as f:
            tail = _tail(f, offset)
        self.db.execute("INSERT OR REPLACE INTO sources VALUES (?, ?, ?)", (name, offset, tail))
        return True

    def _reset(self, name: str, tables: tuple[str, ...]) -> None:
        for t in tables:
            self.db.execute(f"DELETE FROM {t}")
        self.db.execute("DELETE FROM sources WHERE name=?", (name,))
        self.generation += 1

    # -- one reader per source ---------------------------------------------------------------------------------------

    def _add_metrics(self, lines: list[bytes]) -> None:
        marks = ",".join("?" * (3 + len(OVERVIEW_KEYS)))
        self.db.executemany(f"INSERT INTO metrics VALUES ({marks})", _metrics_rows(lines))

    def _add_discarded(self, lines: list[bytes]) -> None:
        self.db.executemany("INSERT INTO discarded VALUES (?, ?)",
                            ((int(r["step"]), ln.decode()) for ln in lines if "step" in (r := _json(ln))))

    def _add_steps(self, lines: list[bytes]) -> None:
        indexed = bool(self.db.execute("SELECT 1 FROM steps LIMIT 1").fetchone())  # else only these lines' steps
        seen: set[int] = set()
        for ln, at in zip(lines, self._starts):
            rec = _STEP_DEC.decode(ln)
            # The last record of a step wins (a step redone after a crash), as consumers.event_log.read_steps says.
            if rec.step in seen or (indexed and self.db.execute("SELECT 1 FROM steps WHERE step=?",
                                                                 (rec.step,)).fetchone()):
                self.db.execute("DELETE FROM samples WHERE step=?", (rec.step,))
            rows = []
            for rank, shard in enumerate(rec.shards):
                for i, r in enumerate(shard):
                    g = rec.groups[r.group]
                    s = g.samples[r.sample]
                    stale = rec.trained_version - s.min_version if s.min_version >= 0 else None
                    rows.append((rec.step, r.group, r.sample, rank, i, g.group_id, g.task_id, g.producer_id,
                                 s.reward, s.prompt_len, s.response_len, s.num_turns, s.num_tool_calls,
                                 s.finish_reason, s.min_version, s.max_version, stale))
            self.db.executemany("INSERT INTO samples (step, gpos, spos, rank, row, group_id, task_id, producer_id, "
                                "reward, prompt_len, response_len, num_turns, num_tool_calls, finish_reason, "
                                "min_version, max_version, staleness) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                                rows)
            self.db.execute("INSERT OR REPLACE INTO steps VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                            (rec.step, rec.trained_version, rec.version, rec.world_size, rec.payload,
                             len(rec.groups), len(rows), rec.created_at, at, len(ln)))
            seen.add(rec.step)

    def _decoded(self, kind: str, lines: list[bytes]) -> Iterable[Any]:
        dec = self._decoders[kind]
        return (dec.decode(ln) for ln in lines)

    def _add_prompts(self, lines: list[bytes]) -> None:
        rows = []
        for e in self._decoded("prompts", lines):
            m = e.msg
            text = "\n".join(f"{c.role}: {c.content}" for c in m.prompt)
            rows.append((m.task_id, text, m.ground_truth, m.data_source, m.released_version, e.recorded_at))
        self.db.executemany("INSERT OR REPLACE INTO prompts VALUES (?, ?, ?, ?, ?, ?)", rows)

    def _add_heartbeats(self, lines: list[bytes]) -> None:
        self.db.executemany(f"INSERT INTO heartbeats VALUES ({','.join('?' * 16)})",
                            (_heartbeat_row(e.msg) for e in self._decoded("heartbeats", lines)))

    def _add_lifecycle(self, lines: list[bytes]) -> None:
        rows = []
        for e in self._decoded("lifecycle", lines):
            m = e.msg
            kind = type(m).__name__
            if kind == "RoleStarted":
                rows.append((m.created_at, kind, m.role, m.role_id, m.pid, m.detail, 1))
            elif kind == "RoleStopped":
                rows.append((m.created_at, kind, m.role, m.role_id, 0, m.reason, int(m.clean)))
            else:  # ProducersScaled
                rows.append((m.created_at, kind, "launcher", "launcher", 0,
                             f"{m.previous} -> {m.target} (+{','.join(m.added)} -{','.join(m.removed)})", 1))
        self.db.executemany("INSERT INTO lifecycle VALUES (?, ?, ?, ?, ?, ?, ?)", rows)

    def _add_guard(self, lines: list[bytes]) -> None:
        self.db.executemany("INSERT INTO guard VALUES (?, ?, ?, ?, ?, ?, ?)",
                            ((m.created_at, m.step, ",".join(m.rules), ",".join(m.actions), m.message, m.rollback_to,
                              m.lr_scale) for m in (e.msg for e in self._decoded("guard", lines))))

    def _add_weights(self, lines: list[bytes]) -> None:
        self.db.executemany("INSERT INTO weights VALUES (?, ?, ?, ?)",
                            ((m.created_at, m.version, m.step, m.num_bytes)
                             for m in (e.msg for e in self._decoded("weights", lines))))

    def _add_errors(self, lines: list[bytes]) -> None:
        self.db.executemany("INSERT INTO errors VALUES (?, ?, ?, ?, ?, ?)",
                            ((m.created_at, m.role, m.role_id, m.error, m.message, m.failure or None)
                             for m in (e.msg for e in self._decoded("errors", lines))))

    # -- small helpers for the views ---------------------------------------------------------------------------------

    def rows(self, sql: str, args: tuple = ()) -> list[dict[str, Any]]:
        cur = self.db.execute(sql, args)
        names = [d[0] for d in cur.description]
        return [dict(zip(names, r)) for r in cur.fetchall()]

    def step_record(self, step: int) -> StepRecord | None:
        """Step `step`'s record, read from its own line of events/steps.jsonl (not the whole file)."""
        got = self.db.execute("SELECT pos, len FROM steps WHERE step=?", (step,)).fetchone()
        if got is None:
            return None
        with (events_dir(self.run_dir) / STEPS_FILE).open("rb") as f:
            f.seek(got[0])
            return _STEP_DEC.decode(f.read(got[1]))

    def checkpoints(self) -> list[int]:
        """Steps of the checkpoints on disk now (older ones were pruned: trainer.keep_checkpoints)."""
        folder = self.run_dir / "checkpoints"
        if not folder.is_dir():
            return []
        return sorted(int(p.name[5:]) for p in folder.iterdir() if p.name.startswith("step_") and p.name[5:].isdigit())

    def close(self) -> None:
        self.db.close()


def sizing_reported(hb: ProducerHeartbeat) -> bool:
    """Whether a heartbeat carries its producer's in-flight limit, engine idle share and failure counts: a producer
    that reports them holds a limit of at least 1, and one from before they existed decodes with their defaults
    (a limit of 0), which must show as unknown, not as zero failures. `rlbus status` asks the same."""
    return hb.inflight_limit > 0


def _heartbeat_row(m: ProducerHeartbeat) -> tuple:
    """One heartbeats row; NULL in the in-flight and failure columns where the heartbeat predates them."""
    sizing = (m.inflight_limit, m.engine_idle, m.infra_failures, m.env_failures, m.tool_retries)
    return (m.created_at, m.producer_id, m.pid, m.host, m.version, m.status, m.groups_done, m.tokens_generated,
            m.tokens_discarded, m.samples_restarted, m.inflight,
            *(sizing if sizing_reported(m) else (None,) * len(sizing)))


def _tail(f: Any, offset: int) -> str:
    """A digest of the `_TAIL` bytes before `offset`: unchanged iff the file still holds what was read there."""
    start = max(0, offset - _TAIL)
    f.seek(start)
    return hashlib.blake2b(f.read(offset - start), digest_size=8).hexdigest()


def timed_open(run_dir: str | os.PathLike) -> tuple[RunIndex, float]:
    """The index and the seconds it took to open it (bench/inspector.py)."""
    t0 = time.perf_counter()
    index = RunIndex.open(run_dir)
    return index, time.perf_counter() - t0
