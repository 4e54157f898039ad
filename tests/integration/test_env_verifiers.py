"""`verifiers` environments (`env.type: verifiers`, verifiers 0.4's verifiers.v1) on the producer's stack: the real
HF engine on a tiny warm-started quickstart model, the real OpenAI-compatible endpoint, real verifiers
environments (tests/fixtures/vf_envs.py) running verifiers' own harness, runtime, interception server and MCP tool
server as local processes.

What a user relies on: the environment's rows become tasks, with held-out rows none of which is a training row;
each sample is one episode of the environment, driven by it (its turns, its tools), captured token-exact (mask 1
on what the model sampled, 0 on what the environment inserted); the sample's reward is the environment's rubric's
score of what the model said; a misconfigured environment is a ConfigError naming `env.load`.

    .venv/bin/python -m pytest -q tests/integration/test_env_verifiers.py
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import msgspec
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

pytest.importorskip("verifiers.v1", reason="verifiers is the optional extra rlbus[verifiers] (make setup installs it)")

from rlbus.common.data.datasets import example_to_task
from rlbus.common.envs import load_heldout_tasks, load_tasks
from rlbus.common.model.init_model import init_model
from rlbus.producers.agent_loops import make_agent_loop
from rlbus.producers.agent_loops.openai_agent import AgentFailed
from rlbus.producers.agents.verifiers import EpisodeFailed, verifiers_agent
from rlbus.producers.engines.hf import HFEngine
from rlbus.producers.rewards import load_reward
from rlbus.schemas.config import HFEngineConfig
from rlbus.schemas.config_io import from_dict
from rlbus.schemas.errors import ConfigError
from rlbus.trainer.engine import token_log_probs
from tests.fixtures.vf_envs import ENV_DIR
from tests.support.engines import one_torch_thread  # noqa: F401 - a fixture (pytestmark below)

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = "tests.fixtures.vf_envs"

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", autouse=True)
def vf_env_path():
    """The fixture tasksets importable, as if installed: here, and in the processes verifiers starts (the tool
    server, `python -m vf_calc`, reads PYTHONPATH)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(ENV_DIR))
        mp.setenv("PYTHONPATH", os.pathsep.join([str(ENV_DIR), str(ROOT), os.environ.get("PYTHONPATH", "")]))
        yield


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # 60 warm-start steps (~10 s): the model answers in <answer> tags and calls the calculator about half the time.
    return init_model(tmp_path_factory.mktemp("vf") / "model", steps=60, check_target=0, num_threads=1,
                      log=lambda *_: None)


@pytest.fixture(scope="module")
def policy(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def run_config(model_dir, load: str, **env):
    return from_dict({
        "model": {"path": str(model_dir)},
        "env": {"type": "verifiers", "load": f"{FIXTURES}:{load}", **env},
        "rollout": {"max_new_tokens": 40, "max_response_tokens": 160},
    })


# ---------------------------------------------------------------------------------------------------------------
# tasks


@pytest.mark.parametrize("load", ["single", "multi_turn", "tools"])
def test_rows_become_tasks_and_the_last_num_heldout_are_kept_out_of_training(model_dir, load):
    cfg = run_config(model_dir, load, num_heldout=4)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    train, held = load_tasks(cfg, tokenizer), load_heldout_tasks(cfg, 0, tokenizer)
    assert [ex.extra_info["vf_idx"] for ex in train] == list(range(8))
    assert [ex.extra_info["vf_idx"] for ex in held] == [8, 9, 10, 11]
    assert {ex.extra_info["vf_split"] for ex in [*train, *held]} == {"train"}
    assert {ex.prompt[-1].content for ex in train}.isdisjoint(ex.prompt[-1].content for ex in held)
    first = train[0]
    assert [m.role for m in first.prompt] == ["system", "user"] and first.prompt[-1].content.startswith("What is")
    assert first.ground_truth.isdigit() and first.data_source.startswith("verifiers/vf_")
    assert len(load_heldout_tasks(cfg, 2, tokenizer)) == 2


def test_an_environment_with_an_eval_split_is_evaluated_on_it_less_its_training_rows(model_dir):
    cfg = run_config(model_dir, "with_eval_split")
    train, held = load_tasks(cfg), load_heldout_tasks(cfg, 0)
    assert len(train) == 12
    # The eval split holds problems 8..15 of the generator; 8..11 are training rows 8..11 (at positions 0..3 there).
    assert [ex.extra_info["vf_idx"] for ex in held] == [4, 5, 6, 7]
    assert {ex.extra_info["vf_split"] for ex in held} == {"eval"}
    assert {ex.prompt[-1].content for ex in train}.isdisjoint(ex.prompt[-1].content for ex in held)


def test_without_an_eval_split_held_out_rows_need_num_heldout(model_dir):
    with pytest.raises(ConfigError) as e:
        load_heldout_tasks(run_config(model_dir, "single"), 4)
    assert e.value.field == "env.num_heldout"
    with pytest.raises(ConfigError) as e:
        load_tasks(run_config(model_dir, "single", num_heldout=12))
    assert e.value.field == "env.num_heldout"


@pytest.mark.parametrize("load,expect", [
    ("no_such_function", "has no attribute"),
    ("not_an_env", "not a verifiers environment"),
])
def test_a_bad_load_is_a_config_error_naming_env_load(model_dir, load, expect):
    cfg = run_config(model_dir, load)
    for build in (load_tasks, verifiers_agent):  # the feeder's side and the producer's
        with pytest.raises(ConfigError) as e:
            build(cfg)
        assert e.value.field == "env.load" and expect in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_tasks(from_dict({"model": {"path": str(model_dir)},
                              "env": {"type": "verifiers", "load": "no_such_package.envs:load"}}))
    assert e.value.field == "env.load" and "no_such_package" in str(e.value)


@pytest.mark.parametrize("load,expect", [
    ("at_another_temperature", "samples at temperature=0.3, the run at rollout.temperature=1"),
    ("in_a_sandbox", "seat 'agent' runs in runtime 'prime'"),
])
def test_a_seat_the_producer_cannot_run_as_trained_is_refused_at_load(model_dir, load, expect):
    with pytest.raises(ConfigError) as e:
        verifiers_agent(run_config(model_dir, load))
    assert e.value.field == "env.load" and expect in str(e.value)


def test_a_task_whose_row_is_not_the_producers_is_refused(model_dir):
    """A producer whose environment gives another row at the released index (versions differ) scores nothing."""
    agent, _ = verifiers_agent(run_config(model_dir, "single"))
    released = load_tasks(run_config(model_dir, "single"))[3]
    task = example_to_task(released, task_id="t3", n=1)
    assert agent.row(task)[1].data.prompt == released.prompt[-1].content
    for info, expect in [({**task.extra_info, "vf_key": "another"}, "is not the row the feeder released"),
                         ({"rg_index": 3}, "names no verifiers row")]:
        with pytest.raises(EpisodeFailed, match=expect):
            agent.row(msgspec.structs.replace(task, extra_info=info))


# ---------------------------------------------------------------------------------------------------------------
# episodes


async def rollout(model_dir, load: str, num_tasks: int, n: int):
    """(tasks, groups, tokenizer) of `num_tasks` training tasks of `load`, `n` episodes each, on the HF engine."""
    cfg = run_config(model_dir, load)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = HFEngine(str(model_dir), HFEngineConfig(), seed=0)
    loop = make_agent_loop(cfg, engine, tokenizer, {}, load_reward(cfg.rollout))
    tasks = [example_to_task(ex, task_id=f"t{ex.index}", n=n) for ex in load_tasks(cfg, tokenizer)[:num_tasks]]
    try:
        groups = await loop.rollout_many(tasks, n)
    finally:
        await loop.close()
        await engine.close()
    return tasks, groups, tokenizer


def turns(traj, tokenizer) -> tuple[list[str], list[str]]:
    """(what the model said, turn by turn; what the environment inserted between) as text: the runs of mask-1 tokens
    and of mask-0 tokens of the response."""
    said, inserted, run, mask = [], [], [], None
    for token, m in [*zip(traj.response_ids, traj.response_mask), (None, None)]:
        if m != mask and run:
            (said if mask else inserted).append(tokenizer.decode(run, skip_special_tokens=False))
            run = []
        if token is not None:
            run.append(token)
        mask = m
    return [s.removesuffix(tokenizer.eos_token) for s in said], inserted


def assert_token_exact(policy, traj) -> None:
    """Mask 1 exactly where the engine sampled: there the captured log-probs are the trainer's (temperature 1);
    elsewhere (what the environment inserted) log-prob 0 and version -1."""
    ids_BT = torch.tensor([traj.prompt_ids + traj.response_ids])
    with torch.no_grad():
        logits_BTV = policy(input_ids=ids_BT).logits
    recomputed = token_log_probs(logits_BTV, ids_BT, 1.0)[0, len(traj.prompt_ids):]
    mask = torch.tensor(traj.response_mask).bool()
    captured = torch.tensor(traj.log_probs)
    assert mask.any() and (recomputed[mask] - captured[mask]).abs().max() < 1e-4
    assert captured[~mask].eq(0).all()
    assert all(v == (0 if m else -1) for v, m in zip(traj.versions, traj.response_mask))


def rubric(load: str, answer: str, said: list[str]) -> float:
    """The environment's rubric, recomputed from the model's captured turns with the fixtures' own scoring."""
    from vf_arith import answered
    from vf_guess import FORMAT_WEIGHT, guessed

    if load == "multi_turn":
        solved = any(guessed(s) == int(answer) for s in said)
        return float(solved) + FORMAT_WEIGHT * sum(answered(s) is not None for s in said) / len(said)
    # The last reply's answer; a reply that is a tool call has no text of its own (its call is not an answer).
    last = said[-1] if "<tool_call>" not in said[-1] else ""
    return 1.0 if answered(last) == answer else 0.0


@pytest.mark.parametrize("load,num_tasks,n", [("single", 2, 2), ("multi_turn", 2, 2), ("tools", 2, 4)])
async def test_a_group_is_episodes_of_the_environment_captured_token_exact_and_scored_by_its_rubric(
        model_dir, policy, load, num_tasks, n):
    tasks, groups, tokenizer = await rollout(model_dir, load, num_tasks, n)
    assert [len(g) for g in groups] == [n] * num_tasks  # one sequence per episode: its turns extend one context
    trajs = [t for g in groups for t in g]
    for task, group in zip(tasks, groups):
        for traj in group:
            assert_token_exact(policy, traj)
            said, inserted = turns(traj, tokenizer)
            assert len(said) == traj.num_turns
            assert traj.reward == pytest.approx(rubric(load, task.ground_truth, said))
    if load == "multi_turn":  # the environment answered wrong guesses, as a user turn the model did not sample
        answered_back = [t for t in trajs if t.num_turns >= 2]
        assert answered_back
        for traj in answered_back:
            said, inserted = turns(traj, tokenizer)
            assert all("Try again." in text or "between <answer> tags" in text for text in inserted)
            assert not any("Try again." in text for text in said)
    if load == "tools":  # the calculator ran in the environment's MCP server, on the model's own call
        from vf_calc import calculate

        called = [t for t in trajs if t.num_tool_calls >= 1]
        assert called, "no episode called the calculator (the fixture model does about half the time)"
        for traj in called:
            said, inserted = turns(traj, tokenizer)
            call = json.loads(re.search(r"<tool_call>(.*?)</tool_call>", said[0], re.DOTALL).group(1))
            result = re.search(r"<tool_response>(.*?)</tool_response>", inserted[0], re.DOTALL).group(1).strip()
            assert result == calculate(call["arguments"]["expression"])
    if load == "single":
        assert all(t.num_turns == 1 for t in trajs)


async def test_a_rubric_paying_a_non_finite_reward_fails_the_rollout_naming_it(model_dir):
    with pytest.raises(AgentFailed) as e:
        await rollout(model_dir, "paying_nan", 1, 1)
    assert "the rubric of 'vf_arith' (correct) scored nan" in str(e.value)
