"""Least privilege on the bus: per-role users per run (bus/auth.py) against a real nats-server.

Each role does what it does through the real Bus client, and what it must not do is tried with a raw nats-py client
holding the same credential, the way a leaked credential or a buggy script would.

    .venv/bin/python -m pytest -q tests/integration/test_bus_auth.py
"""

from __future__ import annotations

import asyncio
import json
import stat
import time
from typing import Iterator

import nats
import pytest

from rlbus.bus.auth import ROLES, load_creds
from rlbus.bus.client import Bus
from rlbus.bus.handover import Handover, producer_key
from rlbus.bus.server import EmbeddedServer
from rlbus.schemas.config import BusConfig
from rlbus.schemas.errors import BusError
from rlbus.schemas.wire import (
    ChatMessage,
    ProducerHeartbeat,
    PromptTask,
    SampleMeta,
    StepCompleted,
    TrajectoryGroup,
    Unacked,
    WeightsPublished,
    encode,
)

RUNS = ("alpha", "beta")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServer]:
    srv = EmbeddedServer(tmp_path_factory.mktemp("auth") / "bus", runs=list(RUNS)).start()
    try:
        yield srv
    finally:
        srv.stop()


def cfg(server: EmbeddedServer, role: str, run: str = "alpha") -> BusConfig:
    return BusConfig(url=server.url, creds_file=str(server.creds_file(role, run)), connect_timeout_s=5.0)


class Raw:
    """A plain nats-py client with a role's credential; collects the server's permission errors."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.nc: nats.NATS | None = None

    @classmethod
    async def connect(cls, server: EmbeddedServer, role: str, run: str = "alpha") -> "Raw":
        raw = cls()
        creds = load_creds(server.creds_file(role, run))

        async def on_error(e: Exception) -> None:
            raw.errors.append(str(e))

        raw.nc = await nats.connect(server.url, user=creds["user"], password=creds["password"],
                                    inbox_prefix=creds["inbox_prefix"], error_cb=on_error, allow_reconnect=False)
        return raw

    async def refused_publish(self, subject: str, payload: bytes = b"x") -> bool:
        """True when the server refuses the publish (a permissions violation, no stream ack)."""
        before = len(self.errors)
        try:
            await self.nc.request(subject, payload, timeout=1.0)
            return False  # someone (JetStream) answered: it went through
        except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
            pass
        for _ in range(20):
            if len(self.errors) > before:
                break
            await asyncio.sleep(0.05)
        return any("permissions violation" in e.lower() for e in self.errors[before:])

    async def refused_subscribe(self, subject: str) -> bool:
        before = len(self.errors)
        await self.nc.subscribe(subject)
        await self.nc.flush()
        for _ in range(20):
            if len(self.errors) > before:
                break
            await asyncio.sleep(0.05)
        return any("permissions violation" in e.lower() for e in self.errors[before:])

    async def close(self) -> None:
        await self.nc.close()


def _weights(version: int) -> WeightsPublished:
    return WeightsPublished(version=version, step=version, num_bytes=1, checksum="c", num_tensors=1, dtype="float32",
                            store="alpha")


async def test_each_role_does_its_job(server):
    trainer = await Bus.connect(cfg(server, "trainer"), "alpha", name="trainer")
    producer = await Bus.connect(cfg(server, "producer"), "alpha", name="producer")
    observer = await Bus.connect(cfg(server, "observer"), "alpha", name="observer")
    try:
        await trainer.ensure_streams()  # the trainer may create the run's streams; producers wait for them
        await producer.await_streams(timeout=10)
        task = PromptTask(task_id="e0-i0-a0", prompt=[ChatMessage(role="user", content="17*23?")])
        await trainer.publish(trainer.subjects.prompts, task, msg_id=task.task_id)
        await trainer.publish(trainer.subjects.weights, _weights(1), msg_id="w1")
        await trainer.kv_put("latest", _weights(1))
        (delivery,) = await producer.fetch(producer.subjects.prompts, producer.subjects.prompts_consumer, PromptTask,
                                           batch=1, timeout=5)
        await delivery.in_progress()
        group = TrajectoryGroup(group_id=task.task_id, task_id=task.task_id, producer_id="p0",
                                samples=[SampleMeta(key="e0-i0-a0/d1/0", prompt_len=3, response_len=2, reward=1.0)])
        await producer.publish(producer.subjects.traj, group, msg_id=group.group_id)
        await delivery.ack()
        await producer.publish(producer.subjects.event("heartbeat.p0"), ProducerHeartbeat(
            producer_id="p0", version=1, host="h", pid=1, status="running", groups_done=1, tokens_generated=2,
            groups_per_min=1.0, inflight=0))
        assert (await producer.kv_get("latest", WeightsPublished)).version == 1
        seen = []
        async for w in producer.watch(producer.subjects.weights, WeightsPublished, deliver="last"):
            seen.append(w.version)
            break
        assert seen == [1]
        (traj,) = await trainer.fetch(trainer.subjects.traj, trainer.subjects.traj_consumer, TrajectoryGroup,
                                      batch=1, timeout=5)
        assert traj.data.group_id == task.task_id
        await traj.ack()
        await trainer.publish_event(StepCompleted(step=1, version=1, group_ids=[task.task_id]))
        # the observer reads all of it (rlbus status, events --follow)
        await observer.await_streams(timeout=10)
        steps = await observer.snapshot(observer.subjects.event("step"), StepCompleted)
        assert [s.step for s in steps] == [1]
        beats = await observer.snapshot(observer.subjects.event("heartbeat.*"), ProducerHeartbeat,
                                        deliver="last_per_subject")
        assert [b.producer_id for b in beats] == ["p0"]
        assert (await observer.kv_get("latest", WeightsPublished)).version == 1
        assert await observer.consumer_pending(observer.subjects.prompts_stream, observer.subjects.prompts_consumer) \
            == (0, 0)
        assert await observer.stream_msgs(observer.subjects.traj_stream) == 1
    finally:
        for b in (trainer, producer, observer):
            await b.close()


async def test_producer_cannot_announce_weights_nor_manage_streams(server):
    s = (await Bus.connect(cfg(server, "admin"), "alpha", name="admin"))
    await s.ensure_streams()
    subjects = s.subjects
    await s.close()
    raw = await Raw.connect(server, "producer")
    try:
        # the control: what a producer does is answered by JetStream
        assert not await raw.refused_publish(subjects.event("heartbeat.p9"), encode(ProducerHeartbeat(
            producer_id="p9", version=0, host="h", pid=1, status="running", groups_done=0, tokens_generated=0,
            groups_per_min=0.0, inflight=0)))
        assert await raw.refused_publish(subjects.weights, encode(_weights(9999)))  # the forged announcement
        assert await raw.refused_publish(subjects.prompts)
        assert await raw.refused_publish(f"$KV.{subjects.weights_bucket}.latest", encode(_weights(9999)))
        # Its own unacked list it may keep in the bucket (a producer's key), the trainer's it may not touch.
        unacked = encode(Unacked(role="producer", consumer=subjects.prompts_consumer, replies=[]))
        assert not await raw.refused_publish(f"$KV.{subjects.weights_bucket}.{producer_key('p9')}", unacked)
        assert await raw.refused_publish(f"$KV.{subjects.weights_bucket}.unacked.trainer", unacked)
        assert await raw.refused_publish(f"$JS.API.STREAM.DELETE.{subjects.events_stream}")
        assert await raw.refused_publish(f"$JS.API.STREAM.PURGE.{subjects.traj_stream}")
        assert await raw.refused_publish(f"$JS.API.CONSUMER.DELETE.{subjects.prompts_stream}.{subjects.prompts_consumer}")
        assert await raw.refused_subscribe("_INBOX.alpha.trainer.>")  # another role's replies
        assert await raw.refused_subscribe(f"{subjects.prefix}.>")
    finally:
        await raw.close()


async def test_observer_cannot_publish_anything(server):
    admin = await Bus.connect(cfg(server, "admin"), "alpha", name="admin")
    await admin.ensure_streams()
    subjects = admin.subjects
    await admin.close()
    raw = await Raw.connect(server, "observer")
    try:
        for subject in (subjects.prompts, subjects.traj, subjects.weights, subjects.event("step"),
                        subjects.event("heartbeat.p0"), subjects.dead_letter, f"$KV.{subjects.weights_bucket}.latest",
                        f"$JS.API.STREAM.DELETE.{subjects.events_stream}",
                        f"$JS.API.STREAM.UPDATE.{subjects.events_stream}",
                        f"$JS.ACK.{subjects.prompts_stream}.{subjects.prompts_consumer}.1.1.1.1.0"):
            assert await raw.refused_publish(subject), subject
    finally:
        await raw.close()


async def test_a_producer_restarted_elsewhere_takes_over_its_tasks_from_the_kv_bucket(server, tmp_path):
    """With a producer's credential, a producer keeps its unacked list in the run's KV bucket as well as in a file
    (bus/handover.py, key unacked.producer.<id>): a successor under the same id whose run directory holds no file
    (another machine) naks its predecessor's task, which comes back at once instead of after ack_wait (60 s)."""
    trainer = await Bus.connect(cfg(server, "trainer", "beta"), "beta", name="trainer-beta")
    try:
        await trainer.ensure_streams()
        task = PromptTask(task_id="e0-i5-a0", prompt=[ChatMessage(role="user", content="5*5?")])
        await trainer.publish(trainer.subjects.prompts, task, msg_id=task.task_id)
    finally:
        await trainer.close()
    s = trainer.subjects

    def handover(bus: Bus, where: str) -> Handover:
        (tmp_path / where).mkdir(exist_ok=True)
        return Handover(tmp_path / where / "producer-p7-unacked.json", bus, s.prompts, s.prompts_consumer,
                        key=producer_key("p7"), role="producer")

    dead = await Bus.connect(cfg(server, "producer", "beta"), "beta", name="producer-p7")
    (held,) = await dead.fetch(s.prompts, s.prompts_consumer, PromptTask, batch=1, timeout=5)
    mine = handover(dead, "here")
    mine.save([held.reply])
    await mine.share()
    await dead.close()  # gone without settling, as a SIGKILLed producer
    successor = await Bus.connect(cfg(server, "producer", "beta"), "beta", name="producer-p7")
    try:
        elsewhere = handover(successor, "there")
        assert not elsewhere.path.exists()
        assert await elsewhere.take_over() == 1
        t0, back = time.monotonic(), []
        while not back and time.monotonic() - t0 < 10:
            back = await successor.fetch(s.prompts, s.prompts_consumer, PromptTask, batch=1, timeout=1.0)
        assert [d.data.task_id for d in back] == [task.task_id] and back[0].num_delivered == 2
        assert time.monotonic() - t0 < 10  # not ack_wait
        await back[0].ack()
        elsewhere.save([])
        await elsewhere.share()
        assert (await successor.kv_get(producer_key("p7"), Unacked)).replies == []
    finally:
        await successor.close()


@pytest.mark.slow
async def test_trainer_cannot_delete_streams_or_touch_another_run(server):
    beta = await Bus.connect(cfg(server, "trainer", "beta"), "beta", name="trainer-beta")
    await beta.ensure_streams()
    await beta.publish_event(StepCompleted(step=1, version=1, group_ids=["secret"]))
    beta_subjects = beta.subjects
    await beta.close()
    raw = await Raw.connect(server, "trainer", "alpha")
    try:
        assert await raw.refused_publish(f"$JS.API.STREAM.DELETE.{beta_subjects.events_stream}")
        assert await raw.refused_publish("$JS.API.STREAM.DELETE.RLBUS_ALPHA_EVENTS")
        assert await raw.refused_publish(f"$JS.API.CONSUMER.CREATE.{beta_subjects.events_stream}")
        assert await raw.refused_publish(f"$JS.API.STREAM.MSG.GET.{beta_subjects.events_stream}", b'{"seq": 1}')
        assert await raw.refused_publish(beta_subjects.weights)
        assert await raw.refused_subscribe(f"{beta_subjects.prefix}.>")
    finally:
        await raw.close()
    # and through the Bus client: reading beta's stream with alpha's trainer fails
    alpha = await Bus.connect(cfg(server, "trainer", "alpha"), "beta", name="trainer-alpha-on-beta")
    try:
        with pytest.raises(Exception):
            await alpha.snapshot(beta_subjects.event("step"), StepCompleted, timeout=3)
    finally:
        await alpha.close()


def test_secrets_at_rest(server):
    store = server.store_dir
    conf = (store / "nats-server.conf").read_text()
    for run in RUNS:
        run_dir = store / "creds" / run
        assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
        assert stat.S_IMODE((store / "creds").stat().st_mode) == 0o700
        for role in ROLES:
            path = server.creds_file(role, run)
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
            creds = json.loads(path.read_text())
            assert creds["role"] == role and creds["run"] == run and creds["url"] == server.url
            assert creds["password"] not in conf  # the server holds only bcrypt hashes
    assert conf.count('"$2b$') == len(RUNS) * len(ROLES)
    assert stat.S_IMODE((store / "nats-server.conf").stat().st_mode) == 0o600
    assert stat.S_IMODE(store.stat().st_mode) == 0o700


async def test_restarted_server_keeps_every_role_credential(tmp_path):
    srv = EmbeddedServer(tmp_path / "bus", runs=["alpha"]).start()
    before = {r: load_creds(srv.creds_file(r))["password"] for r in ROLES}
    srv.stop()
    srv = EmbeddedServer(tmp_path / "bus", runs=["alpha"]).start()
    try:
        assert {r: load_creds(srv.creds_file(r))["password"] for r in ROLES} == before
        bus = await Bus.connect(cfg(srv, "observer"), "alpha", name="after-restart")
        await bus.close()
    finally:
        srv.stop()
    conf = (srv.store_dir / "nats-server.conf").read_text()
    assert not any(p in conf for p in before.values())


BEAT = ProducerHeartbeat(producer_id="p9", version=1, host="h", pid=1, status="running", groups_done=1,
                         tokens_generated=2, groups_per_min=1.0, inflight=0)  # fmt: skip


async def _producer_and_observer(server: EmbeddedServer) -> tuple[Bus, Bus]:
    """Run alpha's streams made (by the admin), and a producer's and an observer's connection to them."""
    async with await Bus.connect(cfg(server, "admin"), "alpha", name="admin") as admin:
        await admin.ensure_streams()
    return (await Bus.connect(cfg(server, "producer"), "alpha", name="producer"),
            await Bus.connect(cfg(server, "observer"), "alpha", name="observer"))  # fmt: skip


async def test_an_observer_watching_past_a_bad_message_is_not_held_up_by_its_dead_letter(server):
    # A malformed heartbeat (the nemesis publishes one with a producer credential): the observer may not publish the
    # dead letter its watch records, and a refused publish is retried for bus.retry_s (30 s). The watch must go on to
    # the next heartbeat at once, not after that budget.
    producer, observer = await _producer_and_observer(server)
    beat = BEAT
    try:
        await observer.await_streams(timeout=10)
        subject = observer.subjects.event("heartbeat.p9")
        seen = []
        started = asyncio.get_running_loop().time()
        async with asyncio.timeout(15):
            watch = observer.watch(observer.subjects.event("heartbeat.*"), ProducerHeartbeat, deliver="new")
            reading = asyncio.ensure_future(anext(watch))
            await asyncio.sleep(1.0)  # the ordered consumer is up
            await producer.publish_raw(subject, b"\x00 not a heartbeat")
            await producer.publish(subject, beat)
            seen.append(await reading)
            await watch.aclose()
        took = asyncio.get_running_loop().time() - started
        assert seen[0].producer_id == "p9" and took < 10, took
    finally:
        for b in (producer, observer):
            await b.close()


async def test_a_publish_the_server_refuses_fails_at_once_naming_the_refusal(server):
    """A publish refused for lack of permission gets no ack, like one lost in an outage; it is not retried for
    bus.retry_s (30 s) but fails at its second attempt (its first times out after 5 s) with the server's reason. The
    next allowed publish on the same connection goes through."""
    producer, observer = await _producer_and_observer(server)
    beat = BEAT
    try:
        await observer.await_streams(timeout=10)
        loop = asyncio.get_running_loop()
        for _ in range(2):  # a second refusal is caught as well (each publish starts with a clean record)
            started = loop.time()
            with pytest.raises(BusError, match="refused.*permissions violation.*may not publish there"):
                await observer.publish(observer.subjects.event("heartbeat.p9"), beat)
            assert loop.time() - started < 0.5 * observer.cfg.retry_s, loop.time() - started
        assert (await producer.publish(producer.subjects.event("heartbeat.p9"), beat)).seq > 0
    finally:
        for b in (observer, producer):
            await b.close()
