"""The bus client against a real nats-server: streams, de-duplication, redelivery, dead letters, sharing, watch, KV.

    .venv/bin/python -m pytest -q tests/integration/test_bus.py
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from contextlib import aclosing

import msgspec
import pytest
from nats.js.api import AckPolicy, RetentionPolicy, StorageType

from rlbus.bus.client import PUBLISH_TIMEOUT_S, Bus
from rlbus.bus.handover import Handover
from rlbus.bus.server import EmbeddedServer
from rlbus.schemas.config import BusConfig
from rlbus.schemas.errors import BusError
from rlbus.schemas.wire import (
    DEAD_LETTER_EXCERPT,
    ChatMessage,
    DeadLetter,
    PromptTask,
    SampleMeta,
    StepCompleted,
    TrajectoryGroup,
    Unacked,
    WeightsPublished,
    encode,
)


def _task(i: int) -> PromptTask:
    return PromptTask(task_id=f"task-{i}", prompt=[ChatMessage(role="user", content=f"{i}+1?")], n=4, index=i, created_at=1.0)


def _group(i: int) -> TrajectoryGroup:
    samples = [SampleMeta(key=f"g{i}/{j}", prompt_len=5, response_len=9, reward=1.0) for j in range(4)]
    return TrajectoryGroup(group_id=f"g{i}", task_id=f"task-{i}", producer_id="p0", samples=samples, created_at=1.0)


async def _bus(cfg: BusConfig, run: str, name: str = "test") -> Bus:
    bus = await Bus.connect(cfg, run, name)
    await bus.ensure_streams()
    return bus


async def test_ensure_streams_is_idempotent_and_as_designed(bus_config: BusConfig, run_name: str) -> None:
    async with await Bus.connect(bus_config, run_name) as a, await Bus.connect(bus_config, run_name) as b:
        await asyncio.gather(a.ensure_streams(), b.ensure_streams())  # two processes racing
        await a.ensure_streams()
        s = a.subjects
        prompts = await a.js.stream_info(s.prompts_stream)
        assert prompts.config.retention == RetentionPolicy.WORK_QUEUE
        assert prompts.config.storage == StorageType.FILE
        assert prompts.config.duplicate_window and prompts.config.duplicate_window > 0
        for name in (s.traj_stream, s.weights_stream, s.events_stream):
            info = await a.js.stream_info(name)
            assert info.config.retention == RetentionPolicy.LIMITS, name
            assert info.config.storage == StorageType.FILE, name
        pc = await a.js.consumer_info(s.prompts_stream, s.prompts_consumer)
        assert pc.config.ack_policy == AckPolicy.EXPLICIT
        assert pc.config.ack_wait == bus_config.ack_wait_s and pc.config.max_deliver == bus_config.max_deliver
        tc = await a.js.consumer_info(s.traj_stream, s.traj_consumer)
        assert tc.config.ack_policy == AckPolicy.EXPLICIT and tc.config.max_deliver in (None, -1)
        assert (await a.js.stream_info(f"KV_{s.weights_bucket}")).config.max_msgs_per_subject == 1

    # A later process with a changed ack_wait updates the durable instead of failing.
    changed = msgspec.structs.replace(bus_config, ack_wait_s=7.0)
    async with await _bus(changed, run_name) as c:
        pc = await c.js.consumer_info(c.subjects.prompts_stream, c.subjects.prompts_consumer)
        assert pc.config.ack_wait == 7.0


async def test_duplicate_msg_id_is_dropped(bus_config: BusConfig, run_name: str) -> None:
    async with await _bus(bus_config, run_name) as bus:
        first = await bus.publish(bus.subjects.traj, _group(1), msg_id="g1")
        again = await bus.publish(bus.subjects.traj, _group(1), msg_id="g1")
        other = await bus.publish(bus.subjects.traj, _group(2), msg_id="g2")
        assert not first.duplicate and again.duplicate and not other.duplicate
        assert again.seq == first.seq
        assert await bus.stream_msgs(bus.subjects.traj_stream) == 2
        got = await bus.fetch(bus.subjects.traj, bus.subjects.traj_consumer, TrajectoryGroup, batch=10, timeout=1.0)
        assert [d.msg_id for d in got] == ["g1", "g2"]
        assert [d.data for d in got] == [_group(1), _group(2)]


async def test_unacked_message_is_redelivered_after_ack_wait(bus_config: BusConfig, run_name: str) -> None:
    cfg = msgspec.structs.replace(bus_config, ack_wait_s=1.0)
    async with await _bus(cfg, run_name) as bus:
        s = bus.subjects
        await bus.publish(s.prompts, _task(1), msg_id="task-1")
        (d,) = await bus.fetch(s.prompts, s.prompts_consumer, PromptTask, batch=1, timeout=1.0)
        assert d.num_delivered == 1 and d.data.task_id == "task-1"
        assert await bus.consumer_pending(s.prompts_stream, s.prompts_consumer) == (0, 1)
        # Not acked: nothing else to fetch until ack_wait expires, then the same task comes back.
        t0 = time.monotonic()
        again: list = []
        while not again and time.monotonic() - t0 < 10:
            again = await bus.fetch(s.prompts, s.prompts_consumer, PromptTask, batch=1, timeout=0.5)
        assert time.monotonic() - t0 >= 0.5
        assert len(again) == 1 and again[0].data.task_id == "task-1" and again[0].num_delivered == 2
        await again[0].ack()
        assert await bus.consumer_pending(s.prompts_stream, s.prompts_consumer) == (0, 0)
        assert await bus.stream_msgs(s.prompts_stream) == 0  # work queue: an acked task leaves the stream


async def test_in_progress_holds_a_message_past_ack_wait(bus_config: BusConfig, run_name: str) -> None:
    cfg = msgspec.structs.replace(bus_config, ack_wait_s=1.0)
    async with await _bus(cfg, run_name) as bus:
        s = bus.subjects
        await bus.publish(s.prompts, _task(1))
        (d,) = await bus.fetch(s.prompts, s.prompts_consumer, PromptTask, timeout=1.0)
        for _ in range(4):  # 2 s of "generation", more than ack_wait, kept alive by in_progress
            await asyncio.sleep(0.5)
            await d.in_progress()
        assert await bus.fetch(s.prompts, s.prompts_consumer, PromptTask, timeout=0.3) == []
        await d.ack()


async def test_nak_with_delay_redelivers_later(bus_config: BusConfig, run_name: str) -> None:
    async with await _bus(bus_config, run_name) as bus:
        s = bus.subjects
        await bus.publish(s.prompts, _task(5))
        (d,) = await bus.fetch(s.prompts, s.prompts_consumer, PromptTask, timeout=1.0)
        t0 = time.monotonic()
        await d.nak(delay=1.5)
        assert await bus.fetch(s.prompts, s.prompts_consumer, PromptTask, timeout=0.5) == []
        again: list = []
        while not again and time.monotonic() - t0 < 10:
            again = await bus.fetch(s.prompts, s.prompts_consumer, PromptTask, timeout=0.5)
        assert time.monotonic() - t0 >= 1.2
        assert again[0].data.task_id == "task-5" and again[0].num_delivered == 2
        await again[0].ack()


async def test_a_successor_naks_what_a_dead_consumer_held_and_it_comes_back_at_once(bus_config: BusConfig,
                                                                                      run_name: str) -> None:
    # ack_wait of a minute: without the naks nothing would come back within this test.
    cfg = msgspec.structs.replace(bus_config, ack_wait_s=60.0)
    dead = await _bus(cfg, run_name, "dead")
    s = dead.subjects
    for i in range(3):
        await dead.publish(s.traj, _group(i), msg_id=f"g{i}")
    await dead.publish(s.prompts, _task(9))
    held = await dead.fetch(s.traj, s.traj_consumer, TrajectoryGroup, batch=3, timeout=2.0)
    (task,) = await dead.fetch(s.prompts, s.prompts_consumer, PromptTask, timeout=2.0)
    replies = [d.reply for d in held]
    await dead.close()  # gone without settling anything, as a SIGKILLed role
    async with await _bus(cfg, run_name, "successor") as bus:
        assert await bus.fetch(s.traj, s.traj_consumer, TrajectoryGroup, batch=3, timeout=0.5) == []
        # Only the traj consumer's ack subjects are sent to: not another consumer's, not any other subject.
        sent = await bus.nak_replies(s.traj, s.traj_consumer, [*replies, task.reply, f"{s.traj}.x", "$JS.API.>"])
        assert sent == 3
        t0 = time.monotonic()
        back: list = []
        while len(back) < 3 and time.monotonic() - t0 < 10:
            back += await bus.fetch(s.traj, s.traj_consumer, TrajectoryGroup, batch=3, timeout=1.0)
        assert sorted(d.data.group_id for d in back) == ["g0", "g1", "g2"] and all(d.num_delivered == 2 for d in back)
        for d in back:
            await d.ack()
        # The prompt's delivery was not named: it waits for its ack_wait.
        assert await bus.fetch(s.prompts, s.prompts_consumer, PromptTask, timeout=0.5) == []
        # A second nak of settled deliveries changes nothing.
        assert await bus.nak_replies(s.traj, s.traj_consumer, replies) == 3
        assert await bus.fetch(s.traj, s.traj_consumer, TrajectoryGroup, timeout=0.5) == []


async def test_a_successor_on_another_machine_takes_over_from_the_kv_bucket(bus_config: BusConfig, run_name: str,
                                                                             tmp_path) -> None:
    """The trainer's list is shared in the run's KV bucket: a successor whose run directory holds no file (another
    machine) naks what its predecessor held, and the groups come back at once, not after ack_wait."""
    cfg = msgspec.structs.replace(bus_config, ack_wait_s=60.0)
    dead = await _bus(cfg, run_name, "dead")
    s = dead.subjects
    for i in range(2):
        await dead.publish(s.traj, _group(i), msg_id=f"g{i}")
    held = await dead.fetch(s.traj, s.traj_consumer, TrajectoryGroup, batch=2, timeout=2.0)
    mine = Handover(tmp_path / "here" / "trainer-unacked.json", dead, s.traj, s.traj_consumer,
                    key="unacked.trainer", role="trainer")
    (tmp_path / "here").mkdir()
    mine.save(d.reply for d in held)
    await mine.share()
    await dead.close()  # gone without settling anything, as a SIGKILLed role
    async with await _bus(cfg, run_name, "successor") as bus:
        elsewhere = Handover(tmp_path / "there" / "trainer-unacked.json", bus, s.traj, s.traj_consumer,
                             key="unacked.trainer", role="trainer")
        assert not elsewhere.path.exists()
        assert await elsewhere.take_over() == 2
        t0 = time.monotonic()
        back: list = []
        while len(back) < 2 and time.monotonic() - t0 < 10:
            back += await bus.fetch(s.traj, s.traj_consumer, TrajectoryGroup, batch=2, timeout=1.0)
        assert sorted(d.data.group_id for d in back) == ["g0", "g1"]
        for d in back:
            await d.ack()
        # Its own first save replaces the shared list: a later successor naks nothing stale.
        elsewhere.save([])
        await elsewhere.share()
        assert (await bus.kv_get("unacked.trainer", Unacked)).replies == []


async def test_garbage_is_dead_lettered_and_consumer_goes_on(bus_config: BusConfig, run_name: str) -> None:
    async with await _bus(bus_config, run_name) as bus:
        s = bus.subjects
        await bus.publish_raw(s.traj, b"\x00not msgpack at all")
        await bus.publish(s.traj, _group(2))
        async with aclosing(bus.pull(s.traj, s.traj_consumer, TrajectoryGroup, batch=4, timeout=0.5)) as it:
            d = await asyncio.wait_for(it.__anext__(), 10)
        assert d.data == _group(2)
        await d.ack()
        # The garbage was terminated (not pending, never redelivered) and recorded with why.
        assert await bus.consumer_pending(s.traj_stream, s.traj_consumer) == (0, 0)
        async with aclosing(bus.watch(s.dead_letter, DeadLetter, deliver="all")) as letters:
            letter = await asyncio.wait_for(letters.__anext__(), 10)
        assert letter.payload == b"\x00not msgpack at all"
        assert letter.original_subject == s.traj and letter.consumer == s.traj_consumer
        assert letter.stream_seq == 1 and letter.num_delivered == 1
        assert "TrajectoryGroup" in letter.reason


async def test_garbage_near_the_size_limit_is_dead_lettered_as_an_excerpt(bus_config: BusConfig, run_name: str) -> None:
    # ~1 MiB of garbage, under the server's message limit: the whole of it plus the letter's fields would not be.
    garbage = b"\xc1" + bytes(range(256)) * (1_000_000 // 256)
    async with await _bus(bus_config, run_name) as bus:
        s = bus.subjects
        await bus.publish_raw(s.traj, garbage)
        await bus.publish(s.traj, _group(3))
        async with aclosing(bus.pull(s.traj, s.traj_consumer, TrajectoryGroup, batch=4, timeout=0.5)) as it:
            d = await asyncio.wait_for(it.__anext__(), 10)
        assert d.data == _group(3)  # the consumer went on
        await d.ack()
        assert await bus.consumer_pending(s.traj_stream, s.traj_consumer) == (0, 0)  # the garbage was terminated
        async with aclosing(bus.watch(s.dead_letter, DeadLetter, deliver="all")) as letters:
            letter = await asyncio.wait_for(letters.__anext__(), 10)
        assert letter.payload == garbage[:DEAD_LETTER_EXCERPT] and letter.payload_bytes == len(garbage)
        assert letter.stream_seq == 1 and letter.original_subject == s.traj


async def test_caller_dead_letters_a_delivery(bus_config: BusConfig, run_name: str) -> None:
    async with await _bus(bus_config, run_name) as bus:
        s = bus.subjects
        await bus.publish(s.prompts, _task(9))
        (d,) = await bus.fetch(s.prompts, s.prompts_consumer, PromptTask, timeout=1.0)
        await d.dead_letter("max_deliver reached")
        assert await bus.stream_msgs(s.prompts_stream) == 0
        async with aclosing(bus.watch(s.dead_letter, DeadLetter, deliver="all")) as letters:
            letter = await asyncio.wait_for(letters.__anext__(), 10)
        assert letter.reason == "max_deliver reached"
        assert letter.payload == encode(_task(9)) and letter.consumer == s.prompts_consumer


async def test_two_pullers_share_a_durable(bus_config: BusConfig, run_name: str) -> None:
    async with await _bus(bus_config, run_name) as bus:
        s = bus.subjects
        num_tasks = 30
        for i in range(num_tasks):
            await bus.publish(s.prompts, _task(i), msg_id=f"task-{i}")
        seen: dict[str, list[str]] = {"a": [], "b": []}
        done = asyncio.Event()

        async def worker(name: str) -> None:
            async with aclosing(bus.pull(s.prompts, s.prompts_consumer, PromptTask, batch=1, timeout=0.2)) as it:
                async for d in it:
                    seen[name].append(d.data.task_id)
                    await d.ack()
                    if len(seen["a"]) + len(seen["b"]) >= num_tasks:
                        done.set()
                    await asyncio.sleep(0.01)  # "work", so the other worker's fetches get their turn

        tasks = [asyncio.create_task(worker(n)) for n in seen]
        await asyncio.wait_for(done.wait(), 30)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert sorted(seen["a"] + seen["b"]) == sorted(f"task-{i}" for i in range(num_tasks))  # each exactly once
        assert seen["a"] and seen["b"]


async def test_watch_sees_new_weights(bus_config: BusConfig, run_name: str) -> None:
    async with await _bus(bus_config, run_name) as bus:
        s = bus.subjects
        old = WeightsPublished(version=1, step=1, num_bytes=10, checksum="a")
        new = WeightsPublished(version=2, step=2, num_bytes=10, checksum="b")
        await bus.publish(s.weights, old)
        async with aclosing(bus.watch(s.weights, WeightsPublished, deliver="new")) as it:
            nxt = asyncio.create_task(it.__anext__())
            await asyncio.sleep(0.5)  # let the ordered consumer start before the publish
            await bus.publish(s.weights, new)
            assert (await asyncio.wait_for(nxt, 10)).version == 2
        async with aclosing(bus.watch(s.weights, WeightsPublished, deliver="all")) as it:
            assert [(await it.__anext__()).version for _ in range(2)] == [1, 2]
        async with aclosing(bus.watch(s.weights, WeightsPublished, deliver="last")) as it:
            assert (await asyncio.wait_for(it.__anext__(), 10)).version == 2


async def test_kv_put_get(bus_config: BusConfig, run_name: str) -> None:
    async with await _bus(bus_config, run_name) as bus:
        assert await bus.kv_get("latest", WeightsPublished) is None
        await bus.kv_put("latest", WeightsPublished(version=1, step=1, num_bytes=1, checksum="a"))
        await bus.kv_put("latest", WeightsPublished(version=3, step=3, num_bytes=1, checksum="c"))
    # A late joiner (new connection) reads the newest.
    async with await Bus.connect(bus_config, run_name) as late:
        got = await late.kv_get("latest", WeightsPublished)
        assert got is not None and got.version == 3 and got.checksum == "c"


async def test_publish_event_routes_by_kind(bus_config: BusConfig, run_name: str) -> None:
    async with await _bus(bus_config, run_name) as bus:
        ack = await bus.publish_event(StepCompleted(step=1, version=1, group_ids=["g1"]))
        assert ack.stream == bus.subjects.events_stream
        async with aclosing(bus.watch(bus.subjects.event("step"), StepCompleted, deliver="all")) as it:
            assert (await asyncio.wait_for(it.__anext__(), 10)).group_ids == ["g1"]


async def test_a_task_never_acked_within_max_deliver_is_dead_lettered_even_if_nobody_listened_then(
        bus_config: BusConfig, run_name: str) -> None:
    cfg = msgspec.structs.replace(bus_config, ack_wait_s=1.0, max_deliver=2)
    async with await _bus(cfg, run_name) as bus:
        s = bus.subjects
        await bus.publish(s.prompts, _task(7), msg_id="task-7")
        for _ in range(2):  # two producers that die holding it: delivered, never acked
            got = []
            while not got:
                got = await bus.fetch(s.prompts, s.prompts_consumer, PromptTask, timeout=2.0)
            assert got[0].data.task_id == "task-7"
        # The server notices the exhausted message when it would redeliver it: producers keep fetching meanwhile.
        assert await bus.fetch(s.prompts, s.prompts_consumer, PromptTask, timeout=3.0) == []
        # Nobody listened when the advisory was sent (the trainer down): it waited in the advisories stream.
        deadline = asyncio.get_running_loop().time() + 15
        while await bus.stream_msgs(s.advisories_stream) == 0:
            assert asyncio.get_running_loop().time() < deadline, "no advisory captured"
            await asyncio.sleep(0.2)
        async with aclosing(bus.exhausted(s.prompts, s.prompts_consumer)) as exhausted:
            letter = await asyncio.wait_for(exhausted.__anext__(), timeout=15)
        assert await bus.stream_msgs(s.advisories_stream) == 0  # handled, so acked out of its queue
        assert letter.original_subject == s.prompts and letter.num_delivered == 2
        assert msgspec.msgpack.decode(letter.payload, type=PromptTask).task_id == "task-7"
        assert await bus.stream_msgs(s.prompts_stream) == 0  # out of the work queue, not stuck in it
        async with aclosing(bus.watch(s.dead_letter, DeadLetter, deliver="all")) as letters:
            stored = await asyncio.wait_for(letters.__anext__(), timeout=5)
        assert "max_deliver" in stored.reason


async def test_snapshot_reads_what_is_there_and_stops(bus_config: BusConfig, run_name: str) -> None:
    from rlbus.schemas.wire import ProducerHeartbeat

    async with await _bus(bus_config, run_name) as bus:
        s = bus.subjects
        assert await bus.snapshot(s.event("step"), StepCompleted) == []  # nothing yet: returns at once
        for i in range(3):
            await bus.publish(s.event("step"), StepCompleted(step=i + 1, version=i + 1, group_ids=[]))
        for beat in range(3):
            for pid in ("p0", "p1"):
                await bus.publish(s.event(f"heartbeat.{pid}"),
                                  ProducerHeartbeat(producer_id=pid, version=beat, groups_done=beat))
        assert [e.step for e in await bus.snapshot(s.event("step"), StepCompleted)] == [1, 2, 3]
        assert [e.step for e in await bus.snapshot(s.event("step"), StepCompleted, deliver="last")] == [3]
        last = await bus.snapshot(s.event("heartbeat.*"), ProducerHeartbeat, deliver="last_per_subject")
        assert sorted((b.producer_id, b.groups_done) for b in last) == [("p0", 2), ("p1", 2)]


async def test_a_stopping_role_with_its_server_gone_spends_one_retry_budget_not_one_per_call(tmp_path) -> None:
    # Its launcher killed with the embedded server, a role shuts down: every ack and event of its shutdown would
    # retry for bus.retry_s (here 20 s each). Once stopping, they share a budget (2 s here), and then fail at once.
    server = EmbeddedServer(tmp_path / "bus", port=0, host="127.0.0.1", runs=["gone"]).start()
    cfg = BusConfig(url=server.url, creds_file=str(server.creds_file("admin", "gone")), connect_timeout_s=5.0,
                    retry_s=20.0)
    bus = await _bus(cfg, "gone")
    try:
        bus.stopping(budget_s=2.0)
        ack = await bus.publish(bus.subjects.prompts, _task(0), msg_id="task-0")  # a healthy bus: not hurried
        assert ack.seq == 1
        os.kill(server.pid, signal.SIGKILL)  # the server this test started, by pid
        server.stop()
        loop = asyncio.get_running_loop()
        spent = []
        for i in range(1, 4):
            t0 = loop.time()
            with pytest.raises(BusError):
                await bus.publish(bus.subjects.prompts, _task(i), msg_id=f"task-{i}")
            spent.append(loop.time() - t0)
        assert spent[0] < 2.0 + PUBLISH_TIMEOUT_S + 1.0, spent  # the budget, plus the attempt in flight at its end
        assert sum(spent[1:]) < 1.0, spent  # then nothing more is waited for
    finally:
        await bus.close(timeout=1.0)
        server.stop()
