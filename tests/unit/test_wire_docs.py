"""The wire contract as data: docs/wire.md and the JSON Schema are what the code generates, and stay so.

    .venv/bin/python -m pytest -q tests/unit/test_wire_docs.py
"""

from __future__ import annotations

from pathlib import Path

import jsonschema
import msgspec
import pytest

from rlbus.cli import schema
from rlbus.schemas import wire

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "wire.md"


def test_docs_wire_md_is_what_the_code_generates():
    assert DOCS.read_text() == schema.wire_markdown(), (
        f"docs/wire.md is out of date with schemas/wire.py (or the subjects, streams, credentials): "
        f"run `{schema.REGENERATE}`")


def test_every_wire_type_and_field_is_on_the_page():
    page = schema.wire_markdown()
    types = schema.wire_types()
    assert {t.__name__ for t in types} >= {"PromptTask", "SampleMeta", "TrajectoryGroup", "WeightsPublished",
                                            "StepCompleted", "ProducerHeartbeat", "DeadLetter", "ChatMessage"}
    assert wire.Wire not in types  # the base never travels alone
    for t in types:
        section = page.split(f"### {t.__name__}\n", 1)[1].split("\n### ", 1)[0]
        for f in msgspec.structs.fields(t):
            assert f"`{f.encode_name}`" in section, (t.__name__, f.name)
        tag = msgspec.inspect.type_info(t).tag
        if tag is not None:
            assert f'"kind": "{tag}"' in section
    # positional order of an array-like struct: which slot is the reward
    sample = page.split("### SampleMeta\n", 1)[1].split("\n### ", 1)[0]
    for i, name in enumerate(msgspec.structs.fields(wire.SampleMeta)):
        assert f"| {i} | `{name.name}` |" in sample
    assert "| 3 | `reward` | float |" in sample
    # run name -> stream names, and the credential file's keys
    assert "`RLBUS_MY_RUN_TRAJ`" in page and "`rlbus_my_run_weights`" in page and "`rlbus.my-run.traj`" in page
    for key in ("user", "password", "inbox_prefix", "url", "run", "role"):
        assert f'"{key}":' in page


def test_a_wire_type_added_to_the_module_is_picked_up(monkeypatch):
    class ProducersScaledForTest(wire.Wire, tag="producers_scaled_for_test"):
        target: int
        previous: int = 0

    ProducersScaledForTest.__module__ = wire.__name__
    monkeypatch.setattr(wire, "ProducersScaledForTest", ProducersScaledForTest, raising=False)
    assert ProducersScaledForTest in schema.wire_types()
    assert "ProducersScaledForTest" in schema.json_schema()["$defs"]
    page = schema.wire_markdown()
    assert "### ProducersScaledForTest" in page and "`target`" in page
    assert DOCS.read_text() != page  # so the comparison above would fail until the page is regenerated


def test_json_schema_accepts_real_messages_and_refuses_broken_ones():
    doc = schema.json_schema()
    jsonschema.Draft202012Validator.check_schema(doc)
    validator = jsonschema.Draft202012Validator(doc)
    group = wire.TrajectoryGroup(group_id="g", task_id="g", producer_id="p0", samples=[
        wire.SampleMeta(key="g/d1/0", prompt_len=3, response_len=5, reward=1.0)])
    messages = [group, wire.StepCompleted(step=1, version=1, group_ids=["g"], metrics={"reward/mean": 0.5}),
                wire.ProducerHeartbeat(producer_id="p0", version=1),
                wire.DeadLetter(reason="x", original_subject="s", payload=b"\x00\x01"),
                wire.PromptTask(task_id="t", prompt=[wire.ChatMessage(role="user", content="1+1")])]
    for msg in messages:
        validator.validate(msgspec.json.decode(msgspec.json.encode(msg)))
    broken = msgspec.json.decode(msgspec.json.encode(group))
    broken["samples"][0][3] = "high"  # the reward slot must be a number
    with pytest.raises(jsonschema.ValidationError):
        validator.validate(broken)
    with pytest.raises(jsonschema.ValidationError):
        validator.validate({"kind": "no_such_kind", "schema_version": 1})


def test_schema_command_writes_and_checks(tmp_path, capsys):
    assert schema.main(["--out", str(tmp_path), "--docs", str(tmp_path / "wire.md")]) == 0
    assert (tmp_path / "wire.md").read_text() == schema.wire_markdown()
    assert "TrajectoryGroup" in msgspec.json.decode((tmp_path / "wire.schema.json").read_bytes())["$defs"]
    assert schema.main(["--check", str(tmp_path / "wire.md")]) == 0
    (tmp_path / "wire.md").write_text("stale\n")
    assert schema.main(["--check", str(tmp_path / "wire.md")]) == 1
    assert schema.REGENERATE in capsys.readouterr().err


def test_every_event_type_has_a_file_in_the_event_log():
    from rlbus.consumers.event_log import EVENT_KIND, KINDS

    for t in wire.Event.__args__:  # type: ignore[attr-defined]
        assert t in EVENT_KIND, f"{t.__name__} is an Event but the recorder has no archive file for it"
        assert KINDS[EVENT_KIND[t]] is not None
