"""consumers/ledger.py: the accounting every fault test (and `rlbus events RUN --ledger`) ends with.

    .venv/bin/python -m pytest -q tests/unit/test_ledger.py
"""

from __future__ import annotations

from rlbus.consumers.ledger import Ledger


def test_a_clean_ledger_accounts_for_every_release():
    ledger = Ledger(released=["e0-i0-a0", "e0-i1-a0", "e0-i1-a1", "e0-i2-a0", "e0-i3-a0", "e0-i4-a0"],
                    trained=["e0-i0-a0", "e0-i1-a1"], reissued={"e0-i1-a0"}, dead_lettered={"e0-i2-a0"},
                    given_up={"e0-i3-a0"})
    assert ledger.in_flight == {"e0-i4-a0"}
    assert ledger.problems(max_in_flight=1) == []
    assert ledger.counts() == {"released": 6, "trained": 2, "re-issued": 1, "dead-lettered": 1, "retired": 0,
                               "given up": 1, "in flight": 1}


def test_a_retired_release_is_accounted_for_and_a_dead_lettered_group_is_not(tmp_path):
    """Read from a run directory: a prompt whose group the trainer dropped for good (uniform rewards under dynamic
    sampling) is retired by the feeder, by name; a group dead-lettered as forged names a prompt whose real group is
    still to come, so it accounts for nothing."""
    import msgspec

    from rlbus.consumers.ledger import read_ledger
    from rlbus.schemas.wire import DeadLetter, PromptTask, TrajectoryGroup, encode

    events = tmp_path / "events"
    events.mkdir()

    def line(seq: int, subject: str, msg) -> bytes:
        return msgspec.json.encode({"seq": seq, "subject": subject, "recorded_at": 0.0, "msg": msg}) + b"\n"

    prompts = [PromptTask(task_id=f"e0-i{i}-a0", prompt=[], ground_truth="1", index=i) for i in range(4)]
    (events / "prompts.jsonl").write_bytes(b"".join(line(i, "rlbus.r.prompts", p) for i, p in enumerate(prompts)))
    forged = TrajectoryGroup(group_id="e0-i2-a0", task_id="e0-i2-a0", producer_id="p0", samples=[], index=2)
    letters = [DeadLetter(original_subject="rlbus.r.traj", reason="forged", payload=encode(forged),
                          payload_bytes=len(encode(forged))),
               DeadLetter(original_subject="rlbus.r.prompts", reason="max deliveries", payload=encode(prompts[3]),
                          payload_bytes=len(encode(prompts[3])))]
    (events / "dead_letters.jsonl").write_bytes(b"".join(line(i, "rlbus.r.dead_letter", x)
                                                         for i, x in enumerate(letters)))
    (tmp_path / "feeder.json").write_bytes(msgspec.json.encode(
        {"retired": {"e0-i1-a0": "uniform rewards (dynamic sampling)"}}))
    ledger = read_ledger(tmp_path)
    assert ledger.retired == {"e0-i1-a0": "uniform rewards (dynamic sampling)"}
    assert ledger.dead_lettered == {"e0-i3-a0"}  # the prompt's own dead letter counts; the group's does not
    assert ledger.in_flight == {"e0-i0-a0", "e0-i2-a0"}


def test_each_way_a_ledger_can_be_wrong_is_named():
    twice = Ledger(released=["e0-i0-a0"], trained=["e0-i0-a0", "e0-i0-a0"])
    assert twice.problems(10) == ["trained more than once: ['e0-i0-a0']"]
    phantom = Ledger(released=[], trained=["e0-i9-a0"])
    assert phantom.problems(10) == ["trained but never released: ['e0-i9-a0']"]
    lost = Ledger(released=[f"e0-i{i}-a0" for i in range(5)], trained=[])
    (problem,) = lost.problems(max_in_flight=2)
    assert problem.startswith("5 released prompts unaccounted for (more than the 2")
    rereleased = Ledger(released=["e0-i0-a0", "e0-i0-a0"], trained=["e0-i0-a0"])
    assert rereleased.problems(10) == ["released more than once: ['e0-i0-a0']"]


def test_examples_given_up_are_summed_by_why_their_releases_were_lost():
    ledger = Ledger(released=[], trained=[], given_up={"e0-i3-a2", "e1-i4-a2", "e0-i5-a2", "e0-i6-a0"},
                    why_lost={"e0-i3": ["too stale"] * 3, "e1-i4": ["too stale"] * 3,
                              "e0-i5": ["payload lost", "too stale", "too stale"]})
    assert ledger.given_up_why() == {"too stale, too stale, too stale": 2, "payload lost, too stale, too stale": 1,
                                     "not recorded": 1}  # e0-i6: a feeder.json written before reasons were kept
