"""Feeder (trainer/feeder.py): admission, deterministic task ids, re-issues, epochs, persistence, dead letters.

Against the in-memory bus of tests/support/memory_bus.py and a real synthetic PromptDataset of 6 examples.

    .venv/bin/python -m pytest -q tests/unit/test_feeder.py
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import msgspec
import pytest

from rlbus.common.data import load_dataset
from rlbus.consumers.event_log import read_entries
from rlbus.consumers.recorder import Recorder
from rlbus.schemas.config import DataConfig
from rlbus.schemas.config_io import load_config
from rlbus.schemas.wire import DeadLetter, PromptTask, encode
from rlbus.trainer.feeder import Feeder, Reissue, permutation
from tests.support.memory_bus import MemoryBus

pytestmark = pytest.mark.timeout(10)

N = 6
DATASET = load_dataset(DataConfig(type="synthetic", num_examples=N))


class Version:
    def __init__(self) -> None:
        self.value = 0

    def __call__(self) -> int:
        return self.value


def make_cfg(run_dir: Path, *overrides: str):
    return load_config(None, ["model.path=unused", f"logging.run_dir={run_dir}", "trainer.groups_per_step=2",
                              "trainer.max_staleness=1", "rollout.n=3", "feeder.shuffle=false", *overrides])


@pytest.fixture
def bus() -> MemoryBus:
    return MemoryBus()


@pytest.fixture
def version() -> Version:
    return Version()


def feeder(tmp_path: Path, bus: MemoryBus, version: Version, *overrides: str, **kw) -> Feeder:
    return Feeder(make_cfg(tmp_path / "run", *overrides), DATASET, bus, version, **kw)


def task_ids(bus: MemoryBus) -> list[str]:
    return [msg.task_id for _, msg, _ in bus.published]


async def wait_until(cond, timeout: float = 2.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.001)


async def settle() -> None:
    await asyncio.sleep(0.02)  # give a running feeder the chance to release more than it should


async def test_admission_bound_and_version_bump(tmp_path, bus, version):
    f = feeder(tmp_path, bus, version)
    assert f.allowance() == (0 + 1 + 1) * 2 - 0 == 4
    run = asyncio.create_task(f.run())
    try:
        await wait_until(lambda: len(bus.published) == 4)
        await settle()
        assert len(bus.published) == 4 and f.allowance() == 0 and f.admitted() == 4
        version.value = 1
        await settle()
        assert len(bus.published) == 4  # the feeder is told of a version change, it does not poll for it
        f.notify()
        await wait_until(lambda: len(bus.published) == 6)
        await settle()
        assert task_ids(bus) == [f"e0-i{i}-a0" for i in range(6)] and f.allowance() == 0
        f.abandon(2, 0, 0, reissue=False)  # frees one slot
        await wait_until(lambda: len(bus.published) == 7)
        await settle()
        assert len(bus.published) == 7 and f.allowance() == (1 + 1 + 1) * 2 - (7 - 1) == 0
    finally:
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)


async def test_allowance_counts_released_minus_abandoned(tmp_path, bus, version):
    f = feeder(tmp_path, bus, version, "trainer.max_staleness=2")
    version.value = 1
    assert await f._release(5) == 5
    f.abandon(0, 0, 0, reissue=False, why="uniform rewards (dynamic sampling)")
    f.abandon(1, 0, 0, reissue=True)
    assert (f.state.released, f.state.abandoned) == (5, 2)
    # A release dropped for good is named, with why, for the ledger (consumers/ledger.py reads feeder.json).
    assert f.state.retired == {"e0-i0-a0": "uniform rewards (dynamic sampling)"}
    assert f.allowance() == (1 + 2 + 1) * 2 - (5 - 2) == 5


async def test_task_ids_are_deterministic_and_sent_as_msg_id(tmp_path, bus, version):
    f = feeder(tmp_path, bus, version)
    version.value = 3
    assert await f._release(3) == 3
    assert [(s, m) for s, _, m in bus.published] == [(bus.subjects.prompts, f"e0-i{i}-a0") for i in range(3)]
    for i, (_, task, _) in enumerate(bus.published):
        assert isinstance(task, PromptTask)
        assert (task.task_id, task.index, task.epoch, task.attempt, task.n, task.released_version) == \
            (f"e0-i{i}-a0", i, 0, 0, 3, 3)
        assert (task.ground_truth, task.prompt) == (DATASET[i].ground_truth, DATASET[i].prompt)


async def test_reissue_comes_first_with_the_next_attempt(tmp_path, bus, version):
    f = feeder(tmp_path, bus, version)
    await f._release(2)
    f.abandon(1, 0, 0, reissue=True)
    f.abandon(0, 0, 0, reissue=False)
    assert f.state.reissues == [Reissue(index=1, epoch=0, attempt=1)]
    await f._release(2)
    assert task_ids(bus) == ["e0-i0-a0", "e0-i1-a0", "e0-i1-a1", "e0-i2-a0"]
    assert bus.published[2][1].attempt == 1 and f.state.reissues == []


async def test_an_abandon_survives_a_crash_before_the_next_release(tmp_path, bus, version):
    # The batcher acks a discarded group before telling the feeder: the re-issue and the freed slot must be on
    # disk at once, not only after the next release.
    f = feeder(tmp_path, bus, version)
    await f._release(2)
    f.abandon(1, 0, 0, reissue=True)
    restarted = feeder(tmp_path, bus, version)
    assert restarted.state.abandoned == 1 and restarted.state.reissues == [Reissue(index=1, epoch=0, attempt=1)]
    await restarted._release(1)
    assert task_ids(bus)[-1] == "e0-i1-a1"


async def test_example_is_given_up_after_max_attempts(tmp_path, bus, version):
    f = feeder(tmp_path, bus, version, "feeder.max_attempts=2")
    await f._release(1)
    f.abandon(0, 0, 0, reissue=True, why="payload lost")
    await f._release(1)
    f.abandon(0, 0, 1, reissue=True, why="prompt dead-lettered")  # its 2nd release failed too: given up
    assert (f.state.given_up, f.state.reissues, f.state.abandoned) == (1, [], 2)
    await f._release(1)
    assert task_ids(bus) == ["e0-i0-a0", "e0-i0-a1", "e0-i1-a0"]
    # Why each release was lost is saved with the state, and the ledger names it for the example given up.
    saved = msgspec.json.decode((tmp_path / "run" / "feeder.json").read_bytes())
    assert saved["gave_up"] == ["e0-i0-a1"] and saved["lost"] == {"e0-i0": ["payload lost", "prompt dead-lettered"]}


async def test_losses_to_staleness_count_against_max_stale_releases_not_max_attempts(tmp_path, bus, version):
    """A release lost because it grew too stale (or was made by weights a restarted trainer lost) says nothing about
    the example: it is released again past max_attempts, and given up only after max_stale_releases such losses."""
    f = feeder(tmp_path, bus, version, "feeder.max_attempts=2", "feeder.max_stale_releases=3")
    await f._release(1)
    f.abandon(0, 0, 0, reissue=True, why="too stale")
    f.abandon(0, 0, 1, reissue=True, why="made by weights a restarted trainer lost")
    f.abandon(0, 0, 2, reissue=True, why="payload lost")  # one loss of its own: max_attempts 2 not reached
    assert f.state.given_up == 0 and f.state.reissues[-1] == Reissue(index=0, epoch=0, attempt=3)
    f.abandon(0, 0, 3, reissue=True, why="too stale")  # the third to staleness: given up
    assert f.state.given_up == 1 and f.state.gave_up == ["e0-i0-a3"]
    assert f.state.lost["e0-i0"] == ["too stale", "made by weights a restarted trainer lost", "payload lost",
                                     "too stale"]


async def test_one_epoch_is_exhausted_after_the_data_set(tmp_path, bus, version):
    f = feeder(tmp_path, bus, version, "feeder.epochs=1", "feeder.shuffle=true", "feeder.seed=7")
    assert await f._release(100) == N
    assert f.state.exhausted and (f.state.epoch, f.state.cursor, f.state.released) == (0, N, N)
    order = [t.index for _, t, _ in bus.published]
    assert sorted(order) == list(range(N)) and order == permutation(N, 7, 0, True)
    assert await f._release(100) == 0
    f.abandon(order[0], 0, 0, reissue=True)  # a re-issue still goes out after the data set is exhausted
    assert await f._release(100) == 1 and task_ids(bus)[-1] == f"e0-i{order[0]}-a1"


async def test_epochs_are_permutations_fixed_by_the_seed(tmp_path, bus, version):
    f = feeder(tmp_path, bus, version, "feeder.epochs=2", "feeder.shuffle=true", "feeder.seed=3")
    assert await f._release(100) == 2 * N and f.state.exhausted
    per_epoch = [[t.index for _, t, _ in bus.published if t.epoch == e] for e in (0, 1)]
    assert [sorted(o) for o in per_epoch] == [list(range(N))] * 2
    assert per_epoch == [permutation(N, 3, 0, True), permutation(N, 3, 1, True)]
    assert per_epoch[0] != per_epoch[1] and per_epoch[0] != list(range(N))  # shuffled, anew each epoch
    assert task_ids(bus)[N:] == [f"e1-i{i}-a0" for i in per_epoch[1]]
    other = MemoryBus()
    g = Feeder(make_cfg(tmp_path / "other", "feeder.epochs=2", "feeder.shuffle=true", "feeder.seed=3"), DATASET,
               other, version)
    await g._release(100)
    assert task_ids(other) == task_ids(bus)  # same seed, same order
    assert permutation(N, 4, 0, True) != per_epoch[0]  # another seed, another order


async def test_state_persists_and_a_new_feeder_continues(tmp_path, bus, version):
    f = feeder(tmp_path, bus, version, "feeder.shuffle=true", "trainer.max_staleness=5")
    await f._release(3)
    f.abandon(bus.published[0][1].index, 0, 0, reissue=True)
    await f._release(1)  # the re-issue; this release saves the abandon with it
    saved = json.loads((tmp_path / "run" / "feeder.json").read_text())
    assert (saved["cursor"], saved["released"], saved["abandoned"], saved["reissues"]) == (3, 4, 1, [])
    second_bus = MemoryBus()
    g = feeder(tmp_path, second_bus, version, "feeder.shuffle=true", "trainer.max_staleness=5")
    assert g.state == f.state and g.allowance() == f.allowance()
    assert await g._release(3) == 3
    order = permutation(N, 0, 0, True)
    assert task_ids(bus) == [f"e0-i{i}-a0" for i in order[:3]] + [f"e0-i{order[0]}-a1"]
    assert task_ids(second_bus) == [f"e0-i{i}-a0" for i in order[3:]]  # the same cursor: nothing released twice
    assert g.state.cursor == N


async def test_load_state_dict_takes_only_a_state_further_along(tmp_path, bus, version):
    f = feeder(tmp_path, bus, version, "feeder.shuffle=true", "trainer.max_staleness=5")
    await f._release(3)
    f.load_state_dict({"cursor": 1, "released": 2})  # an older checkpoint: the live state stays
    assert (f.state.cursor, f.state.released) == (3, 3)
    f.load_state_dict({"epoch": 1, "cursor": 2, "released": 9, "abandoned": 4})
    assert (f.state.epoch, f.state.cursor, f.state.released, f.state.abandoned) == (1, 2, 9, 4)
    await f._release(1)
    assert task_ids(bus)[-1] == f"e1-i{permutation(N, 0, 1, True)[2]}-a0"  # the order of the restored epoch
    assert f.state_dict()["released"] == 10


async def test_on_release_sees_every_acknowledged_publish(tmp_path, bus, version):
    seen: list[tuple[str, str]] = []

    def hook(task: PromptTask, subject: str) -> None:
        seen.append((task.task_id, subject))

    f = feeder(tmp_path / "a", bus, version, on_release=hook)
    await f._release(3)
    # A feeder that lost its file re-releases the same ids: JetStream drops them, yet the hook sees them -- a
    # duplicate ack is also what a publish retried after a failover gets when its first copy was stored unacked.
    g = feeder(tmp_path / "b", bus, version, on_release=hook)
    await g._release(4)
    assert bus.duplicates == ["e0-i0-a0", "e0-i1-a0", "e0-i2-a0"]
    assert seen == [(f"e0-i{i}-a0", bus.subjects.prompts) for i in [0, 1, 2, 0, 1, 2, 3]]
    assert task_ids(bus) == [f"e0-i{i}-a0" for i in range(4)] and g.state.released == 4


async def test_the_recorder_archives_each_released_task_once_across_its_restarts(tmp_path):
    rec = Recorder(tmp_path / "run", "metadata")
    tasks = {t: PromptTask(task_id=t, prompt=[], n=2) for t in ("e0-i0-a0", "e0-i1-a0")}
    rec.prompt(tasks["e0-i0-a0"])
    rec.prompt(tasks["e0-i0-a0"])
    await rec.stop()
    rec = Recorder(tmp_path / "run", "metadata")
    rec.prompt(tasks["e0-i0-a0"])
    rec.prompt(tasks["e0-i1-a0"])
    await rec.stop()
    assert [e.msg.task_id for e in read_entries(tmp_path / "run", "prompts")] == ["e0-i0-a0", "e0-i1-a0"]


async def test_exhausted_tasks_are_only_moved_to_the_dead_letters(tmp_path, bus, version):
    f = feeder(tmp_path, bus, version)
    bus.push_exhausted(DeadLetter(reason="not acknowledged after 5 deliveries (max_deliver)",
                                  original_subject=bus.subjects.prompts, payload=b"", consumer="producers"))
    bus.end_exhausted()
    await f.move_exhausted()
    assert bus.exhausted_calls == [(bus.subjects.prompts, "producers")]
    assert f.state.abandoned == 0  # re-issuing is reissue_dead_letters' job, from the letter on the stream


async def test_dead_lettered_tasks_are_reissued_once_by_name(tmp_path, bus, version):
    # A producer gave up on task 1 after its last delivery (no advisory), and the letter may be seen again after a
    # restart: it is re-issued exactly once. Garbage and other subjects' letters are skipped.
    f = feeder(tmp_path, bus, version)
    await f._release(2)
    task = bus.published[1][1]
    letter = DeadLetter(reason="producer p0: RewardError: boom", original_subject=bus.subjects.prompts,
                        payload=encode(task), num_delivered=5, consumer="producers")
    for msg in (letter, letter, DeadLetter(reason="x", original_subject=bus.subjects.prompts, payload=b"\xc1"),
                DeadLetter(reason="y", original_subject=bus.subjects.traj, payload=encode(task))):
        await bus.publish(bus.subjects.dead_letter, msg)
    await f.reissue_dead_letters()
    assert f.state.abandoned == 1 and f.state.reissues == [Reissue(index=1, epoch=0, attempt=1)]
    assert f.state.dead_lettered == ["e0-i1-a0"]
    restarted = feeder(tmp_path, bus, version)  # the state was saved with the abandon
    await restarted.reissue_dead_letters()  # reads every letter again from the start of the stream
    assert restarted.state.abandoned == 1
    await restarted._release(2)
    released = [m.task_id for subject, m, _ in bus.published if subject == bus.subjects.prompts]
    assert released == ["e0-i0-a0", "e0-i1-a0", "e0-i1-a1", "e0-i2-a0"]
