"""trainer/replay.py: a run is replayed under the config it was recorded with, including what an older rlbus did by
default before a setting existed.

    .venv/bin/python -m pytest -q tests/unit/test_replay_config.py
"""

from __future__ import annotations

from rlbus.schemas.config_io import from_dict, to_yaml
from rlbus.trainer.replay import replay_config


def _recorded(run_dir, text: str):
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(text)
    return run_dir


def test_a_run_recorded_before_the_zero_gradient_skip_replays_stepping_on_every_update(tmp_path):
    text = to_yaml(from_dict({"model": {"path": "m"}}))
    assert "skip_zero_grad_updates: true" in text
    assert replay_config(_recorded(tmp_path / "new", text)).trainer.skip_zero_grad_updates is True
    older = "".join(line for line in text.splitlines(keepends=True) if "skip_zero_grad_updates" not in line)
    assert replay_config(_recorded(tmp_path / "old", older)).trainer.skip_zero_grad_updates is False
    # a what-if override still wins
    cfg = replay_config(tmp_path / "old", ["trainer.skip_zero_grad_updates=true"])
    assert cfg.trainer.skip_zero_grad_updates is True and cfg.trainer.num_ranks == 1
