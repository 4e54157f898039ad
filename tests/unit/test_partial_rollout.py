"""Partial rollout: samples the staleness bound no longer admits restart on the newest weights, alone.

The engine is the simulated one (no model math, real asyncio timing): with `inflight_updates` a load reaches calls in
flight as vLLM's does, so a version arriving mid-turn interrupts just the samples it makes too stale.

    .venv/bin/python -m pytest -q tests/unit/test_partial_rollout.py
"""

from __future__ import annotations

import asyncio

import pytest

from rlbus.common.model.tokenizer import build_tokenizer
from rlbus.producers.agent_loops import make_agent_loop
from rlbus.producers.agent_loops.base import MAX_RESTARTS, StalenessWatch, Trajectory
from rlbus.producers.engines.simulated import SimulatedEngine
from rlbus.producers.rewards import load_reward
from rlbus.producers.tools import load_tools
from rlbus.schemas import staleness
from rlbus.schemas.config import RunConfig, SimulatedEngineConfig
from rlbus.schemas.config_io import from_dict
from rlbus.schemas.wire import ChatMessage, PromptTask


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _cfg(agent_loop: str = "single_turn", **trainer) -> RunConfig:
    return from_dict({
        "model": {"path": "/unused"},
        "rollout": {"agent_loop": agent_loop, "n": 4, "max_new_tokens": 200, "max_response_tokens": 400,
                    "tools": [] if agent_loop == "single_turn" else ["calculator"], "max_turns": 3},
        "trainer": {"max_staleness": 1, **trainer},
    })


def _loop(cfg: RunConfig, engine, tok, watch: StalenessWatch | None):
    loop = make_agent_loop(cfg, engine, tok, load_tools(cfg.rollout.tools), load_reward(cfg.rollout), seed=0)
    loop.staleness = watch
    return loop


def _instant(tok, seed: int, after_generate):
    """A single-turn loop on an instant simulated engine whose every call ends with `after_generate(engine, watch,
    calls)` (what lands while the turn ends)."""
    cfg = _cfg("single_turn")
    engine = SimulatedEngine(SimulatedEngineConfig(mean_tokens=20, seconds_per_token=0.0, vocab_size=200, seed=seed))
    watch = StalenessWatch(cfg.trainer)
    real_generate, calls = engine.generate, []

    async def generate(prompts, params):
        out = await real_generate(prompts, params)
        calls.append(len(prompts))
        await after_generate(engine, watch, calls)
        return out

    engine.generate = generate
    return cfg, _loop(cfg, engine, tok, watch), watch, calls


TASK = PromptTask(task_id="t", index=0, epoch=0, prompt=[ChatMessage(role="user", content="What is 2+3?")],
                  ground_truth="5")


async def _publish(engine, watch: StalenessWatch, versions: list[int], every_s: float) -> None:
    """What a producer does on each announcement: load the weights, then tell the watch."""
    for v in versions:
        await asyncio.sleep(every_s)
        await engine.load_weights({}, v)
        watch.advance(v)


def _lags(trajs: list[Trajectory], version: int) -> list[int]:
    return [staleness.lag(version, t.oldest_version) for t in trajs if t.oldest_version != staleness.NO_VERSION]


@pytest.mark.parametrize("agent_loop", ["single_turn", "tool"])
async def test_in_flight_interrupt_keeps_every_sample_within_the_bound(tok, agent_loop):
    cfg = _cfg(agent_loop)
    # Long responses (median 120 tokens at 2 ms each, capped at 200): versions arrive every 0.12 s, mid-turn.
    engine = SimulatedEngine(SimulatedEngineConfig(mean_tokens=120, tail_alpha=3.0, seconds_per_token=0.002,
                                                   vocab_size=200, seed=1, inflight_updates=True))
    watch = StalenessWatch(cfg.trainer)
    loop = _loop(cfg, engine, tok, watch)
    publisher = asyncio.create_task(_publish(engine, watch, [1, 2, 3], every_s=0.12))
    trajs = await loop.rollout_group(TASK, cfg.rollout.n)
    await publisher
    assert len(trajs) == 4 and all(t.done for t in trajs)
    assert watch.samples_restarted > 0  # the bound (1) was crossed while samples ran
    assert engine.tokens_interrupted > 0  # turns were cut short, not finished on stale weights
    # What the producer judges: under the bound at the version the samples ended on, or a sample out of restarts.
    for t in trajs:
        assert t.restarts == MAX_RESTARTS or staleness.lag(watch.version, t.oldest_version) <= 1
    for t in trajs:  # a restart leaves a well-formed trajectory: one mask bit, log-prob and version per token
        assert len(t.response_ids) == len(t.response_mask) == len(t.log_probs) == len(t.versions)
        assert t.messages[0].role == "user" and t.num_turns >= 1


async def test_tokens_of_a_turn_that_spans_a_load_carry_both_versions(tok):
    cfg = _cfg("single_turn")
    engine = SimulatedEngine(SimulatedEngineConfig(mean_tokens=150, tail_alpha=5.0, seconds_per_token=0.002,
                                                   vocab_size=200, seed=2, inflight_updates=True))
    watch = StalenessWatch(cfg.trainer)  # max_staleness 1: one new version is within the bound, no restart
    loop = _loop(cfg, engine, tok, watch)
    publisher = asyncio.create_task(_publish(engine, watch, [1], every_s=0.1))
    trajs = await loop.rollout_group(TASK, cfg.rollout.n)
    await publisher
    assert watch.samples_restarted == 0
    spanning = [t for t in trajs if set(t.versions) == {0, 1}]
    assert spanning, [sorted(set(t.versions)) for t in trajs]
    for t in spanning:  # versions only go up along a sequence
        assert t.versions == sorted(t.versions)


async def test_without_in_flight_updates_samples_that_finished_early_restart_once_the_version_is_known(tok):
    async def two_versions_after_the_first_call(engine, watch, calls):
        if len(calls) == 1:  # two versions land while the first turn ends: every sample is 2 behind, bound 1
            await engine.load_weights({}, 2)
            watch.advance(2)

    cfg, loop, watch, calls = _instant(tok, 3, two_versions_after_the_first_call)
    trajs = await loop.rollout_group(TASK, cfg.rollout.n)
    # One call per sample, and one more for each sample the new version found finished (or begun) on v0.
    assert calls == [1] * (4 + watch.samples_restarted)
    assert watch.samples_restarted >= 1 and watch.tokens_discarded > 0
    assert all(set(t.versions) == {2} and t.restarts <= 1 for t in trajs)


async def test_restarts_are_bounded(tok):
    async def always_two_ahead(engine, watch, calls):
        version = 2 * len(calls)  # the trainer always races two versions ahead: no sample can ever be fresh
        await engine.load_weights({}, version)
        watch.advance(version)

    cfg, loop, watch, _ = _instant(tok, 4, always_two_ahead)
    trajs = await loop.rollout_group(TASK, cfg.rollout.n)
    assert all(t.restarts == MAX_RESTARTS for t in trajs)
    assert watch.samples_restarted == MAX_RESTARTS * cfg.rollout.n


def test_restart_goes_back_to_the_prompt():
    t = Trajectory(prompt_ids=[1, 2], messages=[ChatMessage(role="user", content="q")])
    t.add_generated([5, 6], [-0.1, -0.2], [3, 3])
    t.messages.append(ChatMessage(role="assistant", content="a"))
    t.add_inserted([7])
    t.num_turns, t.num_tool_calls, t.finish_reason = 1, 1, "length"
    assert t.restart() == 2
    assert (t.response_ids, t.response_mask, t.log_probs, t.versions) == ([], [], [], [])
    assert [m.content for m in t.messages] == ["q"] and t.prompt_ids == [1, 2]
    assert (t.num_turns, t.num_tool_calls, t.finish_reason, t.restarts) == (0, 0, None, 1)


def test_the_watch_only_restarts_under_the_drop_policy():
    cfg = _cfg("single_turn", staleness_policy="correct")
    watch = StalenessWatch(cfg.trainer, version=9)
    t = Trajectory(prompt_ids=[1])
    t.add_generated([5], [-0.1], [0])
    assert not watch.too_stale(t)  # `correct` keeps every group for the importance weights
    cfg = _cfg("single_turn")
    watch = StalenessWatch(cfg.trainer, version=2)
    assert watch.too_stale(t) and not watch.too_stale(Trajectory(prompt_ids=[1]))
    assert watch.too_stale(Trajectory(prompt_ids=[1]), in_flight_since=0)  # the turn in flight began at v0
    assert not StalenessWatch(cfg.trainer, version=1).too_stale(t)


def test_partial_rollout_is_on_by_default_and_can_be_switched_off():
    assert _cfg().rollout.partial_rollout
    cfg = from_dict({"model": {"path": "/unused"}, "rollout": {"partial_rollout": False}})
    assert not cfg.rollout.partial_rollout
