"""The producer service in-process against a real nats-server and Ray: the order of a task's life.

    .venv/bin/python -m pytest -q tests/integration/test_producer.py

A producer that dies after publishing a group but before acking its task (simulated here by an ack that fails) gets
the task redelivered; the redo's publish is de-duplicated, and the group on the bus must still point at tensors
that match it -- the redo's tensors are deleted, the first delivery's stay.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import torch

from rlbus.bus.client import Bus
from rlbus.bus.transfer_queue import TransferQueue
from rlbus.bus.weight_store import WeightStore
from rlbus.producers.service import Producer
from rlbus.schemas.config_io import from_dict
from rlbus.schemas.wire import ChatMessage, DeadLetter, PromptTask, TrajectoryGroup, WeightsPublished


class DiesBeforeAck:
    """A delivery whose ack fails, as if the producer died right after publishing the group."""

    def __init__(self, delivery):
        self._delivery = delivery

    def __getattr__(self, name):
        return getattr(self._delivery, name)

    async def ack(self) -> None:
        raise ConnectionError("producer died between publish and ack")


class CountLost:
    """A redelivery the server numbers 1 again (a nats-server killed before it persisted the first delivery)."""

    num_delivered = 1

    def __init__(self, delivery):
        self._delivery = delivery

    def __getattr__(self, name):
        return getattr(self._delivery, name)


def _config(bus_config, creds_file: str, ray_address: str, tiny_model_dir, run_name: str):
    return from_dict({
        "name": run_name,
        "bus": {**msgspec.to_builtins(bus_config), "creds_file": creds_file, "ack_wait_s": 2.0},
        "ray": {"address": ray_address, "num_storage_actors": 1},
        "model": {"path": str(tiny_model_dir)},
        "rollout": {"n": 2, "agent_loop": "single_turn", "max_new_tokens": 8, "max_response_tokens": 8,
                    "engine": {"type": "simulated", "mean_tokens": 6, "seconds_per_token": 0.001}},
    })


async def _trainer_bus(bus_config, run_creds, run_name: str) -> Bus:
    """What the trainer does first: create the run's streams (a producer's credential may not)."""
    cfg = msgspec.structs.replace(bus_config, creds_file=run_creds["trainer"])
    bus = await Bus.connect(cfg, run_name, name="trainer")
    await bus.ensure_streams()
    return bus


@pytest.mark.parametrize("numbered", ["2", "1 again"])
async def test_a_redo_after_publish_keeps_the_announced_tensors(bus_config, run_creds, ray_address, tiny_model_dir,
                                                                run_name, numbered):
    trainer = await _trainer_bus(bus_config, run_creds, run_name)
    cfg = _config(bus_config, run_creds["producer"], ray_address, tiny_model_dir, run_name)
    producer = Producer(cfg, "p-test")
    await producer.start()
    try:
        bus: Bus = producer.bus
        s = bus.subjects
        task = PromptTask(task_id="e0-i7-a0", prompt=[ChatMessage(role="user", content="What is 2+3?")],
                          ground_truth="5", n=2, index=7)
        await trainer.publish(s.prompts, task, msg_id=task.task_id)

        first = (await bus.fetch(s.prompts, s.prompts_consumer, PromptTask, timeout=5.0))[0]
        await producer._handle(DiesBeforeAck(first))  # the group is published, the ack never happens

        second = []
        while not second:  # back after ack_wait (and the nak's delay)
            second = await bus.fetch(s.prompts, s.prompts_consumer, PromptTask, timeout=5.0)
        assert second[0].num_delivered == 2
        # "1 again": the redo's keys must still be its own (they were named by the delivery number alone, and the
        # surplus redo's put and delete then hit the announced group's tensors: found by the nemesis)
        await producer._handle(second[0] if numbered == "2" else CountLost(second[0]))

        groups = await trainer.snapshot(s.traj, TrajectoryGroup)  # the producer may not read traj
        assert len(groups) == 1, "the redo's publish was not de-duplicated"
        group = groups[0]
        assert all(k.startswith("e0-i7-a0/d1-p-test-") for k in group.keys)
        tq = TransferQueue.connect(run_name, cfg.ray)
        stored = await tq.get_list(group.keys)
        assert [t["response_ids"].numel() for t in stored] == [m.response_len for m in group.samples]
        assert (await tq.stats())["items"] == 2, "the redo's tensors were left behind"
        assert await bus.stream_msgs(s.prompts_stream) == 0  # the redo acked the task
    finally:
        await producer.close()
        await trainer.close()


async def test_forged_weight_announcements_are_dead_lettered_not_a_crash_loop(bus_config, run_creds, ray_address,
                                                                              tiny_model_dir, run_name):
    # A leaked trainer credential (or a buggy script) announces weights no store holds, and weights whose checksum
    # does not match: the producer keeps what it has, says why in the dead letters, and keeps working.
    trainer = await _trainer_bus(bus_config, run_creds, run_name)
    cfg = _config(bus_config, run_creds["producer"], ray_address, tiny_model_dir, run_name)
    store = WeightStore.connect(run_name, cfg.ray)
    real = await store.put(3, {"w": torch.ones(4)})
    producer = Producer(cfg, "p-forged")
    await producer.start()
    running = asyncio.create_task(producer.run())
    s = trainer.subjects
    try:
        def announce(version: int, checksum: str) -> WeightsPublished:
            return WeightsPublished(version=version, step=version, num_bytes=16, checksum=checksum, num_tensors=1,
                                    dtype="float32", store=run_name)

        async def letters_when(n: int) -> list[DeadLetter]:
            for _ in range(100):
                letters = await trainer.snapshot(s.dead_letter, DeadLetter)
                if len(letters) >= n:
                    break
                await asyncio.sleep(0.1)
            return letters

        # One at a time: the producer's weights watch starts at the last announcement, and it may start only now.
        await trainer.publish(s.weights, announce(9999, real.checksum), msg_id="forged-9999")
        await letters_when(1)
        await trainer.publish(s.weights, announce(3, "0" * len(real.checksum)), msg_id="forged-3")
        letters = await letters_when(2)
        reasons = [d.reason for d in letters]
        assert len(reasons) == 2, reasons
        assert "v9999" in reasons[0] and "WeightsMissing" in reasons[0]
        assert "v3" in reasons[1] and "WeightsChecksumMismatch" in reasons[1] and real.checksum in reasons[1]
        assert all(d.original_subject == s.weights for d in letters)
        assert not running.done(), "the producer died on a forged announcement"
        assert producer.engine.version == 0 and producer.trainer_version == 0  # kept what it had
        # the genuine announcement is still taken
        await trainer.publish(s.weights, announce(3, real.checksum), msg_id="weights-v3")
        for _ in range(100):
            if producer.engine.version == 3:
                break
            await asyncio.sleep(0.1)
        assert (producer.engine.version, producer.trainer_version) == (3, 3)
    finally:
        producer.stop()
        await asyncio.wait_for(running, 60)
        await producer.close()
        await trainer.close()
