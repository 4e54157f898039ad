"""The state the run's Ray actors hold: TransferQueue shards and the weight-version table.

A Ray worker imports the module of the class it hosts, so these classes live where nothing imports torch: each actor
then starts in about 0.5 CPU-s, not the 2 that importing torch cost it (the shards hold numpy arrays and object
references only; bus/transfer_queue.py and bus/weight_store.py pack tensors on the caller's side).
tests/integration/test_transfer_queue.py checks that an actor's process has not imported torch.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import ray

if TYPE_CHECKING:
    from rlbus.bus.ray_store import Packed

log = logging.getLogger("rlbus.weight_store")

STAGE_EXPIRY_S = 300.0  # staged (uncommitted) puts older than this belong to a crashed client and are dropped


@functools.cache
def remote_class(cls: type, **options: Any) -> Any:
    """`ray.remote(**options)(cls)`, made once per process on first use, never at import. `ray.remote` draws from
    Ray's process-wide ID generator, and a process forked after that draw copies its state: the roles `rlbus up`
    forks from its fork server (cli/preload.py) would then make the same "random" IDs, and two producers starting
    together collide on the object store's warm-up object (one dies in a Ray check and is restarted)."""
    return ray.remote(**options)(cls)


def owner_of(key: str) -> str:
    """The first path component of a key: `e0-i5-a0` for `e0-i5-a0/d1/3`."""
    return key.split("/", 1)[0]


@dataclass
class Staged:
    at: float
    items: dict[str, tuple[dict[str, Packed], int]]
    num_bytes: int


class Shard:
    """One TransferQueue shard: key -> {field: (dtype, array)} in this actor's memory, with bounded capacity.

    A plain (single-threaded) actor: calls run one at a time, so the counters need no lock.
    """

    def __init__(self, index: int, capacity_items: int, capacity_bytes: int):
        self.index = index
        self.capacity_items = capacity_items
        self.capacity_bytes = capacity_bytes
        self.items: dict[str, tuple[dict[str, Packed], int]] = {}  # key -> (fields, num_bytes)
        self.num_bytes = 0
        self.staged: dict[str, Staged] = {}  # txn id -> a put waiting for commit
        self.by_owner: dict[str, set[str]] = {}  # owner_of(key) -> the stored keys under it
        self.started_at = time.time()  # Unix time; a shard Ray restarts (empty) has a later one

    def _usage(self) -> tuple[int, int]:
        return (
            len(self.items) + sum(len(s.items) for s in self.staged.values()),
            self.num_bytes + sum(s.num_bytes for s in self.staged.values()),
        )

    def put(self, batch: dict[str, dict[str, Packed]], txn: str | None) -> dict | None:
        """Store `batch` (committed now if txn is None, else staged under txn). Returns None, or a rejection."""
        now = time.monotonic()
        for old in [t for t, s in self.staged.items() if now - s.at > STAGE_EXPIRY_S]:
            del self.staged[old]
        # Copy out of the call's argument buffer: that buffer belongs to the caller and dies with it.
        entries = {
            key: ({f: (dt, np.array(a, copy=True)) for f, (dt, a) in fields.items()},
                  sum(a.nbytes for _, a in fields.values()))
            for key, fields in batch.items()
        }  # fmt: skip
        put_bytes = sum(n for _, n in entries.values())
        replaced = [self.items[k][1] for k in entries if k in self.items]
        used_items, used_bytes = self._usage()
        want_items = used_items + len(entries) - len(replaced)
        want_bytes = used_bytes + put_bytes - sum(replaced)
        if want_items > self.capacity_items or want_bytes > self.capacity_bytes:
            limit = "capacity_items" if want_items > self.capacity_items else "capacity_bytes"
            return {
                "shard": self.index, "limit": limit, "capacity_items": self.capacity_items,
                "capacity_bytes": self.capacity_bytes, "used_items": used_items, "used_bytes": used_bytes,
                "put_items": len(entries), "put_bytes": put_bytes,
            }  # fmt: skip
        if txn is None:
            self._commit(entries)
        else:
            self.staged[txn] = Staged(at=now, items=entries, num_bytes=put_bytes)
        return None

    def _commit(self, entries: dict[str, tuple[dict[str, Packed], int]]) -> None:
        for key, entry in entries.items():
            old = self.items.pop(key, None)
            if old is not None:
                self.num_bytes -= old[1]
            self.items[key] = entry
            self.num_bytes += entry[1]
            self.by_owner.setdefault(owner_of(key), set()).add(key)

    def finish(self, txn: str, commit: bool) -> bool:
        """Commit or drop a staged put. False if it is unknown (expired)."""
        staged = self.staged.pop(txn, None)
        if staged is None:
            return False
        if commit:
            self._commit(staged.items)
        return True

    def get(self, keys: list[str]) -> dict:
        """Per (field, dtype): one flat array of the keys' values in order, plus each key's shape."""
        missing = [k for k in keys if k not in self.items]
        if missing:
            return {"missing": missing}
        groups: dict[tuple[str, str], tuple[list[int], list[tuple[int, ...]], list[np.ndarray]]] = {}
        for pos, key in enumerate(keys):
            for name, (dtype, arr) in self.items[key][0].items():
                positions, shapes, parts = groups.setdefault((name, dtype), ([], [], []))
                positions.append(pos)
                shapes.append(arr.shape)
                parts.append(arr.reshape(-1))
        return {
            "fields": {
                group: (positions, shapes, np.concatenate(parts) if len(parts) > 1 else parts[0])
                for group, (positions, shapes, parts) in groups.items()
            }
        }

    def missing(self, keys: list[str]) -> dict:
        """Which of `keys` this shard does not hold, and since when it has run (its tensors are not read)."""
        return {"missing": [k for k in keys if k not in self.items], "started_at": self.started_at}

    def delete(self, keys: list[str], owners: list[str] = ()) -> int:
        """Drop keys, and every key of each owner; returns how many were stored."""
        doomed = set(keys).union(*(self.by_owner.get(o, ()) for o in owners))
        num_deleted = 0
        for key in doomed:
            entry = self.items.pop(key, None)
            if entry is not None:
                self.num_bytes -= entry[1]
                num_deleted += 1
                same = self.by_owner[owner_of(key)]
                same.discard(key)
                if not same:
                    del self.by_owner[owner_of(key)]
        return num_deleted

    def stats(self) -> dict:
        return {
            "shard": self.index,
            "started_at": self.started_at,
            "items": len(self.items),
            "bytes": self.num_bytes,
            "staged_items": sum(len(s.items) for s in self.staged.values()),
            "staged_bytes": sum(s.num_bytes for s in self.staged.values()),
            "capacity_items": self.capacity_items,
            "capacity_bytes": self.capacity_bytes,
        }


@dataclass(frozen=True)
class WeightsInfo:
    """What the weight store holds for one version; mirrors the fields of wire.WeightsPublished."""

    version: int
    num_bytes: int
    checksum: str
    num_tensors: int
    dtype: str  # dtype holding most of the bytes
    store: str  # name of the weight-store actor


class WeightVersions:
    """Keeps the `keep` versions put last, each as one object-store object: the publisher's, or after `adopt` the
    actor's own copy (which outlives the publisher).

    "Last put", not "highest number": a trainer resumed from an older checkpoint puts a lower version than the
    store holds, and that version (the one producers are told to load) must stay. Calls may run at once (an
    `adopt` copying while producers `get`), so the table is guarded by a lock.
    """

    def __init__(self, keep: int, name: str):
        self.keep = keep
        self.name = name
        self.versions: dict[int, tuple[list[ray.ObjectRef], WeightsInfo, bool]] = {}  # ..., adopted
        self._lock = threading.Lock()

    def put(self, version: int, refs: list[ray.ObjectRef], info: WeightsInfo) -> list[int]:
        """Hold `version` as the publisher's object (`refs[0]`); returns the versions evicted."""
        with self._lock:
            self.versions.pop(version, None)  # a re-put moves to the end: dicts keep insertion order
            self.versions[version] = (refs, info, False)
            evicted = list(self.versions)[: -self.keep]
            for v in evicted:
                del self.versions[v]
        return evicted

    def adopt(self, version: int) -> bool:
        """Copy the publisher's object of `version` into one this actor owns. (Ray 2.56 removed ray.put's `_owner`,
        which would have let the publisher make such a copy without a second one.) False if evicted or lost."""
        with self._lock:
            held = self.versions.get(version)
        if held is None or held[2]:
            return held is not None
        t0 = time.perf_counter()
        try:
            own = ray.put(ray.get(held[0][0]))  # zero-copy read of the publisher's object, one copy into ours
        except ray.exceptions.RayError as e:  # the publisher died before we got to it
            log.warning("%s: could not adopt weights v%d: %s", self.name, version, e)
            return False
        with self._lock:
            if self.versions.get(version) is held:  # not evicted or re-put while we copied
                self.versions[version] = ([own], held[1], True)
        log.info("%s: adopted weights v%d in %.0f ms", self.name, version, 1e3 * (time.perf_counter() - t0))
        return True

    def get(self, version: int | None) -> tuple[list[ray.ObjectRef], WeightsInfo] | list[int]:
        """([ref], info), or the versions held when `version` is not. The ref travels inside a list so that Ray
        hands the caller the reference (to fetch zero-copy) instead of resolving it here."""
        with self._lock:
            if version is None and self.versions:
                version = next(reversed(self.versions))  # the one put last
            held = self.versions.get(version) if version is not None else None
            return held[:2] if held is not None else sorted(self.versions)

    def list_versions(self) -> list[int]:
        with self._lock:
            return sorted(self.versions)
