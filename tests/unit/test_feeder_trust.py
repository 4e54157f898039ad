"""The feeder trusts only itself: a trajectory group (or a prompt's dead letter) re-issues or retires a prompt only
when it names a release the feeder made and has not superseded, and its payloads were really put; anything else is
dead-lettered with the reason (trainer/feeder.py `vouch`, consumers/batcher.py).

    .venv/bin/python -m pytest -q tests/unit/test_feeder_trust.py
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
import pytest

from rlbus.consumers.batcher import NEVER_PUT, Batcher
from rlbus.schemas.wire import DeadLetter, PromptTask, encode
from rlbus.trainer.feeder import Feeder, Reissue, task_id
from tests.support.memory_bus import MemoryBus, MemoryTransferQueue
from tests.unit.test_batcher import group
from tests.unit.test_feeder import DATASET, N, Version, make_cfg

pytestmark = pytest.mark.timeout(10)


class RecordingTQ(MemoryTransferQueue):
    def __init__(self, up_since: float) -> None:
        super().__init__()
        self.started_at = up_since


@pytest.fixture
def run(tmp_path: Path) -> tuple[Feeder, MemoryBus]:
    bus = MemoryBus()
    feeder = Feeder(make_cfg(tmp_path / "run", "feeder.max_attempts=3"), DATASET, bus, Version())
    return feeder, bus


async def test_vouch_knows_its_own_releases_and_nothing_else(run) -> None:
    feeder, _ = run
    assert await feeder._release(2) == 2  # examples 0 and 1 of epoch 0 (no shuffle)
    assert feeder.vouch("e0-i1-a0", 1, 0, 0) is None
    assert "never released" in feeder.vouch("e0-i4-a0", 4, 0, 0)
    assert "never released" in feeder.vouch("e1-i0-a0", 0, 1, 0)
    assert "never released" in feeder.vouch("e0-i1-a1", 1, 0, 1)
    assert "does not match" in feeder.vouch("e0-i1-a0", 0, 0, 0)
    assert f"the data set has {N}" in feeder.vouch(f"e0-i{N}-a0", N, 0, 0)
    feeder.abandon(1, 0, 0, reissue=True)  # its payload was lost: attempt 1 is scheduled, not yet released
    assert "superseded" in feeder.vouch("e0-i1-a0", 1, 0, 0)
    assert "never released" in feeder.vouch("e0-i1-a1", 1, 0, 1)
    await feeder._release(1)
    assert feeder.vouch("e0-i1-a1", 1, 0, 1) is None
    feeder.abandon(1, 0, 1, reissue=True)
    await feeder._release(1)
    feeder.abandon(1, 0, 2, reissue=True)  # the third release of three: given up
    assert "given up" in feeder.vouch("e0-i1-a2", 1, 0, 2)
    # Saved with the state: a restarted feeder vouches the same.
    again = Feeder(feeder.cfg, DATASET, MemoryBus(), Version())
    assert "superseded" in again.vouch("e0-i1-a1", 1, 0, 1) and again.vouch("e0-i0-a0", 0, 0, 0) is None


async def test_a_forged_group_naming_a_real_prompt_is_dead_lettered_and_reissues_nothing(run) -> None:
    feeder, bus = run
    await feeder._release(2)
    b = Batcher(feeder.cfg, bus, MemoryTransferQueue(), feeder)
    forged = [
        group(5),  # a prompt never released
        msgspec.structs.replace(group(1), task_id="e0-i0-a0"),  # names one task, answers another
        msgspec.structs.replace(group(1), samples=[msgspec.structs.replace(s, key=f"e0-i0-a0/{j}")
                                                   for j, s in enumerate(group(1).samples)]),  # another task's keys
    ]  # fmt: skip
    ds = [bus.deliver_group(g) for g in forged]
    real = bus.deliver_group(group(1))
    assert [g.group_id for g in await b.next_batch(version=0, need=1)] == ["e0-i1-a0"]
    assert [d.terms for d in ds] == [1, 1, 1] and real.terms == 0
    assert "never released" in ds[0].dead_letters[0]
    assert "does not match" in ds[1].dead_letters[0] and "are not under its task id" in ds[2].dead_letters[0]
    assert feeder.state.abandoned == 0 and feeder.state.reissues == [] and b.counts.dead_lettered == 3


@pytest.mark.parametrize(("shards_started_s_before", "reissued"), [(120.0, False), (5.0, True)])
async def test_a_missing_payload_reissues_only_if_a_restart_can_have_lost_it(
    run, shards_started_s_before: float, reissued: bool
) -> None:
    feeder, bus = run
    await feeder._release(2)
    tq = RecordingTQ(up_since=time.time() - shards_started_s_before)  # bus.retry_s is 30 s: the bound is 40 s
    b = Batcher(feeder.cfg, bus, tq, feeder)
    d = bus.deliver_group(group(0))
    await b.next_batch(version=0, need=1)
    await b.payload_missing(["e0-i0-a0"])
    assert (feeder.state.reissues != []) is reissued
    if reissued:
        assert d.acks == 1 and b.counts.missing_payload == 1
    else:
        assert d.terms == 1 and "never put" in d.dead_letters[0] and feeder.state.abandoned == 0


async def test_a_forged_prompt_dead_letter_reissues_nothing(run) -> None:
    feeder, bus = run
    await feeder._release(1)
    task = PromptTask(task_id="e0-i3-a0", prompt=[], index=3)  # never released
    letter = DeadLetter(reason="forged", original_subject=bus.subjects.prompts, payload=encode(task),
                        payload_bytes=len(encode(task)))  # fmt: skip
    await bus.publish(bus.subjects.dead_letter, letter)
    await feeder.reissue_dead_letters()
    assert feeder.state.reissues == [] and feeder.state.abandoned == 0


async def _orphaned(feeder: Feeder, bus: MemoryBus, *, dead_lettered_s_ago: float) -> Batcher:
    """Example 0's release, its group dead-lettered as never put `dead_lettered_s_ago` seconds ago (the letter
    published as the real bus does), and the feeder's dead-letter reader run over it."""
    await feeder._release(2)
    b = Batcher(feeder.cfg, bus, RecordingTQ(up_since=time.time() - 3600), feeder)
    d = bus.deliver_group(group(0))
    await b.next_batch(version=0, need=1)
    await b.payload_missing(["e0-i0-a0"])
    assert NEVER_PUT in d.dead_letters[0]
    payload = encode(group(0))
    await bus.publish(bus.subjects.dead_letter, DeadLetter(
        reason=d.dead_letters[0], original_subject=bus.subjects.traj, payload=payload, payload_bytes=len(payload),
        created_at=time.time() - dead_lettered_s_ago))  # fmt: skip
    await feeder.reissue_dead_letters()
    return b


@pytest.mark.parametrize(("ago", "settled", "reissued"), [(0.0, False, False), (700.0, False, True),
                                                          (700.0, True, False)])  # fmt: skip
async def test_a_release_whose_only_group_was_never_put_is_reissued_after_the_grace(
    tmp_path: Path, ago: float, settled: bool, reissued: bool
) -> None:
    """No prompt stays in flight for good: once feeder.orphan_grace_s (600 s) has passed since its group was
    dead-lettered as never put, the release is re-issued, unless a group of it is held or trained by then."""
    bus = MemoryBus()
    feeder = Feeder(make_cfg(tmp_path / "run"), DATASET, bus, Version(), settled=lambda task: settled)
    await _orphaned(feeder, bus, dead_lettered_s_ago=ago)
    assert feeder.state.abandoned == 0  # the dead letter alone re-issues nothing
    assert feeder.reissue_orphans() == int(reissued)
    assert (feeder.state.reissues == [Reissue(index=0, epoch=0, attempt=1)]) is reissued
    assert feeder.state.abandoned == int(reissued)
    if ago:  # judged once: neither again nor by a restarted feeder reading the same dead letters
        again = Feeder(feeder.cfg, DATASET, bus, Version())
        await again.reissue_dead_letters()
        assert again.reissue_orphans() == 0 and again.state.abandoned == int(reissued)


async def test_a_never_put_release_already_reissued_is_left_alone(tmp_path: Path) -> None:
    bus = MemoryBus()
    feeder = Feeder(make_cfg(tmp_path / "run"), DATASET, bus, Version(), settled=lambda task: False)
    await _orphaned(feeder, bus, dead_lettered_s_ago=700.0)
    feeder.abandon(0, 0, 0, reissue=True)  # e.g. its prompt's own dead letter re-issued it meanwhile
    assert feeder.reissue_orphans() == 0 and feeder.state.abandoned == 1


class DyingBus(MemoryBus):
    """Publishes `lives` messages, then the process 'dies' (the publish raises, as a SIGKILL would end it)."""

    def __init__(self, lives: int) -> None:
        super().__init__()
        self.lives = lives

    async def publish(self, subject, msg, msg_id=None):
        if self.lives == 0:
            raise SystemExit("killed")
        self.lives -= 1
        return await super().publish(subject, msg, msg_id)


async def test_a_feeder_killed_mid_batch_restarts_ahead_of_what_it_published(tmp_path: Path) -> None:
    """The trainer SIGKILLed between publishing some of a batch's tasks and saving its position: the restarted
    feeder must vouch for the tasks already out (their groups were refused as never released before, and its own
    release of them was then de-duplicated away, leaving each prompt in flight for good), and publishes the rest."""
    cfg = make_cfg(tmp_path / "run")
    dying = DyingBus(lives=2)
    with pytest.raises(SystemExit):
        await Feeder(cfg, DATASET, dying, Version())._release(4)
    out = [msg.task_id for _, msg, _ in dying.published]
    assert out == ["e0-i0-a0", "e0-i1-a0"]  # two of the four went out before the kill
    bus = MemoryBus()
    bus._msg_ids |= dying._msg_ids  # the same stream: JetStream's duplicate window holds their ids
    again = Feeder(cfg, DATASET, bus, Version())
    assert again.state.released == 4 and [r.index for r in again.state.pending] == [0, 1, 2, 3]
    assert all(again.vouch(task_id(i, 0, 0), i, 0, 0) is None for i in range(4))  # the groups of all four are its
    b = Batcher(cfg, bus, MemoryTransferQueue(), again)
    d = bus.deliver_group(group(1))  # a producer already finished e0-i1-a0 before the restart
    assert [g.group_id for g in await b.next_batch(version=0, need=1)] == ["e0-i1-a0"] and d.terms == 0
    task = asyncio.create_task(again.run())
    for _ in range(100):
        if not again.state.pending:
            break
        await asyncio.sleep(0.01)
    task.cancel()
    assert again.state.pending == [] and bus.duplicates == ["e0-i0-a0", "e0-i1-a0"]
    assert [msg.task_id for _, msg, _ in bus.published][:2] == ["e0-i2-a0", "e0-i3-a0"]
    # the pending four were counted once, before the kill: only releases made after them count again
    assert again.state.released == 4 + len(bus.published) - 2
    assert Feeder(cfg, DATASET, MemoryBus(), Version()).state.pending == []
