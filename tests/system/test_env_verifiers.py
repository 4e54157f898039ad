"""`rlbus up` on a `verifiers` environment (verifiers 0.4's verifiers.v1), on the tiny test model: the multi-turn
guessing environment of tests/fixtures/vf_envs.py, where the environment answers the model between its turns. The
feeder releases the environment's rows, each producer runs their episodes through its endpoint (verifiers' harness,
runtime and interception server as local processes) and trains on the rubric's reward, and the evaluator scores the
held-out rows (env.num_heldout). Ends with the ledger check: every released prompt trained once or accounted for.

    .venv/bin/python -m pytest -q tests/system/test_env_verifiers.py
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

pytest.importorskip("verifiers.v1", reason="verifiers is the optional extra rlbus[verifiers] (make setup installs it)")

from rlbus.consumers.event_log import read_entries
from rlbus.trainer.metrics import read_metrics
from tests.fixtures.vf_envs import ENV_DIR
from tests.support.runs import check_ledger, log_tail, small_run_config, start_role, stop, write_config

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_rlbus_up_trains_and_evaluates_a_multi_turn_verifiers_environment(tmp_path, tiny_model_dir, run_name,
                                                                           monkeypatch):
    # The fixture tasksets, importable by every role and by the processes verifiers starts, as if installed.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ENV_DIR), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.syspath_prepend(str(ENV_DIR))
    from vf_guess import FORMAT_WEIGHT

    cfg = small_run_config(
        run_name, tmp_path / "run", tiny_model_dir, "", "", "",
        env={"type": "verifiers", "load": "tests.fixtures.vf_envs:multi_turn", "args": {"num_tasks": 24,
                                                                                      "max_guesses": 2},
             "num_heldout": 4},
        rollout={"num_producers": 1, "max_new_tokens": 24, "max_response_tokens": 96},
        trainer={"total_steps": 3},
        eval={"interval": 3, "num_prompts": 4, "n": 1},
    )
    run_dir = tmp_path / "run"
    up = start_role("up", write_config(tmp_path / "run.yaml", cfg), tmp_path / "logs", name="up")
    try:
        assert up.wait(timeout=600) == 0, log_tail(up)
    finally:
        stop(up, signal.SIGKILL)
    check_ledger(run_dir, cfg)
    rows = read_metrics(run_dir)
    evals = [r for r in rows if "eval/num_prompts" in r]
    assert sorted(r["version"] for r in evals) == [0, 3] and all(r["eval/num_prompts"] == 4 for r in evals)
    groups = [e.msg for e in read_entries(run_dir, "traj")]
    assert {g.data_source for g in groups} == {"verifiers/vf_guess"}
    # The feeder released training rows only (the last 4 of 24 are held out); every sample's reward is the rubric's
    # (solved 0/1 plus the format bonus).
    released = {e.msg.extra_info["vf_idx"] for e in read_entries(run_dir, "prompts")}
    assert released and max(released) < 20
    assert all(0.0 <= s.reward <= 1.0 + FORMAT_WEIGHT + 1e-9 for g in groups for s in g.samples)
    assert any(s.num_turns >= 2 for g in groups for s in g.samples)  # the environment answered between turns
