"""The evaluator's pure parts: which versions are due, its sampling, its metrics, and the held-out prompt set."""

from __future__ import annotations

import pytest

from rlbus.common.data.datasets import load_dataset, load_heldout
from rlbus.common.model.demos import FEW_SHOT_PROBLEMS
from rlbus.producers.agent_loops.base import Trajectory
from rlbus.producers.evaluator import eval_metrics, eval_run_config, is_due
from rlbus.schemas.config import DataConfig
from rlbus.schemas.config_io import load_config
from rlbus.schemas.errors import ConfigError


def _cfg(*overrides: str):
    return load_config(None, ["model.path=/m", *overrides])


def test_due_versions_are_first_every_interval_and_last() -> None:
    cfg = _cfg("eval.interval=5", "trainer.total_steps=12")
    assert [v for v in range(13) if is_due(v, cfg)] == [0, 5, 10, 12]
    assert not any(is_due(v, _cfg("eval.interval=0")) for v in range(31))


def test_greedy_is_top_k_one_and_sampling_keeps_the_temperature() -> None:
    greedy = eval_run_config(_cfg("eval.interval=1", "rollout.temperature=0.7", "rollout.n=8"))
    assert (greedy.rollout.top_k, greedy.rollout.temperature, greedy.rollout.n) == (1, 1.0, 1)
    sampled = eval_run_config(_cfg("eval.interval=1", "eval.temperature=0.6", "eval.n=4"))
    assert (sampled.rollout.top_k, sampled.rollout.temperature, sampled.rollout.n) == (0, 0.6, 4)


def test_eval_config_is_validated_by_name() -> None:
    with pytest.raises(ConfigError, match="eval.n"):
        _cfg("eval.n=4")  # greedy gives one answer
    with pytest.raises(ConfigError, match="eval.interval"):
        _cfg("eval.interval=-1")


def _traj(reward: float, tool_calls: int, length: int) -> Trajectory:
    return Trajectory(prompt_ids=[1], response_ids=[2] * length, reward=reward, num_tool_calls=tool_calls,
                      num_turns=1 + tool_calls)


def test_eval_metrics_accuracy_pass_at_n_and_tool_use() -> None:
    groups = [[_traj(1.0, 1, 10), _traj(0.0, 0, 4)], [_traj(0.0, 0, 6), _traj(0.0, 1, 8)]]
    m = eval_metrics(groups)
    assert m["eval/accuracy"] == 0.25 and m["eval/pass@2"] == 0.5
    assert m["eval/tool_call_rate"] == 0.5 and m["eval/response_length"] == 7.0 and m["eval/turns"] == 1.5
    assert "eval/pass@1" not in eval_metrics([[_traj(1.0, 0, 1)]])


def test_heldout_set_shares_no_question_with_the_training_set() -> None:
    data = DataConfig(num_examples=4096, few_shot=2)
    train = {ex.prompt[-1].content for ex in load_dataset(data)}
    held = load_heldout(data, 64)
    questions = [ex.prompt[-1].content for ex in held]
    assert len(held) == 64 and len(set(questions)) > 50 and not set(questions) & train
    assert held[0].prompt[:-1] == load_dataset(data)[0].prompt[:-1]  # same system prompt and worked examples


def test_few_shot_prompts_hold_worked_calculator_conversations() -> None:
    [ex] = load_dataset(DataConfig(num_examples=1, few_shot=2))
    roles = [m.role for m in ex.prompt]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "user", "assistant", "tool", "assistant",
                     "user"]
    assert ex.prompt[1].content == FEW_SHOT_PROBLEMS[0][0] and ex.prompt[3].content == FEW_SHOT_PROBLEMS[0][1]
    assert '"calculator"' in ex.prompt[2].content
    assert [m.role for m in load_dataset(DataConfig(num_examples=1))[0].prompt] == ["system", "user"]
