"""bus/handover.py: the ack subjects a role keeps for its successor (the naks themselves: tests/integration/test_bus.py,
a trainer restarted under `rlbus up`: tests/system/test_faults.py).

    .venv/bin/python -m pytest -q tests/unit/test_handover.py
"""

from __future__ import annotations

from rlbus.bus.handover import Handover, producer_key


class NakRecorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, list[str]]] = []

    async def nak_replies(self, subject: str, durable: str, replies) -> int:
        self.calls.append((subject, durable, list(replies)))
        return len(self.calls[-1][2])


async def test_a_successor_naks_the_last_list_its_predecessor_saved(tmp_path):
    path = tmp_path / "trainer-unacked.json"
    dead = Handover(path, NakRecorder(), "run.traj", "trainer")
    dead.save(["$JS.ACK.a.trainer.1.1.1.1.0", "$JS.ACK.a.trainer.1.2.2.1.0"])
    dead.save(["$JS.ACK.a.trainer.1.2.2.1.0", "$JS.ACK.a.trainer.1.3.3.1.0"])  # replaced, not appended
    bus = NakRecorder()
    assert await Handover(path, bus, "run.traj", "trainer").take_over() == 2
    assert bus.calls == [("run.traj", "trainer", ["$JS.ACK.a.trainer.1.2.2.1.0", "$JS.ACK.a.trainer.1.3.3.1.0"])]
    assert not path.with_suffix(".tmp").exists()


async def test_no_list_or_an_unreadable_one_names_nothing(tmp_path):
    bus = NakRecorder()
    assert await Handover(tmp_path / "none.json", bus, "run.traj", "trainer").take_over() == 0
    (tmp_path / "bad.json").write_bytes(b'{"not": "a list"')
    assert await Handover(tmp_path / "bad.json", bus, "run.traj", "trainer").take_over() == 0
    assert bus.calls == []  # what the list named comes back after ack_wait, as without it


async def test_a_role_that_ends_holding_nothing_leaves_no_file(tmp_path):
    path = tmp_path / "producer-p0-unacked.json"
    handover = Handover(path, NakRecorder(), "run.prompts", "producers")
    handover.save(["$JS.ACK.a.producers.1.1.1.1.0"])
    assert path.is_file()
    handover.save([])  # the last task settled
    assert not path.exists()
    handover.save([])  # and again: nothing to remove is fine
    bus = NakRecorder()
    assert await Handover(path, bus, "run.prompts", "producers").take_over() == 0 and bus.calls == []


def test_a_producers_key_is_its_id_when_a_key_can_hold_it():
    assert producer_key("p0") == "unacked.producer.p0"
    assert producer_key("host-1_23=x") == "unacked.producer.host-1_23=x"
    assert producer_key("host:7") == producer_key("é") == ""  # the file only
