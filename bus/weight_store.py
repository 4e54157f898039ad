"""The weight store: the run's policy weights by version, held by one named, detached Ray actor.

    ws = WeightStore.connect("quickstart", cfg.ray)
    info = await ws.put(3, model.state_dict())                       # trainer: returns size and checksum
    state_dict = await ws.get(3, expect=announced.checksum)          # producer: raises WeightsChecksumMismatch

The trainer ray.put's a version (the one copy a publish makes) and hands the store actor the reference: the store
keeps and hands out the trainer's own object. Every producer on a node maps that same object-store copy (weights are
large and read by many); an HF engine reads it in place. The versions die with the trainer that made them, which
loses nothing: a restarted trainer resumes from its checkpoint, publishes that version again, and the dead one's
later versions were rolled back with it. A fetch of a lost version raises WeightsLost. Before it exits, the trainer
has the store copy the last version into an object of its own (`flush`), for readers after the run (the
evaluator's last score). Hashing and sending run in a worker thread, off the caller's event loop.
The actor keeps the `ray.weight_versions_kept` versions put last (a resumed trainer's lower version included). A
version's checksum is BLAKE3 over names, dtypes, shapes and bytes (`state_dict_checksum`); `check_checksum` is the
one place that compares a state dict with the digest it should have, and its error carries the version, the
expected and the actual digest. State dicts handed out by `get` are read-only views (load_state_dict and ops that
produce new tensors are fine).

    .venv/bin/python -m pytest -q tests/integration/test_transfer_queue.py
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import blake3
import numpy as np
import ray
import torch

from rlbus.bus.actors import WeightsInfo, WeightVersions, remote_class
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
from rlbus.schemas.errors import WeightsChecksumMismatch, WeightsLost, WeightsMissing

log = logging.getLogger("rlbus.weight_store")


def _checksum_packed(packed: Mapping[str, Packed]) -> str:
    """BLAKE3 over each tensor's name, dtype, shape and bytes, in name order (16-byte digest, hex).

    BLAKE3 rather than blake2b: a cryptographic hash (a forged announcement cannot be matched) that runs at memory
    speed on SIMD and several threads, with the GIL released; blake2b's ~1 GB/s made hashing, not copying, the cost
    of moving a 0.5 GB state dict.
    """
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    for name, (dtype, arr) in sorted(packed.items()):
        h.update(f"{name}\0{dtype}\0{tuple(arr.shape)}\0".encode())
        h.update(memoryview(np.ascontiguousarray(arr)).cast("B"))
    return h.hexdigest(length=16)


def state_dict_checksum(sd: Mapping[str, torch.Tensor]) -> str:
    """blake2b over names, dtypes, shapes and bytes in name order; equal state dicts give equal checksums."""
    return _checksum_packed({k: pack_tensor(v) for k, v in sd.items()})


def check_checksum(version: int, packed: Mapping[str, Packed], expected: str) -> None:
    """Raise WeightsChecksumMismatch unless the packed state dict of `version` has the digest `expected`."""
    actual = _checksum_packed(packed)
    if actual != expected:
        raise WeightsChecksumMismatch(version, expected=expected, actual=actual)


def weight_store_actor() -> Any:
    """The store's actor class (bus/actors.py `remote_class`: made on first use, not at import)."""
    return remote_class(WeightVersions, num_cpus=0, max_restarts=-1, max_concurrency=4)


class WeightStore:
    """Client of a run's weight-store actor: the trainer puts versions, producers get them."""

    def __init__(self, run: str, actor: ray.actor.ActorHandle, name: str):
        self.run = run
        self.actor = actor
        self.name = name
        self._last: int | None = None  # the version this client put last

    @classmethod
    def connect(cls, run: str, cfg: RayConfig, *, what: str = "weights") -> WeightStore:
        """The run's store of full versions, or (`what="deltas"`) of the deltas between them
        (trainer.weight_sync.encoding: delta), one actor each."""
        ensure_ray(cfg)
        name = actor_name(run, what)
        actor = weight_store_actor().options(
            name=name, namespace=cfg.namespace, lifetime="detached", get_if_exists=True
        ).remote(cfg.weight_versions_kept, name)
        store = cls(run, actor, name)
        store.versions_sync()  # the actor is up (or, restarting, comes back within the retry budget)
        return store

    def _put_plan(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> Plan[WeightsInfo]:
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
        ref = ray.put(packed)  # the one copy of a publish; the store hands out this object of ours
        # A put may run twice (the store restarting when called): a re-put of a version replaces it.
        yield from retried(lambda: [self.actor.put.remote(version, [ref], info)], f"weight store {self.name} put")
        self._last = version
        return info

    def _fetch_plan(self, version: int | None) -> Plan[tuple[WeightsInfo, dict[str, Packed]]]:
        (reply,) = yield from self._get_reply(version)
        if isinstance(reply, list):
            want = "any version" if version is None else f"version {version}"
            raise WeightsMissing(f"weight store {self.name!r} does not hold {want}; it holds {reply}")
        (ref,), info = reply
        try:
            (packed,) = yield [ref]
        except ray.exceptions.ObjectLostError as e:  # its publisher died (and did not flush it)
            raise WeightsLost(f"weight store {self.name!r}: version {info.version} was lost with the trainer that "
                              f"published it ({type(e).__name__}); a restarted trainer publishes again") from e
        return info, packed

    def _get_reply(self, version: int | None) -> Plan[list[tuple[list[ray.ObjectRef], WeightsInfo] | list[int]]]:
        return (yield from retried(lambda: [self.actor.get.remote(version)], f"weight store {self.name} get"))

    def _info_plan(self, version: int | None) -> Plan[WeightsInfo]:
        (reply,) = yield from self._get_reply(version)
        if isinstance(reply, list):
            raise WeightsMissing(f"weight store {self.name!r} does not hold version {version}; it holds {reply}")
        return reply[1]

    def _versions_plan(self) -> Plan[list[int]]:
        (versions,) = yield from retried(lambda: [self.actor.list_versions.remote()],
                                         f"weight store {self.name} versions")
        return versions

    def _adopt_plan(self) -> Plan[bool]:
        if self._last is None:
            return False
        version = self._last
        # Adopting twice is harmless (the second finds the version already its own).
        (adopted,) = yield from retried(lambda: [self.actor.adopt.remote(version)], f"weight store {self.name} adopt")
        return adopted

    async def put(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> WeightsInfo:
        """Store a full state dict as `version` (evicting versions beyond weight_versions_kept); returns once the
        store holds it. Hashing and copying run in a worker thread: the caller's event loop stays free (the
        trainer's keeps acks and the recorder going while a large state dict is published)."""
        return await asyncio.to_thread(self.put_sync, version, state_dict)

    async def get(self, version: int | None = None, *, expect: str | None = None,
                  verify: bool = False) -> dict[str, torch.Tensor]:
        """The state dict of `version` (None = the one put last) as read-only tensors. Raises WeightsMissing.

        `expect` is the checksum the caller was told (WeightsPublished.checksum); `verify` checks against the
        store's own record. Either way a mismatch raises WeightsChecksumMismatch; hashing runs in a thread, so
        the caller's event loop stays free.
        """
        info, packed = await run_async(self._fetch_plan(version))
        expected = expect if expect is not None else info.checksum if verify else None
        if expected is not None:
            await asyncio.to_thread(check_checksum, info.version, packed, expected)
        return _unpack(packed)

    async def info(self, version: int | None = None) -> WeightsInfo:
        return await run_async(self._info_plan(version))

    async def versions(self) -> list[int]:
        return await run_async(self._versions_plan())

    def put_sync(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> WeightsInfo:
        return run_sync(self._put_plan(version, state_dict))

    async def flush(self) -> bool:
        """Have the store copy the version this client put last into an object of its own, which outlives this
        process (the trainer flushes before it exits). False if there was nothing to copy."""
        return await run_async(self._adopt_plan())

    def flush_sync(self) -> bool:
        return run_sync(self._adopt_plan())

    def get_sync(self, version: int | None = None, *, expect: str | None = None,
                 verify: bool = False) -> dict[str, torch.Tensor]:
        info, packed = run_sync(self._fetch_plan(version))
        expected = expect if expect is not None else info.checksum if verify else None
        if expected is not None:
            check_checksum(info.version, packed, expected)
        return _unpack(packed)

    def info_sync(self, version: int | None = None) -> WeightsInfo:
        return run_sync(self._info_plan(version))

    def versions_sync(self) -> list[int]:
        return run_sync(self._versions_plan())


def _unpack(packed: Mapping[str, Packed]) -> dict[str, torch.Tensor]:
    with quiet_readonly():
        return {k: unpack_tensor(p) for k, p in packed.items()}
