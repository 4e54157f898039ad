"""Batcher (consumers/batcher.py): batch forming, staleness / dynamic-sampling discards, held acks, the ledger.

Pure logic against the in-memory bus of tests/support/memory_bus.py; the keep-alive task is never started.

    .venv/bin/python -m pytest -q tests/unit/test_batcher.py
"""

from __future__ import annotations

import math
import time

import pytest

from rlbus.consumers.batcher import NEVER_PUT, Batcher
from rlbus.schemas.config_io import load_config
from rlbus.schemas.staleness import NO_VERSION
from rlbus.schemas.wire import SampleMeta, TrajectoryGroup
from tests.support.memory_bus import MemoryBus, MemoryDelivery, MemoryTransferQueue

pytestmark = pytest.mark.timeout(10)  # a next_batch waiting for a group that never comes fails fast


class RecordingReleases:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int, bool]] = []
        self.why: list[str] = []

    def abandon(self, index: int, epoch: int, attempt: int, *, reissue: bool, why: str = "") -> None:
        self.calls.append((index, epoch, attempt, reissue))
        self.why.append(why)

    def vouch(self, task: str, index: int, epoch: int, attempt: int) -> str | None:
        return None  # every group here answers a release (tests/unit/test_feeder.py tests the feeder's own)


def make_cfg(*overrides: str):
    return load_config(None, ["model.path=unused", "trainer.groups_per_step=2", "trainer.max_staleness=1",
                              "bus.ack_wait_s=3600", *overrides])


def group(index: int, versions: tuple[int, ...] = (0,), rewards: tuple[float, ...] = (0.0, 1.0),
          epoch: int = 0, attempt: int = 0) -> TrajectoryGroup:
    """A group whose sample j has min = max = versions[j] (a single int for every sample if len(versions)==1)."""
    gid = f"e{epoch}-i{index}-a{attempt}"
    vs = versions * len(rewards) if len(versions) == 1 else versions
    samples = [SampleMeta(key=f"{gid}/{j}", prompt_len=4, response_len=8, reward=r, min_version=v, max_version=v)
               for j, (r, v) in enumerate(zip(rewards, vs))]
    return TrajectoryGroup(group_id=gid, task_id=gid, producer_id="p0", samples=samples, index=index, epoch=epoch,
                           attempt=attempt)


@pytest.fixture
def bus() -> MemoryBus:
    return MemoryBus()


@pytest.fixture
def tq() -> MemoryTransferQueue:
    return MemoryTransferQueue()


@pytest.fixture
def releases() -> RecordingReleases:
    return RecordingReleases()


def batcher(bus, tq, releases, *overrides: str, trained: set[str] | None = None) -> Batcher:
    return Batcher(make_cfg(*overrides), bus, tq, releases, trained=trained)


def ids(groups: list[TrajectoryGroup]) -> list[str]:
    return [g.group_id for g in groups]


async def test_batch_is_groups_per_step_whole_groups(bus, tq, releases):
    b = batcher(bus, tq, releases)
    ds = [bus.deliver_group(group(i, rewards=(0.0, 1.0, 0.5))) for i in range(3)]
    batch = await b.next_batch(version=0)
    assert ids(batch) == ["e0-i0-a0", "e0-i1-a0"]
    assert [g.keys for g in batch] == [[f"e0-i{i}-a0/{j}" for j in range(3)] for i in range(2)]
    assert bus.fetches == [(bus.subjects.traj, "trainer", 2)]  # asks for just what the batch needs
    assert bus.queued(bus.subjects.traj) == 1  # the third stays queued
    assert [d.acks for d in ds] == [0, 0, 0] and tq.deleted == [] and releases.calls == []
    assert ids(await b.next_batch(version=0, need=1)) == ["e0-i2-a0"]


async def test_too_stale_group_is_dropped_and_reissued_under_drop(bus, tq, releases):
    b = batcher(bus, tq, releases, "trainer.staleness_policy=drop")
    stale = bus.deliver_group(group(0, versions=(5, 3)))  # oldest token 3 lags version 5 by 2 > 1
    edge = bus.deliver_group(group(1, versions=(4,)))  # lags by exactly max_staleness: kept
    assert ids(await b.next_batch(version=5, need=1)) == ["e0-i1-a0"]
    assert stale.acks == 1 and edge.acks == 0
    assert tq.deleted == [["e0-i0-a0/0", "e0-i0-a0/1"]]
    assert releases.calls == [(0, 0, 0, True)]
    assert b.counts.dropped_stale == 1 and b.counts.rolled_back == 0


async def test_too_stale_group_is_kept_under_correct(bus, tq, releases):
    b = batcher(bus, tq, releases, "trainer.staleness_policy=correct")
    d = bus.deliver_group(group(0, versions=(0,)))
    assert ids(await b.next_batch(version=9, need=1)) == ["e0-i0-a0"]
    assert d.acks == 0 and tq.deleted == [] and releases.calls == [] and b.counts.dropped_stale == 0


async def test_group_newer_than_the_trainer_is_rolled_back_and_reissued(bus, tq, releases):
    b = batcher(bus, tq, releases, "trainer.staleness_policy=correct")  # rolled back under either policy
    ahead = bus.deliver_group(group(3, versions=(5, 6), epoch=1, attempt=1))
    level = bus.deliver_group(group(4, versions=(5,)))
    assert ids(await b.next_batch(version=5, need=1)) == ["e0-i4-a0"]
    assert ahead.acks == 1 and level.acks == 0
    assert tq.deleted == [["e1-i3-a1/0", "e1-i3-a1/1"]]
    assert releases.calls == [(3, 1, 1, True)]
    assert b.counts.rolled_back == 1 and b.counts.dropped_stale == 0


@pytest.mark.parametrize("why", ["too stale", "ahead of the trainer", "uniform rewards", "non-finite reward"])
async def test_a_group_whose_tensors_were_never_put_neither_retires_nor_reissues_its_prompt(bus, tq, releases, why):
    # Forged with a producer's credential, naming a real release: had it been judged, it would have re-issued (stale,
    # ahead) or retired (uniform, non-finite) the real prompt, whose own group would then be refused.
    b = batcher(bus, tq, releases, "trainer.staleness_policy=drop", "trainer.max_staleness=1",
                "trainer.dynamic_sampling=true")
    versions, rewards = {"too stale": ((7,), (0.0, 1.0)), "ahead of the trainer": ((11,), (0.0, 1.0)),
                         "uniform rewards": ((10,), (1.0, 1.0)), "non-finite reward": ((10,), (0.0, math.nan))}[why]
    forged = group(0, versions=versions, rewards=rewards)
    tq.absent.update(forged.keys)
    tq.started_at = time.time() - 3600  # the shards ran all along: nobody put them
    d = bus.deliver_group(forged)
    bus.deliver_group(group(1, versions=(10,)))
    assert ids(await b.next_batch(version=10, need=1)) == ["e0-i1-a0"]
    assert len(d.dead_letters) == 1 and NEVER_PUT in d.dead_letters[0], d.dead_letters
    assert releases.calls == [] and b.counts.dead_lettered == 1 and not b.has_group("e0-i0-a0")
    # The real group of that release comes later, and is trained.
    bus.deliver_group(group(0, versions=(10,)))
    assert ids(await b.next_batch(version=10, need=1)) == ["e0-i0-a0"]


async def test_group_without_generated_tokens_is_never_too_stale(bus, tq, releases):
    b = batcher(bus, tq, releases, "trainer.staleness_policy=drop", "trainer.max_staleness=0")
    empty = bus.deliver_group(group(0, versions=(NO_VERSION,)))
    mixed = bus.deliver_group(group(1, versions=(NO_VERSION, 100)))  # the empty sample is left out, not version -1
    old = bus.deliver_group(group(2, versions=(NO_VERSION, 99)))
    assert ids(await b.next_batch(version=100, need=2)) == ["e0-i0-a0", "e0-i1-a0"]
    bus.deliver_group(group(3, versions=(100,)))
    assert ids(await b.next_batch(version=100, need=1)) == ["e0-i3-a0"]
    assert (empty.acks, mixed.acks, old.acks) == (0, 0, 1)
    assert releases.calls == [(2, 0, 0, True)] and b.counts.dropped_stale == 1
    assert releases.why == ["too stale"]  # kept with the example: one given up later says why


async def test_dynamic_sampling_skips_uniform_groups_without_reissue(bus, tq, releases):
    b = batcher(bus, tq, releases, "trainer.dynamic_sampling=true")
    uniform = bus.deliver_group(group(0, rewards=(1.0, 1.0, 1.0)))
    single = bus.deliver_group(group(1, rewards=(1.0,)))  # one sample: nothing to compare, kept
    mixed = bus.deliver_group(group(2, rewards=(1.0, 0.0)))
    assert ids(await b.next_batch(version=0)) == ["e0-i1-a0", "e0-i2-a0"]
    assert (uniform.acks, single.acks, mixed.acks) == (1, 0, 0)
    assert tq.deleted == [[f"e0-i0-a0/{j}" for j in range(3)]]
    assert releases.calls == [(0, 0, 0, False)] and b.counts.skipped_uniform == 1


async def test_uniform_groups_are_kept_without_dynamic_sampling(bus, tq, releases):
    b = batcher(bus, tq, releases, "trainer.dynamic_sampling=false")
    bus.deliver_group(group(0, rewards=(1.0, 1.0)))
    assert ids(await b.next_batch(version=0, need=1)) == ["e0-i0-a0"]
    assert b.counts.skipped_uniform == 0 and releases.calls == []


async def test_redelivery_of_a_trained_group_is_acked_as_duplicate(bus, tq, releases):
    b = batcher(bus, tq, releases, trained={"e0-i0-a0"})
    again = bus.deliver_group(group(0))
    bus.deliver_group(group(1))
    assert ids(await b.next_batch(version=0, need=1)) == ["e0-i1-a0"]
    assert again.acks == 1 and b.counts.duplicates == 1
    assert releases.calls == []  # it was trained: no admission slot to free, nothing to re-issue
    assert b.trained_ids() == {"e0-i0-a0"}  # the new one is held (step -1), not yet trained
    # its tensors are freed too: a trainer that died between its checkpoint and commit() left them stored
    assert tq.deleted == [["e0-i0-a0/0", "e0-i0-a0/1"]]


async def test_a_discarded_group_delivered_twice_is_abandoned_once(bus, tq, releases):
    # A stale group redelivered before its discard's ack landed (it waited in the fetch inbox past ack_wait) must
    # free one admission slot and be re-issued once, not twice.
    b = batcher(bus, tq, releases, "trainer.max_staleness=0")
    first = bus.deliver_group(group(0, versions=(3,)))
    second = bus.deliver_group(group(0, versions=(3,)))
    bus.deliver_group(group(1, versions=(5,)))
    assert ids(await b.next_batch(version=5, need=1)) == ["e0-i1-a0"]
    assert releases.calls == [(0, 0, 0, True)]
    assert (first.acks, second.acks) == (1, 1)
    assert (b.counts.dropped_stale, b.counts.duplicates) == (1, 1)


async def test_second_delivery_of_a_held_group_is_ignored(bus, tq, releases):
    b = batcher(bus, tq, releases)
    first = bus.deliver_group(group(0))
    assert ids(await b.next_batch(version=0, need=1)) == ["e0-i0-a0"]
    second = bus.deliver_group(group(0))
    bus.deliver_group(group(1))
    assert ids(await b.next_batch(version=0, need=1)) == ["e0-i1-a0"]
    assert second.num_delivered == 2 and second.acks == 0 and b.counts.duplicates == 1
    b.trained_in(0, ["e0-i0-a0", "e0-i1-a0"])
    assert await b.commit(0) == 2
    assert (first.acks, second.acks) == (1, 0)  # the held (first) delivery is the one acked


async def test_acks_are_held_until_commit_of_a_durable_step(bus, tq, releases):
    b = batcher(bus, tq, releases)
    ds = [bus.deliver_group(group(i)) for i in range(5)]
    b.trained_in(1, ids(await b.next_batch(version=0)))
    b.trained_in(2, ids(await b.next_batch(version=1)))
    assert ids(await b.next_batch(version=1, need=1)) == ["e0-i4-a0"]  # forming step 3's batch: step -1
    all4 = {f"e0-i{i}-a0" for i in range(4)}
    assert [d.acks for d in ds] == [0] * 5 and b.trained == set() and b.trained_ids() == all4
    assert await b.commit(1) == 2
    assert [d.acks for d in ds] == [1, 1, 0, 0, 0]
    assert tq.deleted == [["e0-i0-a0/0", "e0-i0-a0/1", "e0-i1-a0/0", "e0-i1-a0/1"]]
    assert tq.owners_deleted == [["e0-i0-a0", "e0-i1-a0"]]  # and what else their tasks stored (a dead producer's)
    assert b.trained == {"e0-i0-a0", "e0-i1-a0"} and b.trained_ids() == all4
    assert await b.commit(1) == 0  # nothing acked twice
    assert await b.commit(10) == 2  # step 2; the group without a step is not acked
    assert [d.acks for d in ds] == [1, 1, 1, 1, 0]
    assert b.trained == all4 and b.trained_ids() == all4 and len(tq.deleted) == 2


async def test_payload_missing_acks_deletes_and_reissues(bus, tq, releases):
    b = batcher(bus, tq, releases)
    ds = [bus.deliver_group(group(i, epoch=2)) for i in range(2)]
    await b.next_batch(version=0)
    await b.payload_missing(["e2-i1-a0"])
    assert [d.acks for d in ds] == [0, 1] and tq.deleted == [["e2-i1-a0/0", "e2-i1-a0/1"]]
    assert tq.owners_deleted == [["e2-i1-a0"]]
    assert releases.calls == [(1, 2, 0, True)] and b.counts.missing_payload == 1
    assert releases.why == ["payload lost"]
    b.trained_in(0, ["e2-i0-a0"])
    assert await b.commit(0) == 1 and b.trained_ids() == {"e2-i0-a0"}


async def test_await_redelivery_puts_lost_groups_first_in_their_old_order(bus, tq, releases):
    b = batcher(bus, tq, releases, trained={"e0-i7-a0"})
    for i in (9, 1, 0):  # a new group first, then the lost ones in another order
        bus.deliver_group(group(i))
    lost = ["e0-i0-a0", "e0-i1-a0", "e0-i5-a0", "e0-i7-a0"]  # i5 never comes back; i7 is trained already
    assert await b.await_redelivery(lost, timeout=0.05) == ["e0-i5-a0"]
    assert ids(await b.next_batch(version=0, need=3)) == ["e0-i0-a0", "e0-i1-a0", "e0-i9-a0"]


async def test_await_redelivery_of_trained_groups_does_not_wait(bus, tq, releases):
    b = batcher(bus, tq, releases, trained={"e0-i0-a0"})
    assert await b.await_redelivery(["e0-i0-a0"], timeout=30.0) == []
    assert bus.fetches == []


async def test_ledger_every_delivered_group_is_trained_abandoned_or_held(bus, tq, releases):
    b = batcher(bus, tq, releases, "trainer.max_staleness=0", "trainer.dynamic_sampling=true")
    by_gid: dict[str, list[MemoryDelivery]] = {}

    def deliver(g: TrajectoryGroup) -> None:
        by_gid.setdefault(g.group_id, []).append(bus.deliver_group(g))

    for g in (group(0, (1,)), group(1, (0,)), group(2, (1,), rewards=(1.0, 1.0)), group(3, (1,))):
        deliver(g)  # fresh, stale, uniform, fresh
    b.trained_in(1, ids(await b.next_batch(version=1)))
    for g in (group(0, (1,)), group(4, (1,)), group(5, (1,)), group(6, (1,)), group(7, (2,))):
        deliver(g)  # a redelivery of held i0, then fresh, fresh, fresh, rolled back
    step2 = await b.next_batch(version=1)
    assert ids(step2) == ["e0-i4-a0", "e0-i5-a0"]
    await b.payload_missing(["e0-i5-a0"])
    b.trained_in(2, ["e0-i4-a0", *ids(await b.next_batch(version=1, need=1))])
    assert await b.commit(1) == 2

    trained = {"e0-i0-a0", "e0-i3-a0"}
    abandoned = {"e0-i1-a0", "e0-i2-a0", "e0-i5-a0"}
    held = {"e0-i4-a0", "e0-i6-a0"}
    assert bus.queued(bus.subjects.traj) == 1  # i7 is still queued: never delivered to the batcher
    delivered = set(by_gid) - {"e0-i7-a0"}
    assert trained | abandoned | held == delivered and len(trained) + len(abandoned) + len(held) == len(delivered)
    acks = {gid: sum(d.acks for d in ds) for gid, ds in by_gid.items()}
    assert {gid: acks[gid] for gid in delivered} == {**dict.fromkeys(trained | abandoned, 1), **dict.fromkeys(held, 0)}
    assert b.trained == trained and b.trained_ids() == trained | held
    assert sorted(f"e0-i{c[0]}-a0" for c in releases.calls) == sorted(abandoned)  # abandoned once each
    assert releases.calls == [(1, 0, 0, True), (2, 0, 0, False), (5, 0, 0, True)]
    assert (b.counts.dropped_stale, b.counts.skipped_uniform, b.counts.missing_payload, b.counts.duplicates) == \
        (1, 1, 1, 1)
    assert await b.commit(2) == 2 and b.trained == trained | held
    assert all(sum(d.acks for d in by_gid[gid]) == 1 for gid in held)


async def test_a_group_with_a_non_finite_reward_is_dead_lettered_not_trained(bus, tq, releases):
    b = batcher(bus, tq, releases)
    bad = bus.deliver_group(group(0, rewards=(1.0, float("nan"))))
    bus.deliver_group(group(1))
    assert ids(await b.next_batch(version=0, need=1)) == ["e0-i1-a0"]
    assert bad.dead_letters == ["group e0-i0-a0 (task e0-i0-a0) has non-finite rewards for ['e0-i0-a0/1']"]
    assert tq.deleted == [["e0-i0-a0/0", "e0-i0-a0/1"]]
    assert releases.calls == [(0, 0, 0, False)]  # its slot is freed; the prompt is accounted for by the letter
    assert b.counts.dead_lettered == 1


async def test_a_second_copy_of_a_discarded_group_is_acked_and_freed(bus, tq, releases):
    # A redo published after the duplicate window is a second message with the same group id and its own tensors.
    b = batcher(bus, tq, releases, "trainer.staleness_policy=drop")
    first = bus.deliver_group(group(0, versions=(0,)))  # too stale at version 5
    again = group(0, versions=(4,))
    for j, sample in enumerate(again.samples):
        sample.key = f"e0-i0-a0/d2/{j}"
    second = bus.deliver_group(again)
    bus.deliver_group(group(1, versions=(5,)))
    assert ids(await b.next_batch(version=5, need=1)) == ["e0-i1-a0"]
    assert (first.acks, second.acks, b.counts.duplicates) == (1, 1, 1)
    assert tq.deleted == [["e0-i0-a0/0", "e0-i0-a0/1"], ["e0-i0-a0/d2/0", "e0-i0-a0/d2/1"]]
    assert tq.owners_deleted == [["e0-i0-a0"], ["e0-i0-a0"]]
    assert releases.calls == [(0, 0, 0, True)]  # abandoned once


async def test_a_dropped_groups_reissue_is_settled_before_its_ack(bus, tq, releases):
    """The trainer killed while acking a group it drops (here: the ack never returns): the prompt's re-issue is
    already with the feeder, so the prompt is not left in flight with its group gone."""
    b = batcher(bus, tq, releases, "trainer.staleness_policy=drop")
    stale = bus.deliver_group(group(0, versions=(5, 3)))

    async def killed() -> None:
        raise SystemExit("killed during the ack")

    stale.ack = killed
    with pytest.raises(SystemExit):
        await b.next_batch(version=5, need=1)
    assert releases.calls == [(0, 0, 0, True)]
