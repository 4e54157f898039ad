"""The data plane: trajectory tensors and policy weights, stored by named, detached Ray actors of the run.

    tq = TransferQueue.connect("quickstart", cfg.ray)           # creates or attaches to the run's shard actors
    await tq.put_many({"g7/0": {"input_ids": ids_T, ...}, ...})   # producer; then publish the keys on NATS
    batch = await tq.get(["g7/0", "g7/1"])                       # trainer: TensorDict, batch_size [2], padded
    await tq.delete(["g7/0", "g7/1"])                            # after the step that used them is durable
    ws = WeightStore.connect("quickstart", cfg.ray); info = await ws.put(3, model.state_dict())

Every async method has a `*_sync` twin with the same arguments for synchronous code (trainer ranks); both run
the same plan (`_Plan` generators that yield the Ray calls to wait for), so they cannot drift apart.

Ownership. Ray frees an object when its owner -- the process that ray.put it -- dies. A producer may exit (or be
SIGKILLed) right after `put`, so tensors must not be owned by it:
- TransferQueue shards keep trajectory tensors in their own memory (copied out of the call's argument buffer).
  A put is one actor call per shard carrying the whole batch, and a get returns, per field, one flat array of the
  requested keys: a handful of large zero-copy buffers instead of thousands of small Ray objects (the benchmark,
  bench/transfer_queue.py, measures this against raw ray.put/ray.get of one object per trajectory).
- The WeightStore actor ray.put's each version itself and keeps the ref: the actor owns it, and every producer on
  a node maps the same object-store copy (weights are large and read by many).
Tensors travel as numpy arrays (zero-copy both ways); dtypes numpy lacks (bfloat16, ...) travel as a same-width
integer view and are viewed back. Tensors handed out by get_list / WeightStore.get may share read-only
shared memory: treat them as read-only (load_state_dict and torch ops that produce new tensors are fine).

Capacity (cfg.capacity_items / capacity_bytes) is split evenly over the shards; a put that would exceed its shard's
share raises TransferQueueFull and stores nothing. A put_many spanning shards is staged on each shard first and
committed only when every shard accepted it, so a rejected batch leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
import uuid
import warnings
import zlib
from collections.abc import Generator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import ray
import torch
from tensordict import TensorDict

from rlbus.bus.ray_cluster import ensure_ray
from rlbus.schemas.config import RayConfig
from rlbus.schemas.errors import PayloadMissing, TransferQueueError, TransferQueueFull, WeightsMissing

T = TypeVar("T")
# A plan yields the Ray calls (ObjectRefs) it must wait for and receives their results; its return value is the
# operation's result. `_run_async` and `_run_sync` drive it.
_Plan = Generator[list[ray.ObjectRef], list[Any], T]
Packed = tuple[str, np.ndarray]  # (torch dtype name, array); the array may be an integer view of that dtype

STAGE_EXPIRY_S = 300.0  # staged (uncommitted) puts older than this belong to a crashed client and are dropped

# ---------------------------------------------------------------------------------------------------------------
# tensors <-> numpy

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NUMPY_OK: dict[torch.dtype, bool] = {}


def _numpy_ok(dtype: torch.dtype) -> bool:
    ok = _NUMPY_OK.get(dtype)
    if ok is None:
        try:  # the only way to learn whether this torch build maps a dtype to numpy; asked once per dtype
            torch.empty(0, dtype=dtype).numpy()
            ok = True
        except TypeError:
            ok = False
        _NUMPY_OK[dtype] = ok
    return ok


def pack_tensor(t: torch.Tensor) -> Packed:
    """A CPU tensor as (dtype name, numpy array sharing its memory); GPU tensors are copied to CPU first."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    name = str(t.dtype).removeprefix("torch.")
    if not _numpy_ok(t.dtype):
        t = t.view(_INT_OF_WIDTH[t.element_size()])
    return name, t.numpy()


def unpack_tensor(packed: Packed) -> torch.Tensor:
    """Inverse of pack_tensor, zero-copy. Call inside `_quiet_readonly()` when the array may be read-only."""
    name, arr = packed
    t = torch.from_numpy(arr)
    dtype = getattr(torch, name)
    return t if t.dtype == dtype else t.view(dtype)


class _quiet_readonly(warnings.catch_warnings):
    # Arrays from the object store are read-only; torch warns on each from_numpy of one. We hand them out as
    # documented read-only tensors, so the warning is noise here (and only here).
    def __enter__(self) -> None:
        super().__enter__()
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


def shard_of(key: str, num_shards: int) -> int:
    """Stable across processes and machines (Python's hash() is salted per process)."""
    return zlib.crc32(key.encode()) % num_shards


# ---------------------------------------------------------------------------------------------------------------
# the storage actor


@dataclass
class _Staged:
    at: float
    items: dict[str, tuple[dict[str, Packed], int]]
    num_bytes: int


class _Shard:
    """One TransferQueue shard: key -> {field: (dtype, array)} in this actor's memory, with bounded capacity.

    A plain (single-threaded) actor: calls run one at a time, so the counters need no lock.
    """

    def __init__(self, index: int, capacity_items: int, capacity_bytes: int):
        self.index = index
        self.capacity_items = capacity_items
        self.capacity_bytes = capacity_bytes
        self.items: dict[str, tuple[dict[str, Packed], int]] = {}  # key -> (fields, num_bytes)
        self.num_bytes = 0
        self.staged: dict[str, _Staged] = {}  # txn id -> a put waiting for commit

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
            self.staged[txn] = _Staged(at=now, items=entries, num_bytes=put_bytes)
        return None

    def _commit(self, entries: dict[str, tuple[dict[str, Packed], int]]) -> None:
        for key, entry in entries.items():
            old = self.items.pop(key, None)
            if old is not None:
                self.num_bytes -= old[1]
            self.items[key] = entry
            self.num_bytes += entry[1]

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

    def delete(self, keys: list[str]) -> int:
        num_deleted = 0
        for key in keys:
            entry = self.items.pop(key, None)
            if entry is not None:
                self.num_bytes -= entry[1]
                num_deleted += 1
        return num_deleted

    def stats(self) -> dict:
        return {
            "shard": self.index,
            "items": len(self.items),
            "bytes": self.num_bytes,
            "staged_items": sum(len(s.items) for s in self.staged.values()),
            "staged_bytes": sum(s.num_bytes for s in self.staged.values()),
            "capacity_items": self.capacity_items,
            "capacity_bytes": self.capacity_bytes,
        }


_ShardActor = ray.remote(num_cpus=0, max_restarts=-1)(_Shard)


def _run_sync(plan: _Plan[T]) -> T:
    try:
        refs = next(plan)
        while True:
            refs = plan.send(ray.get(refs))
    except StopIteration as done:
        return done.value


async def _run_async(plan: _Plan[T]) -> T:
    try:
        refs = next(plan)
        while True:
            results = list(await asyncio.gather(*refs))
            refs = plan.send(results)
    except StopIteration as done:
        return done.value


def _actor_name(run: str, what: str) -> str:
    return f"rlbus-{run}-{what}"


# ---------------------------------------------------------------------------------------------------------------
# TransferQueue


class TransferQueue:
    """Client of one run's shard actors. Cheap to create; any number of processes may hold one."""

    run: str
    shards: list[ray.actor.ActorHandle]

    def __init__(self, run: str, shards: list[ray.actor.ActorHandle]):
        self.run = run
        self.shards = shards

    @classmethod
    def connect(cls, run: str, cfg: RayConfig) -> TransferQueue:
        """Create the run's shard actors, or attach to them if another process already did (blocks until ready).

        Initialises Ray with `cfg` if this process has not yet. Capacities are fixed by whoever creates the actors.
        """
        ensure_ray(cfg)
        n = cfg.num_storage_actors
        # The shard count is part of the name: a client with another count would map keys to other shards.
        shards = [
            _ShardActor.options(
                name=_actor_name(run, f"tq-{i}-of-{n}"),
                namespace=cfg.namespace,
                lifetime="detached",
                get_if_exists=True,
            ).remote(i, math.ceil(cfg.capacity_items / n), math.ceil(cfg.capacity_bytes / n))
            for i in range(n)
        ]
        ray.get([s.stats.remote() for s in shards])
        return cls(run, shards)

    def shard_of(self, key: str) -> int:
        return shard_of(key, len(self.shards))

    # -- plans -----------------------------------------------------------------------------------------------

    def _put_plan(self, items: Mapping[str, Mapping[str, torch.Tensor]]) -> _Plan[None]:
        by_shard: dict[int, dict[str, dict[str, Packed]]] = {}
        for key, fields in items.items():
            by_shard.setdefault(self.shard_of(key), {})[key] = {f: pack_tensor(t) for f, t in fields.items()}
        if not by_shard:
            return
        # One shard: its put is atomic by itself. Several: stage everywhere, commit only if all accepted.
        txn = uuid.uuid4().hex if len(by_shard) > 1 else None
        order = list(by_shard)
        rejections = yield [self.shards[i].put.remote(by_shard[i], txn) for i in order]
        if txn is not None:
            commit = all(r is None for r in rejections)
            accepted = [i for i, r in zip(order, rejections) if r is None]
            yield [self.shards[i].finish.remote(txn, commit) for i in accepted]
        refused = [r for r in rejections if r is not None]
        if refused:
            raise TransferQueueFull(self._full_message(refused[0], len(items)))

    def _full_message(self, r: dict, num_items: int) -> str:
        n = len(self.shards)
        return (
            f"TransferQueue of run {self.run!r} is full: shard {r['shard']} would exceed its {r['limit']} "
            f"(per shard: {r['capacity_items']} items / {r['capacity_bytes']} bytes, 1/{n} of ray.{r['limit']}); "
            f"it holds {r['used_items']} items / {r['used_bytes']} bytes and this put adds {r['put_items']} "
            f"items / {r['put_bytes']} bytes. Nothing of this put ({num_items} keys) was stored. "
            "Delete consumed keys, or raise ray.capacity_items / ray.capacity_bytes."
        )

    def _fetch_plan(self, keys: Sequence[str]) -> _Plan[tuple[list[dict], list[list[int]]]]:
        by_shard: dict[int, list[int]] = {}  # shard -> positions in `keys`
        for pos, key in enumerate(keys):
            by_shard.setdefault(self.shard_of(key), []).append(pos)
        order = list(by_shard)
        replies = yield [self.shards[i].get.remote([keys[p] for p in by_shard[i]]) for i in order]
        missing = {k for r in replies for k in r.get("missing", ())}
        if missing:
            raise PayloadMissing([k for k in dict.fromkeys(keys) if k in missing])
        return [r["fields"] for r in replies], [by_shard[i] for i in order]

    def _get_plan(self, keys: Sequence[str]) -> _Plan[TensorDict]:
        replies, positions = yield from self._fetch_plan(keys)
        return _stack_padded(replies, positions, len(keys))

    def _get_list_plan(self, keys: Sequence[str]) -> _Plan[list[dict[str, torch.Tensor]]]:
        replies, positions = yield from self._fetch_plan(keys)
        out: list[dict[str, torch.Tensor]] = [{} for _ in keys]
        with _quiet_readonly():
            for fields, shard_positions in zip(replies, positions):
                for (name, dtype), (local, shapes, flat) in fields.items():
                    offset = 0
                    for p, shape in zip(local, shapes):
                        size = math.prod(shape)
                        value = flat[offset : offset + size].reshape(shape)
                        out[shard_positions[p]][name] = unpack_tensor((dtype, value))
                        offset += size
        return out

    def _delete_plan(self, keys: Sequence[str]) -> _Plan[int]:
        by_shard: dict[int, list[str]] = {}
        for key in keys:
            by_shard.setdefault(self.shard_of(key), []).append(key)
        counts = yield [self.shards[i].delete.remote(ks) for i, ks in by_shard.items()]
        return sum(counts)

    def _stats_plan(self) -> _Plan[dict]:
        shards = yield [s.stats.remote() for s in self.shards]
        total = {k: sum(s[k] for s in shards) for k in ("items", "bytes", "capacity_items", "capacity_bytes")}
        return {**total, "shards": shards}

    # -- async API -------------------------------------------------------------------------------------------

    async def put(self, key: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Store one trajectory's tensors under key (replacing what the key held). Raises TransferQueueFull."""
        await _run_async(self._put_plan({key: tensors}))

    async def put_many(self, items: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Store several keys with one call per shard; all or nothing. Raises TransferQueueFull."""
        await _run_async(self._put_plan(items))

    async def get(self, keys: Sequence[str]) -> TensorDict:
        """TensorDict of batch_size [len(keys)] in the order of keys; each field stacked, right-padded with 0
        along its last dim. Raises PayloadMissing naming the keys that are not stored."""
        return await _run_async(self._get_plan(keys))

    async def get_list(self, keys: Sequence[str]) -> list[dict[str, torch.Tensor]]:
        """The stored tensors of each key, unpadded, in the order of keys (read-only views). Raises PayloadMissing."""
        return await _run_async(self._get_list_plan(keys))

    async def delete(self, keys: Sequence[str]) -> int:
        """Drop keys and free their memory; returns how many were stored. Unknown keys are ignored."""
        return await _run_async(self._delete_plan(keys))

    async def stats(self) -> dict:
        """items, bytes, capacity_items, capacity_bytes over all shards, and `shards`: each shard's counters."""
        return await _run_async(self._stats_plan())

    # -- sync twins (same plans, driven with ray.get) --------------------------------------------------------

    def put_sync(self, key: str, tensors: Mapping[str, torch.Tensor]) -> None:
        _run_sync(self._put_plan({key: tensors}))

    def put_many_sync(self, items: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        _run_sync(self._put_plan(items))

    def get_sync(self, keys: Sequence[str]) -> TensorDict:
        return _run_sync(self._get_plan(keys))

    def get_list_sync(self, keys: Sequence[str]) -> list[dict[str, torch.Tensor]]:
        return _run_sync(self._get_list_plan(keys))

    def delete_sync(self, keys: Sequence[str]) -> int:
        return _run_sync(self._delete_plan(keys))

    def stats_sync(self) -> dict:
        return _run_sync(self._stats_plan())


def _stack_padded(replies: list[dict], positions: list[list[int]], num_keys: int) -> TensorDict:
    """Assemble the shards' flat per-field arrays into [num_keys, *lead, max_len] tensors, zero right-padded."""
    fields: dict[str, list[tuple[list[int], torch.Tensor, list[tuple[int, ...]]]]] = {}
    dtypes: dict[str, str] = {}
    with _quiet_readonly():
        for shard_fields, shard_positions in zip(replies, positions):
            for (name, dtype), (local, shapes, flat) in shard_fields.items():
                if dtypes.setdefault(name, dtype) != dtype:
                    raise TransferQueueError(f"field {name!r} has dtypes {dtypes[name]} and {dtype} across keys")
                global_pos = [shard_positions[p] for p in local]
                fields.setdefault(name, []).append((global_pos, torch.from_numpy(flat), shapes))
    out: dict[str, torch.Tensor] = {}
    for name, parts in fields.items():
        shapes = [s for _, _, ss in parts for s in ss]
        if len(shapes) != num_keys:
            raise TransferQueueError(f"field {name!r} is stored for {len(shapes)} of the {num_keys} keys")
        scalar = shapes[0] == ()
        lead = shapes[0][:-1]
        if any((s == ()) != scalar or s[:-1] != lead for s in shapes):
            raise TransferQueueError(f"field {name!r}: shapes {sorted(set(shapes))} differ before the last dim")
        if len(parts) == 1 and all(s == shapes[0] for s in shapes) and parts[0][0] == list(range(num_keys)):
            # One shard, equal shapes, in order: a plain copy. Always a copy: the reply lives in (read-only) shared
            # memory, and a training batch gets modified in place.
            stacked = parts[0][1].view(num_keys, *shapes[0]).clone()
        elif scalar:
            stacked = torch.empty(num_keys, dtype=parts[0][1].dtype)
            for global_pos, flat, _ in parts:
                stacked[torch.tensor(global_pos)] = flat
        else:
            max_len = max(s[-1] for s in shapes)
            stacked = torch.zeros((num_keys, *lead, max_len), dtype=parts[0][1].dtype)
            for global_pos, flat, ss in parts:
                idx = torch.tensor(global_pos)
                if all(s == ss[0] for s in ss):
                    stacked[idx, ..., : ss[0][-1]] = flat.view(len(ss), *ss[0])
                    continue
                lengths = torch.tensor([s[-1] for s in ss]).repeat_interleave(math.prod(lead))  # one per row
                width = int(lengths.max())
                rows = torch.zeros((len(lengths), width), dtype=flat.dtype)
                rows[torch.arange(width) < lengths[:, None]] = flat  # rows are key-major, like flat
                stacked[idx, ..., :width] = rows.view(len(ss), *lead, width)
        want = getattr(torch, dtypes[name])
        out[name] = stacked if stacked.dtype == want else stacked.view(want)
    return TensorDict(out, batch_size=[num_keys])


# ---------------------------------------------------------------------------------------------------------------
# weights


@dataclass(frozen=True)
class WeightsInfo:
    """What the weight store holds for one version; mirrors the fields of wire.WeightsPublished."""

    version: int
    num_bytes: int
    checksum: str
    num_tensors: int
    dtype: str  # dtype holding most of the bytes
    store: str  # name of the weight-store actor


def _digest(item: tuple[str, Packed]) -> bytes:
    name, (dtype, arr) = item
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{name}\0{dtype}\0{tuple(arr.shape)}\0".encode())
    h.update(memoryview(np.ascontiguousarray(arr)).cast("B"))
    return h.digest()


def _checksum_packed(packed: Mapping[str, Packed]) -> str:
    items = sorted(packed.items())
    total = sum(a.nbytes for _, a in packed.values())
    # Per-tensor digests in name order, combined: deterministic, and parallel (hashlib drops the GIL) when large.
    if total > 64 * 1024**2:
        with ThreadPoolExecutor(max_workers=4) as pool:
            digests = list(pool.map(_digest, items))
    else:
        digests = [_digest(i) for i in items]
    return hashlib.blake2b(b"".join(digests), digest_size=16).hexdigest()


def state_dict_checksum(sd: Mapping[str, torch.Tensor]) -> str:
    """blake2b over names, dtypes, shapes and bytes in name order; equal state dicts give equal checksums."""
    return _checksum_packed({k: pack_tensor(v) for k, v in sd.items()})


class _WeightStore:
    """Keeps the newest `keep` versions; each is one object the actor ray.put itself, so the actor owns it."""

    def __init__(self, keep: int, name: str):
        self.keep = keep
        self.name = name
        self.versions: dict[int, tuple[list[ray.ObjectRef], WeightsInfo]] = {}

    def put(self, version: int, packed: dict[str, Packed], info: WeightsInfo) -> list[int]:
        # ray.put copies out of the call's argument buffer (owned by the trainer) into an object this actor owns.
        self.versions[version] = ([ray.put(packed)], info)
        evicted = sorted(self.versions)[: -self.keep]
        for v in evicted:
            del self.versions[v]
        return evicted

    def get(self, version: int | None) -> tuple[list[ray.ObjectRef], WeightsInfo] | list[int]:
        """([ref], info), or the versions held when `version` is not. The ref travels inside a list so that Ray
        hands the caller the reference (to fetch zero-copy) instead of resolving it here."""
        if version is None and self.versions:
            version = max(self.versions)
        held = self.versions.get(version) if version is not None else None
        return held if held is not None else sorted(self.versions)

    def list_versions(self) -> list[int]:
        return sorted(self.versions)


_WeightStoreActor = ray.remote(num_cpus=0, max_restarts=-1)(_WeightStore)


class WeightStore:
    """Client of a run's weight-store actor: the trainer puts versions, producers get them."""

    def __init__(self, run: str, actor: ray.actor.ActorHandle, name: str):
        self.run = run
        self.actor = actor
        self.name = name

    @classmethod
    def connect(cls, run: str, cfg: RayConfig) -> WeightStore:
        ensure_ray(cfg)
        name = _actor_name(run, "weights")
        actor = _WeightStoreActor.options(
            name=name, namespace=cfg.namespace, lifetime="detached", get_if_exists=True
        ).remote(cfg.weight_versions_kept, name)
        ray.get(actor.list_versions.remote())
        return cls(run, actor, name)

    def _put_plan(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> _Plan[WeightsInfo]:
        packed = {k: pack_tensor(v) for k, v in state_dict.items()}
        by_dtype: dict[str, int] = {}
        for dtype, arr in packed.values():
            by_dtype[dtype] = by_dtype.get(dtype, 0) + arr.nbytes
        info = WeightsInfo(
            version=version,
            num_bytes=sum(by_dtype.values()),
            checksum=_checksum_packed(packed),
            num_tensors=len(packed),
            dtype=max(by_dtype, key=by_dtype.__getitem__) if by_dtype else "float32",
            store=self.name,
        )
        yield [self.actor.put.remote(version, packed, info)]
        return info

    def _get_plan(self, version: int | None, verify: bool) -> _Plan[dict[str, torch.Tensor]]:
        (reply,) = yield [self.actor.get.remote(version)]
        if isinstance(reply, list):
            want = "any version" if version is None else f"version {version}"
            raise WeightsMissing(f"weight store {self.name!r} does not hold {want}; it holds {reply}")
        (ref,), info = reply
        (packed,) = yield [ref]
        if verify and _checksum_packed(packed) != info.checksum:
            raise TransferQueueError(f"weights version {info.version} do not match their checksum {info.checksum}")
        with _quiet_readonly():
            return {k: unpack_tensor(p) for k, p in packed.items()}

    def _info_plan(self, version: int | None) -> _Plan[WeightsInfo]:
        (reply,) = yield [self.actor.get.remote(version)]
        if isinstance(reply, list):
            raise WeightsMissing(f"weight store {self.name!r} does not hold version {version}; it holds {reply}")
        return reply[1]

    def _versions_plan(self) -> _Plan[list[int]]:
        (versions,) = yield [self.actor.list_versions.remote()]
        return versions

    async def put(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> WeightsInfo:
        """Store a full state dict as `version` (evicting versions beyond weight_versions_kept)."""
        return await _run_async(self._put_plan(version, state_dict))

    async def get(self, version: int | None = None, verify: bool = False) -> dict[str, torch.Tensor]:
        """The state dict of `version` (None = newest) as read-only tensors; verify=True re-checks the checksum.
        Raises WeightsMissing."""
        return await _run_async(self._get_plan(version, verify))

    async def info(self, version: int | None = None) -> WeightsInfo:
        return await _run_async(self._info_plan(version))

    async def versions(self) -> list[int]:
        return await _run_async(self._versions_plan())

    def put_sync(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> WeightsInfo:
        return _run_sync(self._put_plan(version, state_dict))

    def get_sync(self, version: int | None = None, verify: bool = False) -> dict[str, torch.Tensor]:
        return _run_sync(self._get_plan(version, verify))

    def info_sync(self, version: int | None = None) -> WeightsInfo:
        return _run_sync(self._info_plan(version))

    def versions_sync(self) -> list[int]:
        return _run_sync(self._versions_plan())


def teardown(run: str, cfg: RayConfig) -> list[str]:
    """Kill the run's named actors (TransferQueue shards of any count, weight store); returns their names."""
    ensure_ray(cfg)
    names = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == cfg.namespace
        and (a["name"] == _actor_name(run, "weights") or a["name"].startswith(_actor_name(run, "tq-")))
    ]
    for name in names:
        ray.kill(ray.get_actor(name, namespace=cfg.namespace), no_restart=True)
    return names
