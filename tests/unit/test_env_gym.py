"""The gym environment's tasks and agent loop, on the real quickstart tokenizer, a scripted engine and a real
Gymnasium text game (tests/fixtures/text_games.py): observations go in as context (mask 0), the model's turns are
its actions (mask 1), the reward is what the game paid, and a misbehaving game fails its task with the reason.

    .venv/bin/python -m pytest -q tests/unit/test_env_gym.py
"""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("gymnasium", reason="the gym environment's extra: pip install 'rlbus[gym]'")

from rlbus.common.envs import load_heldout_tasks, load_tasks  # noqa: E402
from rlbus.common.data.datasets import example_to_task  # noqa: E402
from rlbus.common.envs.gym import EnvProtocolError  # noqa: E402
from rlbus.common.model.tokenizer import build_tokenizer  # noqa: E402
from rlbus.producers.agent_loops import make_agent_loop  # noqa: E402
from rlbus.producers.agent_loops.base import EpisodeTimeout  # noqa: E402
from rlbus.producers.rewards import env_reward  # noqa: E402
from rlbus.schemas.config_io import from_dict  # noqa: E402
from rlbus.schemas.errors import ConfigError  # noqa: E402
from tests.fixtures.text_games import GuessNumber  # noqa: E402
from tests.unit.test_agent_loop import LOGP, ScriptedEngine  # noqa: E402

GAME = "tests.fixtures.text_games:GuessNumber"


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _cfg(make: str = GAME, **rollout):
    return from_dict({"model": {"path": "unused"},
                      "env": {"type": "gym", "make": make, "kwargs": {"high": 8}, "num_tasks": 12,
                              "system_prompt": "You play games."},
                      "rollout": {"max_turns": 3, "max_response_tokens": 200, **rollout}})


def _secret(seed: int) -> int:
    return GuessNumber(high=8).reset(seed=seed)[1]["secret"]


def test_tasks_are_reset_seeds_and_held_out_seeds_are_others(tok):
    cfg = _cfg()
    train, held = load_tasks(cfg, tok), load_heldout_tasks(cfg, 5, tok)
    assert len(train) == 12 and len(held) == 5
    seeds = [ex.extra_info["gym_seed"] for ex in train]
    assert seeds == list(range(12)) and not {ex.extra_info["gym_seed"] for ex in held} & set(seeds)
    ex = train[3]
    assert [m.role for m in ex.prompt] == ["system", "user"]
    assert ex.prompt[1].content == GuessNumber(high=8).reset(seed=3)[0]


async def test_an_episode_interleaves_sampled_actions_and_observations(tok):
    cfg = _cfg()
    train = load_tasks(cfg, tok)
    task = example_to_task(train[0], task_id="t0", n=2)
    secret = _secret(0)
    low = 1 if secret != 1 else 2
    # Sample 0 guesses wrong, then right; sample 1 writes no number until rollout.max_turns ends its episode.
    engine = ScriptedEngine(tok, [[str(low) if low != secret else "8", str(secret)], ["hmm", "well", "no"]])
    loop = make_agent_loop(cfg, engine, tok, {}, env_reward(cfg))
    win, lose = await loop.rollout_group(task, 2)

    assert (win.reward, win.finish_reason, win.num_turns) == (1.0, "stop", 2)
    assert (lose.reward, lose.finish_reason, lose.num_turns) == (0.0, "max_turns", 3)
    for traj in (win, lose):
        assert [m.role for m in traj.messages[2:]] == ["assistant", "user"] * (traj.num_turns - 1) + ["assistant"]
        # Every token of the response is the model's (mask 1, its log-prob, a version) or the game's (0, 0.0, -1).
        for m, lp, v in zip(traj.response_mask, traj.log_probs, traj.versions):
            assert (lp, v >= 0) == (LOGP, True) if m else (lp, v) == (0.0, -1)
        # prompt + response is the chat template's tokenization of the conversation (minus the last "\n").
        full = tok.apply_chat_template([{"role": m.role, "content": m.content} for m in traj.messages],
                                       tokenize=True)
        full = list(full["input_ids"] if hasattr(full, "keys") else full)
        assert traj.prompt_ids + traj.response_ids == full[:-1]
    observed = tok.decode([t for t, m in zip(win.response_ids, win.response_mask) if m == 0])
    assert "Higher." in observed or "Lower." in observed
    assert "<|im_start|>user" in observed and "<|im_start|>assistant" in observed
    sampled = tok.decode([t for t, m in zip(win.response_ids, win.response_mask) if m == 1])
    assert "Higher." not in sampled and "Lower." not in sampled and str(secret) in sampled


@pytest.mark.parametrize(
    ("mode", "error", "match"),
    [(1, RuntimeError, "server crashed"), (3, EnvProtocolError, "reward nan")],
)
async def test_a_game_that_raises_or_pays_nan_fails_the_task_with_the_reason(tok, mode, error, match):
    cfg = _cfg("tests.fixtures.text_games:Unruly")
    task = example_to_task(load_tasks(cfg, tok)[mode], task_id="t0", n=1)
    loop = make_agent_loop(cfg, ScriptedEngine(tok, [["3", "4"]]), tok, {}, env_reward(cfg))
    with pytest.raises(error, match=match):
        await loop.rollout_group(task, 1)


async def test_a_game_that_hangs_is_cut_off_by_the_episode_timeout(tok):
    cfg = _cfg("tests.fixtures.text_games:Unruly", episode_timeout_s=0.5)
    task = example_to_task(load_tasks(cfg, tok)[2], task_id="t0", n=1)
    loop = make_agent_loop(cfg, ScriptedEngine(tok, [["3"]]), tok, {}, env_reward(cfg))
    with pytest.raises(EpisodeTimeout, match="episode_timeout_s=0.5"):
        await asyncio.wait_for(loop.rollout_group(task, 1), 10)


def test_a_bad_make_is_a_config_error_naming_the_key(tok):
    with pytest.raises(ConfigError, match="env.make"):
        load_tasks(_cfg("tests.fixtures.text_games:NoSuchGame"), tok)
    with pytest.raises(ConfigError, match="env.make"):
        load_tasks(_cfg("NoSuchGame-v0"), tok)


async def test_a_turn_cut_by_max_new_tokens_is_stepped_as_it_is(tok):
    """A turn cut off by a token limit is trained (mask 1) and the environment sees it: the game pays for the
    guess in it, and the episode ends there ("length")."""
    cfg = _cfg(max_new_tokens=2)
    task = example_to_task(load_tasks(cfg, tok)[0], task_id="t0", n=1)
    secret = _secret(0)
    engine = ScriptedEngine(tok, [[f"{secret} is my guess, and I say so at length"]])
    loop = make_agent_loop(cfg, engine, tok, {}, env_reward(cfg))
    [traj] = await loop.rollout_group(task, 1)
    assert (traj.finish_reason, traj.num_turns, traj.reward) == ("length", 1, 1.0)
    assert sum(traj.response_mask) == 2 == len(traj.response_ids)
