"""The producer service in-process against a real nats-server and Ray: the order of a task's life.

    .venv/bin/python -m pytest -q tests/integration/test_producer.py

A producer that dies after publishing a group but before acking its task (simulated here by an ack that fails) gets
the task redelivered; the redo's publish is de-duplicated, and the group on the bus must still point at tensors
that match it -- the redo's tensors are deleted, the first delivery's stay.
"""

from __future__ import annotations

import msgspec

from rlbus.bus.client import Bus
from rlbus.bus.transfer_queue import TransferQueue
from rlbus.producers.service import Producer
from rlbus.schemas.config import from_dict
from rlbus.schemas.wire import ChatMessage, PromptTask, TrajectoryGroup


class DiesBeforeAck:
    """A delivery whose ack fails, as if the producer died right after publishing the group."""

    def __init__(self, delivery):
        self._delivery = delivery

    def __getattr__(self, name):
        return getattr(self._delivery, name)

    async def ack(self) -> None:
        raise ConnectionError("producer died between publish and ack")


async def test_a_redo_after_publish_keeps_the_announced_tensors(bus_config, ray_address, tiny_model_dir, run_name):
    cfg = from_dict({
        "name": run_name,
        "bus": {**msgspec.to_builtins(bus_config), "ack_wait_s": 2.0},
        "ray": {"address": ray_address, "num_storage_actors": 1},
        "model": {"path": str(tiny_model_dir)},
        "rollout": {"n": 2, "agent_loop": "single_turn", "max_new_tokens": 8, "max_response_tokens": 8,
                    "engine": {"type": "simulated", "mean_tokens": 6, "seconds_per_token": 0.001}},
    })
    producer = Producer(cfg, "p-test")
    await producer.start()
    try:
        bus: Bus = producer.bus
        s = bus.subjects
        task = PromptTask(task_id="e0-i7-a0", prompt=[ChatMessage(role="user", content="What is 2+3?")],
                          ground_truth="5", n=2, index=7)
        await bus.publish(s.prompts, task, msg_id=task.task_id)

        first = (await bus.fetch(s.prompts, s.prompts_consumer, PromptTask, timeout=5.0))[0]
        await producer._handle(DiesBeforeAck(first))  # the group is published, the ack never happens

        second = []
        while not second:  # back after ack_wait (and the nak's delay)
            second = await bus.fetch(s.prompts, s.prompts_consumer, PromptTask, timeout=5.0)
        assert second[0].num_delivered == 2
        await producer._handle(second[0])

        groups = await bus.snapshot(s.traj, TrajectoryGroup)
        assert len(groups) == 1, "the redo's publish was not de-duplicated"
        group = groups[0]
        assert all(k.startswith("e0-i7-a0/d1/") for k in group.keys)
        tq = TransferQueue.connect(run_name, cfg.ray)
        stored = await tq.get_list(group.keys)
        assert [t["response_ids"].numel() for t in stored] == [m.response_len for m in group.samples]
        assert (await tq.stats())["items"] == 2, "the redo's tensors were left behind"
        assert await bus.stream_msgs(s.prompts_stream) == 0  # the redo acked the task
    finally:
        await producer.close()
