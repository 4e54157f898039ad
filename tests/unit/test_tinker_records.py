"""tinker_api/records.py: what a restarted `rlbus tinker` finds of its sessions, models and sampling sessions.

    .venv/bin/python -m pytest -q tests/unit/test_tinker_records.py
"""

from __future__ import annotations

from pathlib import Path

from rlbus.tinker_api.records import ModelRecord, Records, SamplerRecord

SESSION = "0123456789abcdef0123456789abcdef"
OWNER = "a1b2c3d4e5f60718"


def record(**kw) -> ModelRecord:
    return ModelRecord(session_id=SESSION, rank=4, alpha=32.0, train_attn=True, train_mlp=False, seed=7, **kw)


def test_records_round_trip_under_their_owners_tree(tmp_path: Path) -> None:
    recs = Records(tmp_path)
    recs.save_session(OWNER, SESSION)
    model_id = f"{SESSION}:train:0"
    state = f"tinker://{model_id}/weights/two"
    recs.save_model(OWNER, model_id, record(state=state))
    recs.save_sampler(OWNER, "sampler-" + "f" * 32, SamplerRecord(model_path=None))
    again = Records(tmp_path)  # a new process reads what the first wrote
    assert again.has_session(OWNER, SESSION)
    assert again.model(OWNER, model_id) == record(state=state)
    assert again.sampler(OWNER, "sampler-" + "f" * 32) == SamplerRecord(model_path=None)
    # another owner finds none of it
    assert not again.has_session("0" * 16, SESSION) and again.model("0" * 16, model_id) is None
    assert (tmp_path / OWNER / model_id / "model.json").is_file()


def test_ending_a_session_drops_its_models_records_only(tmp_path: Path) -> None:
    recs = Records(tmp_path)
    other = "f" * 32
    for session in (SESSION, other):
        recs.save_session(OWNER, session)
        recs.save_model(OWNER, f"{session}:train:3", record())
    (tmp_path / OWNER / f"{SESSION}:train:3" / "weights" / "s").mkdir(parents=True)  # a checkpoint: it stays
    recs.drop_session(OWNER, SESSION)
    assert not recs.has_session(OWNER, SESSION) and recs.model(OWNER, f"{SESSION}:train:3") is None
    assert (tmp_path / OWNER / f"{SESSION}:train:3" / "weights" / "s").is_dir()
    assert recs.has_session(OWNER, other) and recs.model(OWNER, f"{other}:train:3") == record()


def test_ids_not_of_the_services_shapes_name_no_file(tmp_path: Path) -> None:
    recs = Records(tmp_path / "root")
    for bad in ("../../etc", "x" * 32, SESSION + "/..", ""):
        recs.save_session(OWNER, bad)
        recs.save_model(OWNER, f"{bad}:train:0", record())
        recs.save_sampler(OWNER, f"sampler-{bad}", SamplerRecord(model_path=None))
        assert not recs.has_session(OWNER, bad) and recs.model(OWNER, f"{bad}:train:0") is None
    assert not (tmp_path / "root").exists()  # nothing written anywhere
    assert not list(tmp_path.rglob("*.json"))
