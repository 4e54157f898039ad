"""The math reward (extraction, numeric tolerance, format bonus) and the reward registry (names, import paths)."""

from __future__ import annotations

import sys
import textwrap

import pytest

from rlbus.producers.rewards import RewardError, compute_score, extract_answer, load_reward
from rlbus.producers.rewards.math import parse_number
from rlbus.schemas.config import RolloutConfig
from rlbus.schemas.errors import ConfigError
from rlbus.schemas.wire import ChatMessage, PromptTask

TASK = PromptTask(task_id="t0", prompt=[ChatMessage(role="user", content="What is 17*23?")], ground_truth="391")


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("<answer>391</answer>", "391"),
        ("first <answer>390</answer> no wait <answer> 391 </answer>", "391"),  # the last one counts
        ("so the result is \\boxed{391}.", "391"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # nested braces
        ("Natalia sold 48/2 = 24 clips.\n#### 72", "72"),
        ("#### 1,234\n", "1,234"),
        ("<answer>7</answer> and \\boxed{8}", "7"),  # <answer> wins over \boxed
        ("the answer is 391", None),
        ("\\boxed{391", None),  # cut off inside the box
        ("", None),
    ],
)
def test_extract_answer(text: str, answer: str | None) -> None:
    assert extract_answer(text) == answer


@pytest.mark.parametrize(
    ("text", "value"),
    [("391", 391.0), ("391.0", 391.0), ("1,234", 1234.0), (" 1 234 ", 1234.0), ("$5", 5.0), ("-3", -3.0),
     ("3/4", 0.75), ("\\frac{3}{4}", 0.75), ("50%", 50.0), ("7.", 7.0), ("1e3", 1000.0), ("abc", None),
     ("1/0", None), ("", None)],
)
def test_parse_number(text: str, value: float | None) -> None:
    assert parse_number(text) == value


@pytest.mark.parametrize(
    ("response", "truth", "reward"),
    [
        ("<answer>391</answer>", "391", 1.0),
        ("<answer>391.0</answer>", "391", 1.0),
        ("<answer> 1,234 </answer>", "1234", 1.0),
        ("#### 1234", "1,234", 1.0),
        ("\\boxed{0.5}", "1/2", 1.0),
        ("<answer>390</answer>", "391", 0.0),
        ("391", "391", 0.0),  # no committed final answer
        ("<answer>Paris</answer>", "paris", 1.0),  # non-numeric: normalised string match
        ("<answer></answer>", "", 0.0),
    ],
)
def test_compute_score(response: str, truth: str, reward: float) -> None:
    assert compute_score(response, truth) == reward


def test_format_reward_is_added_for_a_well_formed_answer() -> None:
    assert compute_score("<answer>391</answer>", "391", format_reward=0.1) == pytest.approx(1.1)
    assert compute_score("<answer>390</answer>", "391", format_reward=0.1) == pytest.approx(0.1)
    assert compute_score("\\boxed{391}", "391", format_reward=0.1) == 1.0  # right, but not in the taught format
    assert compute_score("<answer>many</answer>", "391", format_reward=0.1) == 0.0


async def test_builtin_math_reward_uses_format_reward() -> None:
    reward = load_reward(RolloutConfig(reward="math", format_reward=0.25))
    assert await reward("<tool_call>..</tool_call><answer>391</answer>", "391", task=TASK) == pytest.approx(1.25)
    assert await reward("I don't know", "391", task=TASK) == 0.0


@pytest.fixture()
def reward_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent('''
        import asyncio

        def length_reward(response_text, ground_truth, *, task):
            return len(response_text) / 10 + (task.index == 0)

        async def async_reward(response_text, ground_truth, *, task):
            await asyncio.sleep(0)
            return 1.0 if ground_truth in response_text else -1.0

        def bad_reward(response_text, ground_truth, *, task):
            return "high"

        NOT_CALLABLE = 3
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards"
    sys.modules.pop("my_rewards", None)


async def test_import_path_reward_sync_and_async(reward_module: str) -> None:
    sync = load_reward(RolloutConfig(reward=f"{reward_module}:length_reward"))
    assert await sync("abcde", "391", task=TASK) == pytest.approx(1.5)
    async_ = load_reward(RolloutConfig(reward=f"{reward_module}:async_reward"))
    assert await async_("... 391 ...", "391", task=TASK) == 1.0
    assert await async_("... 390 ...", "391", task=TASK) == -1.0


async def test_reward_returning_a_non_number_is_an_error(reward_module: str) -> None:
    bad = load_reward(RolloutConfig(reward=f"{reward_module}:bad_reward"))
    with pytest.raises(RewardError, match="bad_reward.*'high'"):
        await bad("x", "1", task=TASK)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nope", "neither a built-in name nor an import path"),
        ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
        ("my_rewards:missing", "has no attribute 'missing'"),
        ("my_rewards:NOT_CALLABLE", "is not callable"),
    ],
)
def test_bad_reward_path_is_a_config_error(reward_module: str, spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        load_reward(RolloutConfig(reward=spec))
    assert info.value.field == "rollout.reward"
