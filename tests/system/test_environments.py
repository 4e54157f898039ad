"""`rlbus up` on environments people already have, on the tiny test model (plumbing; learning is benchmarked on
SmolLM2 in bench/env_learning.py):

- a reasoning-gym composite (gcd and letter_counting, weighted): the feeder releases its tasks, producers score them
  with each task's own scorer, and the evaluator scores the held-out split;
- a Gymnasium text game that misbehaves on purpose (tests/fixtures/text_games.py: Unruly raises, hangs or pays NaN
  by seed): only those episodes fail, each dead-lettered with its reason (bus.max_deliver 1), released again and
  finally given up by name, while the run trains on the seeds that play fair.

Both end with the ledger check: every released prompt trained once or accounted for.

    .venv/bin/python -m pytest -q tests/system/test_environments.py
"""

from __future__ import annotations

import importlib.util
import signal
from collections import Counter
from pathlib import Path

import pytest

from rlbus.consumers.event_log import read_entries
from rlbus.consumers.ledger import read_ledger
from rlbus.trainer.metrics import read_metrics
from tests.support.runs import check_ledger, log_tail, small_run_config, start_role, stop, write_config

pytestmark = pytest.mark.slow


def _up(tmp_path: Path, cfg: dict, timeout: float = 400) -> Path:
    up = start_role("up", write_config(tmp_path / "run.yaml", cfg), tmp_path / "logs", name="up")
    try:
        assert up.wait(timeout=timeout) == 0, log_tail(up)
    finally:
        stop(up, signal.SIGKILL)
    return Path(cfg["logging"]["run_dir"])


@pytest.mark.skipif(importlib.util.find_spec("reasoning_gym") is None, reason="the reasoning-gym extra (make setup)")
def test_rlbus_up_trains_and_evaluates_a_reasoning_gym_composite(tmp_path, tiny_model_dir, run_name):
    cfg = small_run_config(
        run_name, tmp_path / "run", tiny_model_dir, "", "", "",
        env={"type": "reasoning_gym", "size": 64,
             "tasks": [{"name": "gcd", "config": {"max_value": 30}}, {"name": "letter_counting", "weight": 3.0}]},
        rollout={"num_producers": 1, "agent_loop": "single_turn", "tools": [], "format_reward": 0.1},
        data={"max_prompt_tokens": 512},
        trainer={"total_steps": 3},
        eval={"interval": 3, "num_prompts": 8},
    )
    run_dir = _up(tmp_path, cfg)
    check_ledger(run_dir, cfg)
    rows = read_metrics(run_dir)
    evals = [r for r in rows if "eval/accuracy" in r]
    assert sorted(r["version"] for r in evals) == [0, 3]  # the held-out split, scored at the first and last version
    assert all(r["eval/num_prompts"] == 8 and 0.0 <= r["eval/accuracy"] <= 1.0 for r in evals)
    groups = [e.msg for e in read_entries(run_dir, "traj")]
    sources = Counter(g.data_source for g in groups)
    assert set(sources) <= {"reasoning_gym/gcd", "reasoning_gym/letter_counting"} and sources, sources
    # Every sample was scored by its task's scorer: rewards are the format reward plus the task's 0..1 score.
    assert all(0.0 <= s.reward <= 1.1 + 1e-9 for g in groups for s in g.samples)


@pytest.mark.skipif(importlib.util.find_spec("gymnasium") is None, reason="the gym extra (make setup)")
def test_a_misbehaving_environment_fails_only_its_episodes_and_the_ledger_says_why(tmp_path, tiny_model_dir,
                                                                                    run_name):
    cfg = small_run_config(
        run_name, tmp_path / "run", tiny_model_dir, "", "", "",
        env={"type": "gym", "make": "tests.fixtures.text_games:Unruly", "kwargs": {"high": 8}, "num_tasks": 16},
        bus={"max_deliver": 1},
        rollout={"num_producers": 1, "tools": [], "max_turns": 2, "episode_timeout_s": 4.0},
        feeder={"max_attempts": 2, "shuffle": False},
        trainer={"total_steps": 3},
    )
    run_dir = _up(tmp_path, cfg, timeout=600)
    check_ledger(run_dir, cfg)
    ledger = read_ledger(run_dir)
    letters = (run_dir / "events" / "dead_letters.jsonl").read_text()
    for reason in ("the game's server crashed", "episode_timeout_s=4", "reward nan"):
        assert reason in letters, (reason, letters[-2000:])
    # Only the misbehaving seeds (index % 4 != 0) were lost; the fair ones all trained. (A misbehaving seed may train
    # too: the tiny model's turn may run out of tokens before the game is ever stepped.)
    index = lambda task: int(task.split("-i")[1].split("-")[0])  # noqa: E731 - e<epoch>-i<index>-a<attempt>
    assert ledger.dead_lettered and all(index(t) % 4 != 0 for t in ledger.dead_lettered), ledger.dead_lettered
    assert any(index(t) % 4 == 0 for t in ledger.trained), ledger.trained
