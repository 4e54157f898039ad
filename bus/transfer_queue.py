"""The TransferQueue: trajectory tensors stored by the run's named, detached Ray shard actors.

    tq = TransferQueue.connect("quickstart", cfg.ray)           # creates or attaches to the run's shard actors
    await tq.put_many({"g7/0": {"prompt_ids": ids_P, ...}, ...})  # producer; then publish the keys on NATS
    tensors = await tq.get_list(["g7/0", "g7/1"])                # trainer ranks: each key's unpadded tensors
    await tq.delete(["g7/0", "g7/1"])                            # after the step that used them is durable
    await tq.delete([], owners=["g7"])                           # every key under g7/ (each shard is asked)

Every async method has a `*_sync` twin with the same arguments for synchronous code (trainer ranks); both run the
same plan (bus/ray_store.py).

Ownership. Ray frees an object when its owner -- the process that ray.put it -- dies. A producer may exit (or be
SIGKILLed) right after `put`, so the shards keep trajectory tensors in their own memory (copied out of the call's
argument buffer). A put is one actor call per shard carrying the whole batch, and a get returns, per field, one
flat array of the requested keys: a handful of large zero-copy buffers instead of thousands of small Ray objects
(bench/transfer_queue.py measures this against raw ray.put/ray.get of one object per trajectory). Tensors handed
out by get_list may share read-only shared memory: treat them as read-only. The trainer turns them into its batch
with consumers/collate.py.

Owners. A key's first path component is its owner (`g7` for `g7/d2/0`; producers use the task id). Deleting by
owner frees every key under it, including keys no message names: those of a producer that died between its put and
its publish, which nobody could otherwise find. The trainer drops a task's owner once the task is trained or given up.

Capacity (cfg.capacity_items / capacity_bytes) is split evenly over the shards; a put that would exceed its shard's
share raises TransferQueueFull and stores nothing. A put_many spanning shards is staged on each shard first and
committed only when every shard accepted it, so a rejected batch leaves nothing behind.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from rlbus.bus.actors import Shard, remote_class
from rlbus.bus.ray_cluster import ensure_ray
from rlbus.bus.ray_store import (
    Packed,
    Plan,
    actor_name,
    pack_tensor,
    quiet_readonly,
    retried,
    run_async,
    run_sync,
    unpack_tensor,
)
from rlbus.schemas.config import RayConfig
from rlbus.schemas.errors import PayloadMissing, TransferQueueFull

log = logging.getLogger("rlbus.transfer_queue")


def shard_of(key: str, num_shards: int) -> int:
    """Stable across processes and machines (Python's hash() is salted per process)."""
    return zlib.crc32(key.encode()) % num_shards


def _make_shard(run: str, cfg: RayConfig, i: int, placement: Any) -> ray.actor.ActorHandle:
    n = cfg.num_storage_actors
    # The shard count is part of the name: a client with another count would map keys to other shards.
    return remote_class(Shard, num_cpus=0, max_restarts=-1).options(
        name=actor_name(run, f"tq-{i}-of-{n}"),
        namespace=cfg.namespace,
        lifetime="detached",
        get_if_exists=True,
        scheduling_strategy=placement,
    ).remote(i, math.ceil(cfg.capacity_items / n), math.ceil(cfg.capacity_bytes / n))


def _spread_over_nodes(n: int) -> list[Any]:
    """Where each of n new shards goes: round-robin over the cluster's live nodes, so the tensors of a run are not
    all lost with one machine and puts and gets use every node's object store. (Ray's "SPREAD" and soft node
    affinity are best effort, and put both shards of a two-node cluster on one node here.) A node's death kills its
    shard for good; `TransferQueue._revive` makes it again elsewhere."""
    nodes = sorted((node["NodeManagerAddress"], node["NodeID"]) for node in ray.nodes() if node["Alive"])
    if len(nodes) < 2:
        return ["DEFAULT"] * n
    return [NodeAffinitySchedulingStrategy(node_id=nodes[i % len(nodes)][1], soft=False) for i in range(n)]


class TransferQueue:
    """Client of one run's shard actors. Cheap to create; any number of processes may hold one."""

    run: str
    shards: list[ray.actor.ActorHandle]
    _cfg: RayConfig  # for making a shard again (revive)

    def __init__(self, run: str, shards: list[ray.actor.ActorHandle], cfg: RayConfig):
        self.run = run
        self.shards = shards
        self._cfg = cfg

    @classmethod
    def connect(cls, run: str, cfg: RayConfig) -> TransferQueue:
        """Create the run's shard actors, or attach to them if another process already did (blocks until ready).

        Initialises Ray with `cfg` if this process has not yet. Capacities are fixed by whoever creates the actors.
        """
        ensure_ray(cfg)
        placement = _spread_over_nodes(cfg.num_storage_actors)
        shards = [_make_shard(run, cfg, i, placement[i]) for i in range(cfg.num_storage_actors)]
        ray.get([s.stats.remote() for s in shards])
        return cls(run, shards, cfg)

    def _revive(self) -> int:
        """Make again, empty and wherever Ray has room, every shard that died for good (its node is gone: a shard
        placed on a node is not restarted elsewhere); a shard another client already made again is attached to.
        Returns how many handles changed."""
        changed = 0
        for i, old in enumerate(self.shards):
            name = actor_name(self.run, f"tq-{i}-of-{len(self.shards)}")
            try:
                handle = ray.get_actor(name, namespace=self._cfg.namespace)
            except ValueError:  # no live actor holds the name any more
                handle = _make_shard(self.run, self._cfg, i, "DEFAULT")
            if handle._actor_id != old._actor_id:
                self.shards[i] = handle
                changed += 1
        if changed:
            log.warning("TransferQueue %s: %d shard(s) made again after their node died; what they held is lost",
                        self.run, changed)
        return changed

    def shard_of(self, key: str) -> int:
        return shard_of(key, len(self.shards))

    # -- plans -----------------------------------------------------------------------------------------------

    def _put_plan(self, items: Mapping[str, Mapping[str, torch.Tensor]]) -> Plan[None]:
        by_shard: dict[int, dict[str, dict[str, Packed]]] = {}
        for key, fields in items.items():
            by_shard.setdefault(self.shard_of(key), {})[key] = {f: pack_tensor(t) for f, t in fields.items()}
        if not by_shard:
            return
        # One shard: its put is atomic by itself. Several: stage everywhere, commit only if all accepted.
        txn = uuid.uuid4().hex if len(by_shard) > 1 else None
        order = list(by_shard)
        # A put may run twice (a shard restarting when called): it replaces the key, and a txn is staged again.
        rejections = yield from retried(lambda: [self.shards[i].put.remote(by_shard[i], txn) for i in order],
                                        f"TransferQueue {self.run} put", revive=self._revive)
        if txn is not None:
            commit = all(r is None for r in rejections)
            accepted = [i for i, r in zip(order, rejections) if r is None]
            yield from retried(lambda: [self.shards[i].finish.remote(txn, commit) for i in accepted],
                               f"TransferQueue {self.run} commit", revive=self._revive)
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

    def _fetch_plan(self, keys: Sequence[str]) -> Plan[tuple[list[dict], list[list[int]]]]:
        by_shard: dict[int, list[int]] = {}  # shard -> positions in `keys`
        for pos, key in enumerate(keys):
            by_shard.setdefault(self.shard_of(key), []).append(pos)
        order = list(by_shard)
        try:
            replies = yield from retried(
                lambda: [self.shards[i].get.remote([keys[p] for p in by_shard[i]]) for i in order],
                f"TransferQueue {self.run} get", revive=self._revive)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnschedulableError) as e:
            # A shard that died (or is being restarted empty by Ray) took its tensors with it: for the caller that
            # is a missing payload, whose prompts are re-issued, not a crash.
            raise PayloadMissing(list(dict.fromkeys(keys))) from e
        missing = {k for r in replies for k in r.get("missing", ())}
        if missing:
            raise PayloadMissing([k for k in dict.fromkeys(keys) if k in missing])
        return [r["fields"] for r in replies], [by_shard[i] for i in order]

    def _get_list_plan(self, keys: Sequence[str]) -> Plan[list[dict[str, torch.Tensor]]]:
        replies, positions = yield from self._fetch_plan(keys)
        out: list[dict[str, torch.Tensor]] = [{} for _ in keys]
        with quiet_readonly():
            for fields, shard_positions in zip(replies, positions):
                for (name, dtype), (local, shapes, flat) in fields.items():
                    offset = 0
                    for p, shape in zip(local, shapes):
                        size = math.prod(shape)
                        value = flat[offset : offset + size].reshape(shape)
                        out[shard_positions[p]][name] = unpack_tensor((dtype, value))
                        offset += size
        return out

    def _delete_plan(self, keys: Sequence[str], owners: Sequence[str] = ()) -> Plan[int]:
        by_shard: dict[int, list[str]] = {i: [] for i in range(len(self.shards))} if owners else {}
        for key in keys:
            by_shard.setdefault(self.shard_of(key), []).append(key)
        owners = list(owners)
        try:
            counts = yield from retried(lambda: [self.shards[i].delete.remote(ks, owners)
                                                 for i, ks in by_shard.items()],
                                        f"TransferQueue {self.run} delete", revive=self._revive)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnschedulableError) as e:
            # A dead shard's memory is gone with it: nothing left to free there.
            log.warning("TransferQueue %s: a shard is down (%s); its keys are gone with it", self.run, e)
            return 0
        return sum(counts)

    def _stats_plan(self) -> Plan[dict]:
        shards = yield from retried(lambda: [s.stats.remote() for s in self.shards], f"TransferQueue {self.run} stats", revive=self._revive)
        total = {k: sum(s[k] for s in shards) for k in ("items", "bytes", "capacity_items", "capacity_bytes")}
        return {**total, "shards": shards}

    def _missing_plan(self, keys: Sequence[str]) -> Plan[tuple[list[str], float]]:
        by_shard: dict[int, list[str]] = {}
        for key in keys:
            by_shard.setdefault(self.shard_of(key), []).append(key)
        try:
            replies = yield from retried(lambda: [self.shards[i].missing.remote(ks) for i, ks in by_shard.items()],
                                         f"TransferQueue {self.run} missing", revive=self._revive)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnschedulableError):
            return list(keys), time.time()  # a shard down now: whatever it held is lost
        lost = {k for r in replies for k in r["missing"]}
        return [k for k in keys if k in lost], max((r["started_at"] for r in replies), default=0.0)

    # -- async API -------------------------------------------------------------------------------------------

    async def put(self, key: str, tensors: Mapping[str, torch.Tensor]) -> None:
        """Store one trajectory's tensors under key (replacing what the key held). Raises TransferQueueFull."""
        await run_async(self._put_plan({key: tensors}))

    async def put_many(self, items: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        """Store several keys with one call per shard; all or nothing. Raises TransferQueueFull."""
        await run_async(self._put_plan(items))

    async def get_list(self, keys: Sequence[str]) -> list[dict[str, torch.Tensor]]:
        """The stored tensors of each key, unpadded, in the order of keys (read-only views). Raises PayloadMissing."""
        return await run_async(self._get_list_plan(keys))

    async def delete(self, keys: Sequence[str], owners: Sequence[str] = ()) -> int:
        """Drop keys, and every key under each of `owners`, and free their memory; returns how many were stored.
        Unknown keys and owners are ignored."""
        return await run_async(self._delete_plan(keys, owners))

    async def missing(self, keys: Sequence[str]) -> tuple[list[str], float]:
        """Which of `keys` are not stored (their tensors are not read), and the Unix time since which their shards
        have run without a restart (the latest start among them): a key missing there was put before that moment and
        lost, or never put at all."""
        return await run_async(self._missing_plan(keys))

    async def stats(self) -> dict:
        """items, bytes, capacity_items, capacity_bytes over all shards, and `shards`: each shard's counters."""
        return await run_async(self._stats_plan())

    # -- sync twins (same plans, driven with ray.get) --------------------------------------------------------

    def put_sync(self, key: str, tensors: Mapping[str, torch.Tensor]) -> None:
        run_sync(self._put_plan({key: tensors}))

    def put_many_sync(self, items: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
        run_sync(self._put_plan(items))

    def get_list_sync(self, keys: Sequence[str]) -> list[dict[str, torch.Tensor]]:
        return run_sync(self._get_list_plan(keys))

    def delete_sync(self, keys: Sequence[str], owners: Sequence[str] = ()) -> int:
        return run_sync(self._delete_plan(keys, owners))

    def stats_sync(self) -> dict:
        return run_sync(self._stats_plan())
