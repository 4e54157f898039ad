"""reasoning-gym as an environment: tasks by name with their generator settings, weighted composites, a held-out
split disjoint from training, and each task's own scorer as the reward (the real reasoning-gym package).

    .venv/bin/python -m pytest -q tests/unit/test_env_reasoning_gym.py
"""

from __future__ import annotations

import hashlib
import importlib.util
from collections import Counter

import pytest

if importlib.util.find_spec("reasoning_gym") is None:  # not importorskip: its import needs our pycosat fallback
    pytest.skip("the reasoning-gym extra (make setup installs it)", allow_module_level=True)

from rlbus.common.data.datasets import example_to_task  # noqa: E402
from rlbus.common.envs import load_heldout_tasks, load_tasks  # noqa: E402
from rlbus.common.envs.reasoning_gym import TaskMismatch, extract_answer, import_reasoning_gym  # noqa: E402
from rlbus.producers.rewards import env_reward  # noqa: E402
from rlbus.schemas.config_io import from_dict  # noqa: E402
from rlbus.schemas.errors import ConfigError  # noqa: E402

import msgspec  # noqa: E402


def _cfg(tasks, **env):
    return from_dict({"model": {"path": "unused"}, "rollout": {"format_reward": 0.1},
                      "env": {"type": "reasoning_gym", "tasks": tasks, "size": 60, **env}})


COMPOSITE = [{"name": "gcd", "config": {"max_value": 50}}, {"name": "letter_counting", "weight": 2.0}]


def test_a_composite_splits_the_examples_by_weight_and_keeps_the_generator_settings():
    cfg = _cfg(COMPOSITE)
    train = load_tasks(cfg)
    assert len(train) == 60
    assert Counter(ex.extra_info["rg_task"] for ex in train) == {"gcd": 20, "letter_counting": 40}
    assert [ex.index for ex in train] == list(range(60))
    rg = import_reasoning_gym()
    for ex in train:
        if ex.extra_info["rg_task"] == "gcd":  # max_value reached the generator
            numbers = [int(n) for n in ex.prompt[-1].content.split(":")[1].split(".")[0].split(",")]
            assert max(numbers) <= 50
        assert ex.prompt[-1].content.endswith(cfg.env.instruction)
    assert rg.create_dataset("gcd", size=1, seed=0)  # the package itself still works after our import


def test_the_held_out_split_shares_no_question_with_training():
    # Small numbers make collisions likely: the held-out split must drop them, not serve them.
    cfg = _cfg([{"name": "gcd", "config": {"min_value": 1, "max_value": 6}}], size=50)
    train = {ex.prompt[-1].content for ex in load_tasks(cfg)}
    held = load_heldout_tasks(cfg, 40)
    assert 0 < len(held) <= 40 and not {ex.prompt[-1].content for ex in held} & train


def test_a_task_whose_every_held_out_question_is_in_training_is_a_config_error():
    # count_bits up to 7 has seven questions: 200 training examples hold them all, so nothing is left to evaluate.
    cfg = _cfg([{"name": "gcd"}, {"name": "count_bits", "config": {"max_n": 7}}], size=200)
    with pytest.raises(ConfigError) as e:
        load_heldout_tasks(cfg, 40)
    assert e.value.field == "env.tasks[1].config" and "no held-out question" in str(e.value)


async def test_each_task_is_scored_by_its_own_scorer_with_the_format_reward():
    cfg = _cfg(COMPOSITE)
    reward = env_reward(cfg)
    for ex in load_tasks(cfg)[:6]:
        task = example_to_task(ex, task_id=f"t{ex.index}", n=1)
        truth = ex.ground_truth
        assert await reward(f"Let me count.\nAnswer: {truth}.", truth, task=task) == pytest.approx(1.1)
        assert await reward(f"I think it is\n**Answer:** {truth}", truth, task=task) == pytest.approx(1.1)
        assert await reward(f"the answer is\n{truth}", truth, task=task) == 1.0  # lenient: no format reward
        wrong = await reward("Answer: 123456789", truth, task=task)  # the format paid, and the task's own partial
        assert 0.1 <= wrong < 0.5  # credit if it gives any (letter_counting does for a number)


async def test_strict_tag_format():
    cfg = _cfg([{"name": "gcd"}], answer_format="tag", lenient=False)
    ex = load_tasks(cfg)[0]
    task = example_to_task(ex, task_id="t0", n=1)
    reward = env_reward(cfg)
    assert await reward(f"<answer>{ex.ground_truth}</answer>", "", task=task) == pytest.approx(1.1)
    assert await reward(ex.ground_truth, "", task=task) == 0.0
    assert extract_answer("a <answer>1</answer> b <answer> 2 </answer>", "tag") == "2"


async def test_a_task_the_producer_generates_differently_is_not_scored():
    cfg = _cfg([{"name": "gcd"}])
    ex = load_tasks(cfg)[0]
    wrong = msgspec.structs.replace(example_to_task(ex, task_id="t0", n=1), ground_truth="-1")
    with pytest.raises(TaskMismatch, match="versions differ"):
        await env_reward(cfg)("Answer: -1", "-1", task=wrong)


@pytest.mark.parametrize(
    ("tasks", "field"),
    [([{"name": "gcd"}, {"name": "no_such_task"}], "env.tasks[1].name"),
     ([{"name": "gcd", "config": {"max_valu": 3}}], "env.tasks[0].config.max_valu"),
     ([{"name": "gcd", "config": {"min_value": 9, "max_value": 3}}], "env.tasks[0].config"),
     ([{"name": "gcd", "config": {"seed": 3}}], "env.tasks"), ([], "env.tasks")],
)
def test_bad_task_settings_are_config_errors_naming_the_key(tasks, field):
    with pytest.raises(ConfigError) as e:
        load_tasks(_cfg(tasks))
    assert e.value.field.startswith(field), e.value


def test_a_producer_with_a_task_reasoning_gym_lacks_fails_at_start():
    # The scorer checks the tasks when it is made (the producer's start), not at the first response it scores.
    with pytest.raises(ConfigError) as e:
        env_reward(_cfg([{"name": "gcd"}, {"name": "gcdd"}]))
    assert e.value.field == "env.tasks[1].name" and "did you mean gcd" in str(e.value)


async def test_zebra_puzzles_are_the_ones_pycosat_makes_and_score():
    # With rlbus's pure-Python pycosat (packaging/pycosat, which the extra installs): these are the answers and
    # questions reasoning-gym 0.1.25 generates with the real pycosat 0.6.6 (built with a compiler) at the same settings.
    settings = {"num_people": 3, "num_characteristics": 3}
    ds = import_reasoning_gym().create_dataset("zebra_puzzles", size=4, seed=0, **settings)
    questions = [ds[i]["question"] for i in range(4)]
    assert hashlib.sha256("".join(questions).encode()).hexdigest()[:16] == "f57ab40a04b12560"
    assert [ds[i]["answer"] for i in range(4)] == ["arnold", "bob", "arnold", "alice"]
    cfg = _cfg([{"name": "zebra_puzzles", "config": settings}], size=4)
    train = load_tasks(cfg)
    assert [ex.ground_truth for ex in train] == ["arnold", "bob", "arnold", "alice"]
    assert all(ex.prompt[-1].content.startswith(q) for ex, q in zip(train, questions))
    task = example_to_task(train[0], task_id="t0", n=1)
    assert await env_reward(cfg)("Answer: arnold", "arnold", task=task) == pytest.approx(1.1)


async def test_the_lenient_reading_of_what_a_small_chat_model_writes():
    cfg = _cfg([{"name": "basic_arithmetic", "config": {"max_terms": 2, "max_digits": 1}}])
    ex = load_tasks(cfg)[0]
    task, truth = example_to_task(ex, task_id="t0", n=1), ex.ground_truth
    reward = env_reward(cfg)
    question = ex.prompt[-1].content.split("\n")[0].removeprefix("Calculate ").rstrip(".")
    # As decoded: the closing control token kept. A right result after "=" or ":" on the last line counts.
    assert await reward(f"{question} = {truth}<|im_end|>", truth, task=task) == 1.0
    assert await reward(f"Sure.\nThe answer is: {truth}<|im_end|>", truth, task=task) == 1.0
    assert await reward(f"Answer: {truth}<|im_end|>", truth, task=task) == pytest.approx(1.1)
