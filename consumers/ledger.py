"""The prompt ledger of a run: every released prompt trained exactly once, or accounted for by name.

    rlbus events runs/quickstart --ledger            # exits 1 on any prompt not accounted for

Read from a run directory alone (the event archive, docs/event-log.md, and the feeder's feeder.json):

- released: every PromptTask the feeder released (events/prompts.jsonl), by task id `e<epoch>-i<index>-a<attempt>`;
- trained: the groups of each step's final record (events/steps.jsonl; a step redone after a crash replaces its
  record), which must hold no group twice, and only groups that were released;
- the rest are accounted for by name: re-issued (a later attempt of the same example was released), dead-lettered
  (events/dead_letters.jsonl: the prompt itself), retired (its group dropped without a re-issue: non-finite rewards,
  or uniform rewards under dynamic sampling; feeder.json, with why), given up after feeder.max_attempts releases
  lost for its own sake or feeder.max_stale_releases lost to staleness (feeder.json, with why each of its releases
  was lost: "too stale", "payload lost", ...), or in flight when the
  archive ends -- at most what admission lets be released ahead of training.

A dead-lettered *group* accounts for no prompt: a forged group naming a real prompt is dead-lettered while the real
group is still to come, and a real group dropped for good is retired by the feeder, which says so by name.

The fault tests (tests/system/test_faults.py) end with this check.
"""

from __future__ import annotations

import contextlib
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from rlbus.consumers.event_log import read_entries, read_steps
from rlbus.schemas.config import RunConfig
from rlbus.schemas.errors import SchemaError
from rlbus.schemas.wire import PromptTask, TypedDecoder

_TASK = re.compile(r"^e(\d+)-i(\d+)-a(\d+)$")


@dataclass
class Ledger:
    released: list[str]
    trained: list[str]
    reissued: set[str] = field(default_factory=set)
    dead_lettered: set[str] = field(default_factory=set)
    given_up: set[str] = field(default_factory=set)
    retired: dict[str, str] = field(default_factory=dict)  # task id -> why its group was dropped without a re-issue
    why_lost: dict[str, list[str]] = field(default_factory=dict)  # "e<epoch>-i<index>" -> why each release was lost

    def given_up_why(self) -> dict[str, int]:
        """How many examples were given up for each sequence of losses ("too stale, too stale, payload lost": n)."""
        out: Counter[str] = Counter()
        for task in self.given_up:
            m = _TASK.match(task)
            out[", ".join(self.why_lost.get(f"e{m[1]}-i{m[2]}", ["not recorded"])) if m else "not recorded"] += 1
        return dict(out.most_common())

    @property
    def in_flight(self) -> set[str]:
        return (set(self.released) - set(self.trained) - self.reissued - self.dead_lettered - self.given_up
                - set(self.retired))

    def counts(self) -> dict[str, int]:
        return {"released": len(self.released), "trained": len(self.trained), "re-issued": len(self.reissued),
                "dead-lettered": len(self.dead_lettered), "retired": len(self.retired),
                "given up": len(self.given_up), "in flight": len(self.in_flight)}

    def problems(self, max_in_flight: int) -> list[str]:
        out = []
        twice = [g for g, n in Counter(self.trained).items() if n > 1]
        if twice:
            out.append(f"trained more than once: {sorted(twice)[:10]}")
        unreleased = set(self.trained) - set(self.released)
        if unreleased:
            out.append(f"trained but never released: {sorted(unreleased)[:10]}")
        dup_releases = [t for t, n in Counter(self.released).items() if n > 1]
        if dup_releases:
            out.append(f"released more than once: {sorted(dup_releases)[:10]}")
        if len(self.in_flight) > max_in_flight:
            out.append(f"{len(self.in_flight)} released prompts unaccounted for (more than the {max_in_flight} "
                       f"admission lets be in flight): {sorted(self.in_flight)[:10]}")
        return out


def read_ledger(run_dir: str | Path) -> Ledger:
    released = [e.msg.task_id for e in read_entries(run_dir, "prompts")]
    trained = [g.group_id for rec in read_steps(run_dir) for g in rec.groups]
    attempts: dict[tuple[int, int], int] = {}
    for task_id in released:
        m = _TASK.match(task_id)
        if m:
            key = (int(m[1]), int(m[2]))
            attempts[key] = max(attempts.get(key, -1), int(m[3]))
    reissued = {t for t in released if (m := _TASK.match(t)) and attempts[(int(m[1]), int(m[2]))] > int(m[3])}
    decoder = TypedDecoder(PromptTask)
    dead = set()
    for e in read_entries(run_dir, "dead-letter"):
        if e.msg.original_subject.endswith(".prompts") and e.msg.payload_bytes <= len(e.msg.payload):
            with contextlib.suppress(SchemaError):  # garbage on prompts names no prompt
                dead.add(decoder.decode(e.msg.payload).task_id)
    feeder = Path(run_dir) / "feeder.json"
    state = msgspec.json.decode(feeder.read_bytes(), type=FeederLedger) if feeder.is_file() else FeederLedger()
    return Ledger(released=released, trained=trained, reissued=reissued, dead_lettered=dead,
                  given_up=set(state.gave_up), retired=dict(state.retired), why_lost=state.lost)


class FeederLedger(msgspec.Struct):
    """The part of trainer/feeder.py's FeederState the ledger reads (consumers/ does not import the trainer)."""

    gave_up: list[str] = []
    lost: dict[str, list[str]] = {}
    retired: dict[str, str] = {}


def admission_bound(cfg: RunConfig) -> int:
    """How many releases admission lets be ahead of training: (the highest staleness bound + 1) steps' groups, plus
    a step's groups being trained."""
    return (cfg.trainer.staleness_ceiling + 2) * cfg.trainer.groups_per_step
