"""The TransferQueue and WeightStore against a real local Ray (one head per session, tests/support/ray_cluster.py).

    .venv/bin/python -m pytest -q tests/integration/test_transfer_queue.py
"""

from __future__ import annotations

import asyncio
import select
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest
import ray
import torch

from rlbus.bus.ray_store import teardown
from rlbus.bus.transfer_queue import TransferQueue, shard_of
from rlbus.bus.weight_store import WeightStore, state_dict_checksum
from rlbus.schemas.errors import (
    PayloadMissing,
    TransferQueueFull,
    WeightsChecksumMismatch,
    WeightsLost,
    WeightsMissing,
)
from tests.support.loop_gaps import loop_gaps

torch.set_num_threads(1)


def _traj(length: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, 1000, (length,), generator=g),
        "response_mask": torch.ones(length, dtype=torch.bool),
        "logprobs": torch.randn(length, generator=g),
        "topk": torch.randn(2, length, generator=g).to(torch.bfloat16),  # lead dim + a dtype numpy lacks
        "reward": torch.tensor(float(seed)),  # 0-d
    }


async def test_round_trip_keeps_order_shapes_and_dtypes(ray_config, run_name):
    tq = TransferQueue.connect(run_name, ray_config)
    lengths = {"g/0": 5, "g/1": 2, "g/2": 7, "g/3": 1}
    stored = {k: _traj(n, i) for i, (k, n) in enumerate(lengths.items())}
    await tq.put_many(stored)

    keys = ["g/2", "g/0", "g/3", "g/1"]  # across both shards, out of put order
    got = await tq.get_list(keys)
    assert [item.keys() for item in got] == [stored[k].keys() for k in keys]
    for key, item in zip(keys, got):
        for name, want in stored[key].items():
            assert item[name].dtype == want.dtype and item[name].shape == want.shape, (key, name)
            assert torch.equal(item[name], want), (key, name)
    assert got[0]["topk"].dtype == torch.bfloat16 and got[0]["response_mask"].dtype == torch.bool
    assert got[0]["reward"].dim() == 0
    synced = tq.get_list_sync(keys)
    assert all(torch.equal(a[f], b[f]) for a, b in zip(got, synced) for f in a)


async def test_reput_replaces_and_counts_once(ray_config, run_name):
    tq = TransferQueue.connect(run_name, ray_config)
    await tq.put("k", {"x": torch.zeros(100, dtype=torch.int64)})
    await tq.put("k", {"x": torch.ones(10, dtype=torch.int64)})  # a retried put
    stats = await tq.stats()
    assert (stats["items"], stats["bytes"]) == (1, 80)
    assert torch.equal((await tq.get_list(["k"]))[0]["x"], torch.ones(10, dtype=torch.int64))


_PRODUCER = textwrap.dedent(
    """
    import os, sys, time, torch
    from rlbus.schemas.config import RayConfig
    from rlbus.bus.transfer_queue import TransferQueue
    from rlbus.bus.weight_store import WeightStore
    address, namespace, run, mode = sys.argv[1:5]
    cfg = RayConfig(address=address, namespace=namespace, num_storage_actors=2,
                    capacity_items=16, capacity_bytes=128 * 1024, weight_versions_kept=2)
    TransferQueue.connect(run, cfg).put_many_sync(
        {f"sub/{i}": {"ids": torch.arange(50) + i} for i in range(4)})
    ws = WeightStore.connect(run, cfg)
    ws.put_sync(7, {"w": torch.full((256, 256), 7.0)})  # 256 KiB: in the object store, not inlined
    if mode != "lose":
        assert ws.flush_sync()  # the store's own copy (what the trainer makes of its last version at exit)
    print("stored", flush=True)
    if mode in ("hang", "lose"):
        time.sleep(600)  # the test SIGKILLs us here
    """
)


async def _producer_that_dies(ray_config, run: str, ray_env, mode: str, while_alive=None) -> int:
    """Run _PRODUCER (it stores, then exits or waits), `await while_alive()` once it has stored, SIGKILL it unless
    it exits by itself; returns its exit code."""
    args = [sys.executable, "-c", _PRODUCER, ray_config.address, ray_config.namespace, run, mode]
    with tempfile.TemporaryFile("w+") as err:  # a file, not a pipe: Ray's warnings cannot fill it and block it
        proc = subprocess.Popen(args, env=ray_env, stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            deadline, seen = time.monotonic() + 120, []
            while not seen or seen[-1] != "stored":  # Ray may print warnings on stdout first
                ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
                line = proc.stdout.readline() if ready else ""
                if not line:
                    err.seek(0)
                    raise AssertionError(f"rc {proc.poll()}, stdout {seen}:\n{err.read()[-3000:]}")
                seen.append(line.strip())
            if while_alive is not None:
                await while_alive()
            if mode != "exit":
                proc.send_signal(signal.SIGKILL)
            return proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.parametrize("how", ["exit", "sigkill"])
async def test_tensors_put_by_a_dead_producer_survive(ray_config, run_name, ray_env, how):
    code = await _producer_that_dies(ray_config, run_name, ray_env, "hang" if how == "sigkill" else "exit")
    assert code == (-signal.SIGKILL if how == "sigkill" else 0)

    tq = TransferQueue.connect(run_name, ray_config)
    got = await tq.get_list([f"sub/{i}" for i in range(4)])
    assert all(torch.equal(item["ids"], torch.arange(50) + i) for i, item in enumerate(got))
    weights = await WeightStore.connect(run_name, ray_config).get(7, verify=True)
    assert torch.equal(weights["w"], torch.full((256, 256), 7.0))
    # No message names them (the producer died before publishing): its task's owner frees them all, on every shard.
    await tq.put_many({"sub2/0": {"x": torch.zeros(4)}, "other/sub/0": {"x": torch.zeros(4)}})
    assert await tq.delete([], owners=["sub"]) == 4
    assert (await tq.stats())["items"] == 2  # an owner is the whole first component: sub2/ and other/ stay
    with pytest.raises(PayloadMissing):
        await tq.get_list(["sub/0"])


async def test_weights_lost_with_their_publisher_are_weights_lost_not_a_hang(ray_config, run_name, ray_env):
    # The store hands out the trainer's own object (one copy per publish); SIGKILLed without its exit's flush, the
    # publisher takes it along. A producer reading those weights in place keeps valid bytes while it holds them;
    # once nobody does, a fetch says the version is lost, naming it (until Ray has seen the owner die, the node's
    # copy is still served).
    ws = WeightStore.connect(run_name, ray_config)
    in_use: dict[str, torch.Tensor] = {}

    async def read_in_place() -> None:  # zero-copy views, as an HF engine with share_weights holds them
        in_use.update(await ws.get(7, verify=True))

    await _producer_that_dies(ray_config, run_name, ray_env, "lose", read_in_place)
    other = WeightStore.connect(f"{run_name}-other", ray_config)  # the object store reuses what was freed
    try:
        for v in (1, 2, 3):
            await other.put(v, {"w": torch.full((256, 256), float(v))})
    finally:
        teardown(f"{run_name}-other", ray_config)
    await asyncio.sleep(2.0)  # Ray has seen the owner die by now
    assert torch.equal(in_use["w"], torch.full((256, 256), 7.0))  # pinned by its reader: intact, not reused

    in_use.clear()  # the reader lets go
    deadline = time.monotonic() + 30
    with pytest.raises(WeightsLost, match="version 7 was lost with the trainer"):
        while time.monotonic() < deadline:
            await asyncio.wait_for(ws.get(7, verify=True), timeout=60)
            await asyncio.sleep(0.2)
    assert await ws.versions() == [7]
    await ws.put(8, {"w": torch.full((256, 256), 8.0)})  # a restarted trainer publishes again
    assert torch.equal((await ws.get(None))["w"], torch.full((256, 256), 8.0))


async def test_delete_frees_memory_and_later_gets_are_missing(ray_config, run_name):
    tq = TransferQueue.connect(run_name, ray_config)
    await tq.put_many({f"d/{i}": {"x": torch.zeros(256)} for i in range(4)})
    before = await tq.stats()
    assert (before["items"], before["bytes"]) == (4, 4 * 1024)

    assert await tq.delete(["d/0", "d/1", "never-stored"]) == 2
    after = await tq.stats()
    assert (after["items"], after["bytes"]) == (2, 2 * 1024)
    with pytest.raises(PayloadMissing) as err:
        await tq.get_list(["d/2", "d/0", "d/1"])
    assert err.value.keys == ["d/0", "d/1"]
    assert (await tq.get_list(["d/3"]))[0]["x"].shape == (256,)


async def test_exceeding_capacity_items_stores_nothing(ray_config, run_name):
    tq = TransferQueue.connect(run_name, ray_config)  # 8 items per shard
    keys = [f"c/{i}" for i in range(20)]
    assert max(sum(shard_of(k, 2) == s for k in keys) for s in (0, 1)) > 8
    assert min(sum(shard_of(k, 2) == s for k in keys) for s in (0, 1)) <= 8  # one shard accepts, then rolls back
    with pytest.raises(TransferQueueFull, match="capacity_items"):
        await tq.put_many({k: {"x": torch.zeros(4)} for k in keys})
    stats = await tq.stats()
    assert stats["items"] == 0 and stats["bytes"] == 0
    assert all(s["staged_items"] == 0 for s in stats["shards"])

    await tq.put_many({k: {"x": torch.zeros(4)} for k in keys[:6]})
    assert (await tq.stats())["items"] == 6


async def test_exceeding_capacity_bytes_raises_with_usage(ray_config, run_name):
    tq = TransferQueue.connect(run_name, ray_config)  # 64 KiB per shard
    await tq.put("small", {"x": torch.zeros(1024, dtype=torch.uint8)})
    with pytest.raises(TransferQueueFull) as err:
        await tq.put("big", {"x": torch.zeros(70 * 1024, dtype=torch.uint8)})
    message = str(err.value)
    assert "capacity_bytes" in message and str(64 * 1024) in message
    stats = await tq.stats()
    assert (stats["items"], stats["bytes"]) == (1, 1024)
    with pytest.raises(PayloadMissing):
        await tq.get_list(["big"])


async def test_keys_spread_over_shards(ray_config, run_name):
    tq = TransferQueue.connect(run_name, ray_config)
    await tq.put_many({f"group-{g}/{i}": {"x": torch.zeros(1)} for g in range(2) for i in range(4)})
    counts = [s["items"] for s in (await tq.stats())["shards"]]
    assert sum(counts) == 8 and min(counts) >= 1


def _imported(handle, module: str) -> bool:
    """Whether the process hosting a Ray actor has imported `module`."""
    return ray.get(handle.__ray_call__.remote(lambda _self: module in sys.modules))


async def test_store_actors_do_not_import_torch(ray_config, run_name):
    """The actors hold numpy arrays and references only; torch's import would be most of each one's start-up."""
    tq = TransferQueue.connect(run_name, ray_config)
    ws = WeightStore.connect(run_name, ray_config)
    await tq.put("g/0", _traj(4, 0))
    await ws.put(1, {"w": torch.ones(2, 2)})
    await ws.flush()
    assert torch.equal((await tq.get_list(["g/0"]))[0]["input_ids"], _traj(4, 0)["input_ids"])
    assert torch.equal((await ws.get(1))["w"], torch.ones(2, 2))
    for handle in (*tq.shards, ws.actor):
        assert _imported(handle, "rlbus.bus.actors") and _imported(handle, "numpy")
        assert not _imported(handle, "torch"), handle


async def test_weight_store_keeps_newest_versions(ray_config, run_name):
    ws = WeightStore.connect(run_name, ray_config)  # keeps 2
    with pytest.raises(WeightsMissing):
        await ws.get()
    infos = {}
    for version in (1, 2, 3):
        sd = {"layer.weight": torch.full((8, 8), float(version)), "layer.bias": torch.arange(8.0).bfloat16()}
        infos[version] = await ws.put(version, sd)
        assert infos[version].checksum == state_dict_checksum(sd)
    assert await ws.versions() == [2, 3]
    newest = await ws.get()
    assert torch.equal(newest["layer.weight"], torch.full((8, 8), 3.0))
    assert newest["layer.bias"].dtype == torch.bfloat16
    assert state_dict_checksum(newest) == infos[3].checksum != infos[2].checksum
    assert infos[3].num_tensors == 2 and infos[3].num_bytes == 8 * 8 * 4 + 8 * 2 and infos[3].dtype == "float32"
    with pytest.raises(WeightsMissing, match=r"\[2, 3\]"):
        await ws.get(1)
    assert torch.equal(ws.get_sync(2)["layer.weight"], torch.full((8, 8), 2.0))


async def test_weights_that_do_not_match_their_announcement_are_refused(ray_config, run_name):
    ws = WeightStore.connect(run_name, ray_config)
    info = await ws.put(5, {"w": torch.full((4, 4), 5.0)})
    forged = "0" * len(info.checksum)  # what a forged or inconsistent WeightsPublished would carry
    with pytest.raises(WeightsChecksumMismatch) as err:
        await ws.get(5, expect=forged)
    assert (err.value.version, err.value.expected, err.value.actual) == (5, forged, info.checksum)
    assert "version 5" in str(err.value) and forged in str(err.value)
    with pytest.raises(WeightsChecksumMismatch):
        ws.get_sync(5, expect=forged)
    assert torch.equal((await ws.get(5, expect=info.checksum))["w"], torch.full((4, 4), 5.0))


async def test_a_republished_lower_version_is_kept_not_evicted(ray_config, run_name):
    # A trainer resumed from the step-2 checkpoint after reaching 4 puts version 2 again: it must survive, and be
    # what "newest" means, although 3 and 4 are higher numbers.
    ws = WeightStore.connect(run_name, ray_config)  # keeps 2
    for version in (1, 2, 3, 4):
        await ws.put(version, {"w": torch.full((2,), float(version))})
    await ws.put(2, {"w": torch.full((2,), 20.0)})
    assert sorted(await ws.versions()) == [2, 4]
    assert torch.equal((await ws.get())["w"], torch.full((2,), 20.0))
    assert torch.equal((await ws.get(2))["w"], torch.full((2,), 20.0))


async def test_a_killed_shard_is_a_missing_payload_not_a_crash(ray_config, run_name):
    # A dead shard (its node lost, or Ray restarting it empty) took its tensors with it, and readers must be told so
    # in the one way the trainer handles -- PayloadMissing, whose prompts are re-issued -- not ActorDiedError.
    import ray

    tq = TransferQueue.connect(run_name, ray_config)
    await tq.put_many({f"k/{i}": {"x": torch.full((3,), float(i))} for i in range(6)})
    ray.kill(tq.shards[0], no_restart=True)
    for _ in range(100):  # ray.kill is asynchronous: wait until the shard is really gone
        try:
            ray.get(tq.shards[0].stats.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            break
        await asyncio.sleep(0.1)
    else:
        pytest.fail("the killed shard kept answering")
    with pytest.raises(PayloadMissing):
        await tq.get_list([f"k/{i}" for i in range(6)])
    with pytest.raises(PayloadMissing):
        tq.get_list_sync([f"k/{i}" for i in range(6)])
    # The dead shard was made again (empty) by the first read: a delete frees what the live shard holds, and the
    # dead one's keys are simply gone.
    on_live = sum(1 for i in range(6) if tq.shard_of(f"k/{i}") != 0)
    assert await tq.delete([f"k/{i}" for i in range(6)]) == on_live
    key = next(f"z/{j}" for j in range(1000) if tq.shard_of(f"z/{j}") == 0)
    await tq.put(key, {"x": torch.ones(2)})  # the same client works again, on the shard made again
    assert torch.equal((await tq.get_list([key]))[0]["x"], torch.ones(2))
    # and a client connecting afresh attaches to the new shard
    again = TransferQueue.connect(run_name, ray_config)
    await again.put("again", {"x": torch.ones(2)})
    assert torch.equal((await again.get_list(["again"]))[0]["x"], torch.ones(2))


async def test_publishing_a_large_state_dict_leaves_the_event_loop_free(ray_config, run_name):
    """Hashing and copying 256 MB happen in a thread: the trainer's loop keeps ticking (acks, the recorder)."""
    ws = WeightStore.connect(run_name, ray_config)
    sd = {f"layer{i}.weight": torch.full((1024, 8192), float(i)) for i in range(8)}  # 8 x 32 MiB
    async with loop_gaps(0.005) as gaps:
        t0 = time.perf_counter()
        info = await ws.put(1, sd)
        took = time.perf_counter() - t0
    assert info.num_bytes == 8 * 1024 * 8192 * 4 and info.checksum == state_dict_checksum(sd)
    assert len(gaps) >= 3, f"publish took {took:.3f}s and the loop ticked {len(gaps)} times"
    assert max(gaps) < max(0.1, took / 3), f"event loop stalled {max(gaps):.3f}s of a {took:.3f}s publish"
    got = await ws.get(1, expect=info.checksum)
    assert torch.equal(got["layer7.weight"], sd["layer7.weight"])
