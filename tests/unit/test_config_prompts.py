"""`rlbus config prompts`: the training prompts and the evaluator's held-out ones, as the roles load them, and whether
a held-out prompt is among the training ones.

    .venv/bin/python -m pytest -q tests/unit/test_config_prompts.py
"""

from __future__ import annotations

import json
from pathlib import Path

from rlbus.cli.main import main

QUICKSTART = str(Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml")


def test_training_prompts_are_the_feeders(capsys):
    from rlbus.common.envs import load_tasks
    from rlbus.schemas.config_io import load_config

    assert main(["config", "prompts", QUICKSTART, "--num", "4", "--json"]) == 0
    out = capsys.readouterr()
    rows = [json.loads(line) for line in out.out.splitlines()]
    want = list(load_tasks(load_config(QUICKSTART, [])))[:4]
    assert [(r["prompt"][-1]["content"], r["ground_truth"]) for r in rows] == \
        [(ex.prompt[-1].content, ex.ground_truth) for ex in want]
    assert "4 of 4096 prompt(s) shown" in out.err


def test_heldout_prompts_are_the_evaluators_and_none_is_trained(capsys):
    assert main(["config", "prompts", QUICKSTART, "eval.num_prompts=200", "--heldout"]) == 0
    out = capsys.readouterr()
    assert len(out.out.splitlines()) == 200
    assert "200 of 200 prompt(s) shown; 0 of them among the 4096 training prompts" in out.err


def test_a_heldout_prompt_that_is_also_trained_is_named(capsys, monkeypatch):
    """Made to overlap (the held-out set replaced by the first training prompts): the summary names them."""
    from rlbus.common import envs

    monkeypatch.setattr(envs, "load_heldout_tasks", lambda cfg, num, tokenizer=None: envs.load_tasks(cfg))
    assert main(["config", "prompts", QUICKSTART, "data.num_examples=3", "--heldout"]) == 0
    assert "3 of them among the 3 training prompts (held-out indices [0, 1, 2])" in capsys.readouterr().err
