"""The scale request file between `rlbus scale` and a running `rlbus up` (cli/launcher.py).

    .venv/bin/python -m pytest -q tests/unit/test_scale_request.py
"""

from __future__ import annotations

import json

import pytest

from rlbus.cli.launcher import PRODUCERS_FILE, SCALE_FILE, read_scale, scale_main, write_scale


def test_a_request_is_written_whole_and_read_back(tmp_path):
    assert read_scale(tmp_path) is None
    write_scale(tmp_path, 3)
    assert read_scale(tmp_path) == 3
    write_scale(tmp_path, 0)
    assert read_scale(tmp_path) == 0
    assert [p.name for p in tmp_path.iterdir()] == [SCALE_FILE]  # no temporary file left behind


def test_a_bad_request_is_refused(tmp_path):
    with pytest.raises(ValueError, match=">= 0"):
        write_scale(tmp_path, -1)
    (tmp_path / SCALE_FILE).write_text("three\n")
    with pytest.raises(ValueError, match="expected a number of producers"):
        read_scale(tmp_path)


def test_scale_command_needs_a_launched_run_and_waits_for_it(tmp_path, capsys):
    assert scale_main(tmp_path, 2, wait=False, timeout=1) == 2  # no rlbus up ever ran here
    assert "no producers.json" in capsys.readouterr().err
    (tmp_path / PRODUCERS_FILE).write_text(json.dumps({"target": 1, "running": {"p0": 11}, "draining": []}))
    assert scale_main(tmp_path, 2, wait=True, timeout=0.5) == 1  # nobody applies it
    assert "did not reach 2 producers" in capsys.readouterr().err
    assert read_scale(tmp_path) == 2
    state = {"target": 2, "running": {"p0": 11, "p1": 12}, "ready": ["p0"], "draining": []}
    (tmp_path / PRODUCERS_FILE).write_text(json.dumps(state))
    assert scale_main(tmp_path, 2, wait=True, timeout=0.5) == 1  # p1 runs but has not got going yet
    capsys.readouterr()
    (tmp_path / PRODUCERS_FILE).write_text(json.dumps({**state, "ready": ["p0", "p1"]}))
    assert scale_main(tmp_path, 2, wait=True, timeout=5) == 0
    assert "running 2: p0, p1" in capsys.readouterr().out
