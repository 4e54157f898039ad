"""The producer's OpenAI-compatible endpoint, served over real HTTP on loopback to the real `openai` client, backed by
the HF engine on a tiny warm-started quickstart model (it calls the calculator about half the time).

What a user relies on: an OpenAI agent's multi-turn, tool-calling conversations come back as sequences whose
behaviour log-probs are the trainer's own at the same weights (importance weight 1), with mask 1 exactly on sampled
tokens; a bad request gets the error the client raises for it; a key works only while its rollout runs.

    .venv/bin/python -m pytest -q tests/integration/test_endpoint.py
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlbus.common.data.datasets import load_dataset
from rlbus.common.model.demos import prompt_messages
from rlbus.common.model.init_model import init_model
from rlbus.producers.agent_loops import make_agent_loop
from rlbus.producers.agent_loops.openai_agent import AgentFailed
from rlbus.producers.agents.calculator import CALCULATOR_TOOL
from rlbus.producers.endpoint import Endpoint
from rlbus.producers.engines.hf import HFEngine
from rlbus.producers.rewards import load_reward
from rlbus.schemas.config import HFEngineConfig
from rlbus.schemas.config_io import from_dict
from rlbus.schemas.wire import PromptTask
from rlbus.trainer.engine import token_log_probs
from tests.support.engines import one_torch_thread  # noqa: F401 - a fixture (pytestmark below)

AGENT = "rlbus.producers.agents.calculator:rollout"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # 60 warm-start steps (~10 s): enough for the model to call the calculator in about half of its first turns.
    return init_model(tmp_path_factory.mktemp("endpoint") / "model", steps=60, check_target=0, num_threads=1,
                      log=lambda *_: None)


def run_config(model_dir, function: str = AGENT, **rollout):
    return from_dict(
        {
            "model": {"path": str(model_dir)},
            "data": {"type": "synthetic", "num_examples": 16},
            "rollout": {
                "agent_loop": "openai",
                "openai": {"function": function},
                "max_new_tokens": 40,
                "max_response_tokens": 120,
                **rollout,
            },
        }
    )


@contextlib.asynccontextmanager
async def started(model_dir, **rollout):
    """(config, engine, agent loop) with the endpoint started; the engine's sampling is seeded."""
    cfg = run_config(model_dir, **rollout)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = HFEngine(str(model_dir), HFEngineConfig(), seed=0)
    loop = make_agent_loop(cfg, engine, tokenizer, {}, load_reward(cfg.rollout))
    await loop._ensure_started()
    try:
        yield cfg, engine, loop
    finally:
        await loop.close()
        await engine.close()


@pytest.fixture(scope="module")
async def stack(model_dir):
    async with started(model_dir) as s:
        yield s


@pytest.fixture(scope="module")
async def hot_stack(model_dir):
    """A run sampling at temperature 3: the model rarely picks its eos, so replies run long."""
    async with started(model_dir, temperature=3.0) as s:
        yield s


@pytest.fixture(scope="module")
def policy(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def tasks(cfg, k: int) -> list[PromptTask]:
    data = load_dataset(cfg.data, None)
    return [PromptTask(task_id=f"t{i}", prompt=data[i].prompt, ground_truth=data[i].ground_truth) for i in range(k)]


def trainer_log_probs(policy, traj, temperature: float) -> torch.Tensor:
    """What the trainer computes for the sequence (trainer/engine.py), at the response positions."""
    ids_BT = torch.tensor([traj.prompt_ids + traj.response_ids])
    with torch.no_grad():
        logits_BTV = policy(input_ids=ids_BT).logits
    return token_log_probs(logits_BTV, ids_BT, temperature)[0, len(traj.prompt_ids) :]


def assert_token_exact(policy, traj, temperature: float = 1.0) -> None:
    mask = torch.tensor(traj.response_mask).bool()
    captured = torch.tensor(traj.log_probs)
    recomputed = trainer_log_probs(policy, traj, temperature)
    assert (recomputed[mask] - captured[mask]).abs().max() < 1e-4  # importance weight 1 at the same version
    assert captured[~mask].eq(0).all() and all(v == -1 for v, m in zip(traj.versions, traj.response_mask) if not m)
    assert all(v == 0 for v, m in zip(traj.versions, traj.response_mask) if m)


def agents_sdk(function: str = "rollout") -> str:
    pytest.importorskip("agents", reason="the OpenAI Agents SDK is the optional extra rlbus[agents]")
    return f"rlbus.producers.agents.agents_sdk:{function}"


@pytest.mark.parametrize("agent", ["plain", "agents_sdk", "agents_sdk_streamed"])
async def test_tool_calling_conversations_are_captured_token_exact(model_dir, stack, policy, agent):
    """The calculator agent as plain openai-client code, and written with the OpenAI Agents SDK (run whole, and
    streamed: the SDK reads the endpoint's server-sent events, tool calls included)."""
    cfg, engine, base = stack
    loop = base
    if agent != "plain":
        cfg = run_config(model_dir, agents_sdk("rollout_streamed" if agent.endswith("streamed") else "rollout"))
        loop = make_agent_loop(cfg, engine, base.tokenizer, {}, load_reward(cfg.rollout))
    try:
        groups = await loop.rollout_many(tasks(cfg, 3), 4)
    finally:
        if loop is not base:
            await loop.close()
    trajs = [t for g in groups for t in g]
    assert [len(g) for g in groups] == [4, 4, 4]  # one sequence per run of the agent: it never rewrites history
    multi = [t for t in trajs if t.num_tool_calls >= 1 and t.num_turns == 2]
    assert multi, "no conversation called the calculator and answered (the fixture model should, about half the time)"
    for traj in trajs:
        assert_token_exact(policy, traj)
    text = loop.decode(multi[0].response_ids)
    assert "<tool_response>" in text and text.endswith(loop.tokenizer.eos_token)
    # The tool response and the headers around it are context, not trained; every sampled token is.
    inserted = [i for i, m in zip(multi[0].response_ids, multi[0].response_mask) if not m]
    assert "<tool_response>" in loop.decode(inserted) and "<tool_call>" not in loop.decode(inserted)
    # Returning None, the agent leaves scoring to rollout.reward (math): a correct answer scores 1.
    assert all(
        t.reward == (1.0 if f"<answer>{task.ground_truth}</answer>" in loop.decode(t.response_ids) else 0.0)
        for task, g in zip(tasks(cfg, 3), groups)
        for t in g
    )


async def test_n_temperature_and_logprobs_of_one_call(model_dir, policy):
    async with started(model_dir, temperature=0.7) as (_, _, loop):
        endpoint = loop.endpoint
        with endpoint.conversation() as session:
            async with openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=session.key, max_retries=0) as client:
                out = await client.chat.completions.create(
                    model="policy",
                    messages=prompt_messages("What is 12*31?"),
                    tools=[CALCULATOR_TOOL],
                    n=3,
                    temperature=0.7,  # the run's own: a request may restate it
                    logprobs=True,
                    max_tokens=12,
                )
                models = await client.models.list()
    assert [m.id for m in models.data] == ["policy"]
    assert len(out.choices) == 3 and out.usage.completion_tokens <= 36
    trajs = session.capture.trajectories()
    assert len(trajs) == 3
    for choice, traj in zip(out.choices, trajs):
        assert [lp.logprob for lp in choice.logprobs.content] == traj.log_probs
        assert_token_exact(policy, traj, temperature=0.7)


async def test_completions_continue_a_sequence(stack, policy):
    _, _, loop = stack
    endpoint = loop.endpoint
    with endpoint.conversation() as session:
        async with openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=session.key, max_retries=0) as client:
            first = await client.completions.create(
                model="policy", prompt="<|im_start|>user\nWhat is 3+4?", max_tokens=6
            )
            text = "<|im_start|>user\nWhat is 3+4?" + first.choices[0].text + "\n"
            await client.completions.create(model="policy", prompt=text, max_tokens=6)
    [traj] = session.capture.trajectories()
    assert traj.num_turns == 2
    assert_token_exact(policy, traj)


async def test_bad_requests_get_the_errors_the_client_expects(stack):
    _, _, loop = stack
    endpoint = loop.endpoint
    messages = prompt_messages("What is 1+1?")
    async with openai.AsyncOpenAI(base_url=endpoint.base_url, api_key="rlbus-guess", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError):
            await client.chat.completions.create(model="policy", messages=messages)
    with endpoint.conversation() as session:
        async with openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=session.key, max_retries=0) as client:
            create = client.chat.completions.create
            with pytest.raises(openai.NotFoundError) as e:
                await create(model="gpt-4o", messages=messages)
            assert e.value.code == "model_not_found"
            with pytest.raises(openai.BadRequestError) as e:
                await create(model="policy", messages=messages, tools=[{"type": "function", "function": {}}])
            assert e.value.param == "tools[0]"
            with pytest.raises(openai.BadRequestError) as e:
                await create(model="policy", messages=[{"role": "user", "content": "7+" * 1500}])
            assert e.value.code == "context_length_exceeded"
            with pytest.raises(openai.BadRequestError) as e:  # streamed: refused before the stream starts
                await create(model="policy", messages=[{"role": "user", "content": "7+" * 1500}], stream=True)
            assert e.value.code == "context_length_exceeded"
            with pytest.raises(openai.BadRequestError) as e:
                await create(model="policy", messages=messages, temperature=0)
            assert e.value.param == "temperature"
            with pytest.raises(openai.BadRequestError) as e:
                await create(model="policy", messages=messages, stop=["a", "b", "c", "d", "e"])
            assert e.value.param == "stop"
            ok = await create(model="policy", messages=messages, max_tokens=4)
            assert ok.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The key died with its rollout.
    async with openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=session.key, max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError):
            await client.chat.completions.create(model="policy", messages=messages)
    assert endpoint.base_url.startswith("http://127.0.0.1:")


async def agent_with_a_wrong_model(client, task):
    await client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])


async def agent_that_never_calls(client, task):
    return 1.0


async def agent_rewarding_by_itself(client, task):
    await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    return 0.25


@pytest.mark.parametrize(
    "function,expect", [("agent_with_a_wrong_model", "NotFoundError"), ("agent_that_never_calls", "made no model call")]
)
async def test_a_failing_agent_fails_its_rollout(model_dir, stack, function, expect):
    cfg = run_config(model_dir, f"{__name__}:{function}")
    _, engine, base = stack
    loop = make_agent_loop(cfg, engine, base.tokenizer, {}, load_reward(cfg.rollout))
    try:
        with pytest.raises(AgentFailed, match=expect):
            await loop.rollout_group(tasks(cfg, 1)[0], 2)
    finally:
        await loop.close()


async def test_an_agents_own_reward_is_every_sequences_reward(model_dir, stack):
    cfg = run_config(model_dir, f"{__name__}:agent_rewarding_by_itself")
    _, engine, base = stack
    loop = make_agent_loop(cfg, engine, base.tokenizer, {}, load_reward(cfg.rollout))
    try:
        group = await asyncio.wait_for(loop.rollout_group(tasks(cfg, 1)[0], 3), 60)
    finally:
        await loop.close()
    assert [t.reward for t in group] == [0.25] * 3 and all(math.isfinite(sum(t.log_probs)) for t in group)


LOOKUP_TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}


def _is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


async def _chat(endpoint, session, **kwargs):
    async with openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=session.key, max_retries=0) as client:
        return await client.chat.completions.create(model="policy", **kwargs)


async def test_tool_choice_forces_a_call_of_the_right_function_and_none_forbids_one(stack, policy):
    """The same seeded call (8 samples) under each tool_choice: "auto" lets the model answer without a call (it
    calls about half the time), "required" and a named function make every reply a call of the right function,
    "none" makes none a call. Forced tokens are context (never trained); the sampled rest is token-exact."""
    _, _, loop = stack
    endpoint, tok = loop.endpoint, loop.tokenizer
    ask = {"messages": prompt_messages("What is 12*31?"), "n": 8, "seed": 3, "max_tokens": 40}
    with endpoint.conversation() as auto_session:
        auto = await _chat(endpoint, auto_session, tools=[CALCULATOR_TOOL], **ask)
    calls = [bool(c.message.tool_calls) for c in auto.choices]
    assert 0 < sum(calls) < 8, calls  # the model left to itself both calls and answers
    for choice, tools, name in [
        ("required", [CALCULATOR_TOOL], "calculator"),
        ({"type": "function", "function": {"name": "lookup"}}, [CALCULATOR_TOOL, LOOKUP_TOOL], "lookup"),
    ]:
        with endpoint.conversation() as session:
            out = await _chat(endpoint, session, tools=tools, tool_choice=choice, **ask)
        for c in out.choices:
            assert [t.function.name for t in c.message.tool_calls] == [name] and c.message.content is None
            # A call cut by max_tokens says so (the unknown "lookup" sends the tiny model rambling).
            assert c.finish_reason == "tool_calls" or (name == "lookup" and c.finish_reason == "length")
        # The arguments are the model's own: valid JSON mostly for the function it learned, not always (OpenAI's
        # contract too), and nothing it did not write.
        valid = sum(_is_json_object(c.message.tool_calls[0].function.arguments) for c in out.choices)
        assert valid >= (6 if name == "calculator" else 0), [c.message.tool_calls for c in out.choices]
        opening = tok.encode(f'<tool_call>{{"name": "{name}", "arguments":', add_special_tokens=False)
        for traj in session.capture.trajectories():
            # The opening is the prompt's end (the model never sampled it); every response token was sampled.
            assert traj.prompt_ids[-len(opening) :] == opening and all(traj.response_mask)
            assert_token_exact(policy, traj)
    with endpoint.conversation() as session:
        none = await _chat(endpoint, session, tools=[CALCULATOR_TOOL], tool_choice="none", **ask)
    assert all(c.message.tool_calls is None and c.finish_reason in ("stop", "length") for c in none.choices)
    sampled = [t.response_ids for t in auto_session.capture.trajectories()]
    assert [t.response_ids for t in session.capture.trajectories()] == sampled  # the same samples as "auto"'s
    assert any("<tool_call>" in c.message.content for c in none.choices)  # a call the model wrote stays text


async def test_a_forced_opening_inside_a_conversation_is_context(stack, policy):
    """Turn 2 of a conversation under tool_choice "required": the opening lies in the middle of the sequence, mask 0
    like the tool output before it, and the sequence stays one, token-exact."""
    _, _, loop = stack
    endpoint, tok = loop.endpoint, loop.tokenizer
    messages = prompt_messages("What is 12*31?")
    with endpoint.conversation() as session:
        first = await _chat(endpoint, session, messages=messages, tools=[CALCULATOR_TOOL], tool_choice="required")
        message = first.choices[0].message
        messages += [
            message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "372"},
        ]
        second = await _chat(endpoint, session, messages=messages, tools=[CALCULATOR_TOOL], tool_choice="required")
    assert second.choices[0].message.tool_calls[0].function.name == "calculator"
    [traj] = session.capture.trajectories()
    assert traj.num_turns == 2
    opening = tok.encode('<tool_call>{"name": "calculator", "arguments":', add_special_tokens=False)
    inserted = [t for t, m in zip(traj.response_ids, traj.response_mask) if not m]
    assert inserted[-len(opening) :] == opening and "<tool_response>372" in tok.decode(inserted)
    assert_token_exact(policy, traj)


async def _stream_chat(endpoint, session, **kwargs) -> tuple[list[dict], object]:
    """A streamed chat call through the openai client, its chunks folded into one message per choice."""
    async with openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=session.key, max_retries=0) as client:
        stream = await client.chat.completions.create(
            model="policy", stream=True, stream_options={"include_usage": True}, **kwargs
        )
        folded: dict[int, dict] = {}
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
            for c in chunk.choices:
                m = folded.setdefault(c.index, {"content": "", "tool_calls": {}, "finish_reason": None, "lps": []})
                m["content"] += c.delta.content or ""
                for tc in c.delta.tool_calls or ():
                    call = m["tool_calls"].setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                    call["id"] = tc.id or call["id"]
                    call["name"] += tc.function.name or ""
                    call["arguments"] += tc.function.arguments or ""
                if c.logprobs and c.logprobs.content:
                    m["lps"] += [lp.logprob for lp in c.logprobs.content]
                m["finish_reason"] = c.finish_reason or m["finish_reason"]
    return [folded[i] for i in sorted(folded)], usage


@pytest.mark.parametrize("tool_choice", ["auto", "required"])
async def test_a_streamed_call_is_the_same_reply_and_the_same_capture(stack, policy, tool_choice):
    """stream=True through the openai client: the chunks fold into the message the same seeded call returns
    unstreamed (content, tool_calls deltas, finish reason, log-probs, usage), and the captured sequences are equal."""
    _, _, loop = stack
    endpoint = loop.endpoint
    ask = {
        "messages": prompt_messages("What is 7*19?"),
        "tools": [CALCULATOR_TOOL],
        "tool_choice": tool_choice,
        "n": 3,
        "seed": 11,
    }
    with endpoint.conversation() as plain_session:
        plain = await _chat(endpoint, plain_session, logprobs=True, **ask)
    with endpoint.conversation() as stream_session:
        streamed, usage = await _stream_chat(endpoint, stream_session, logprobs=True, **ask)
    assert len(streamed) == 3 and usage.completion_tokens == plain.usage.completion_tokens
    for choice, folded in zip(plain.choices, streamed):
        calls = [(t.id, t.function.name, t.function.arguments) for t in choice.message.tool_calls or ()]
        assert [(c["id"][-2:], c["name"], c["arguments"]) for c in folded["tool_calls"].values()] == [
            (i[-2:], n, a) for i, n, a in calls
        ]
        assert folded["content"] == (choice.message.content or "")
        assert folded["finish_reason"] == choice.finish_reason
        assert folded["lps"] == [lp.logprob for lp in choice.logprobs.content]
    if tool_choice == "required":
        assert all(f["tool_calls"] for f in streamed)
    for a, b in zip(plain_session.capture.trajectories(), stream_session.capture.trajectories(), strict=True):
        assert (a.prompt_ids, a.response_ids, a.response_mask, a.log_probs) == (
            b.prompt_ids,
            b.response_ids,
            b.response_mask,
            b.log_probs,
        )
        assert_token_exact(policy, b)


async def test_a_streamed_completion(stack):
    _, _, loop = stack
    endpoint = loop.endpoint
    prompt = "<|im_start|>user\nWhat is 3+4?<|im_end|>\n<|im_start|>assistant\n"
    with endpoint.conversation() as session:
        async with openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=session.key, max_retries=0) as client:
            plain = await client.completions.create(model="policy", prompt=prompt, max_tokens=12, seed=5)
            stream = await client.completions.create(model="policy", prompt=prompt, max_tokens=12, seed=5, stream=True)
            chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks) == plain.choices[0].text
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason


async def _long_story(client):
    """A streamed call whose reply runs long (on hot_stack, at temperature 3: the model rarely picks its eos)."""
    return await client.chat.completions.create(
        model="policy", messages=prompt_messages("Tell me a long story."), max_tokens=100, seed=4, stream=True,
    )


async def test_a_stream_sends_text_while_the_reply_is_sampled(hot_stack):
    """The first content delta reaches the client before the call is over (its capture is recorded when the engine
    returns), and later deltas keep coming: the reply is streamed, not sampled whole and then sent."""
    _, _, loop = hot_stack
    endpoint = loop.endpoint
    with endpoint.conversation() as session:
        async with openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=session.key, max_retries=0) as client:
            stream = await _long_story(client)
            deltas, recorded_at_first = [], None
            async for chunk in stream:
                for c in chunk.choices:
                    if c.delta.content:
                        if recorded_at_first is None:
                            recorded_at_first = session.capture.num_calls
                        deltas.append(c.delta.content)
        [traj] = session.capture.trajectories()
    assert recorded_at_first == 0, "the first delta came after the reply was sampled whole"
    assert sum(traj.response_mask) > 30 and len(deltas) > 10, (len(deltas), sum(traj.response_mask))


class FailsMidway(HFEngine):
    """The real engine, whose generation breaks after its first tokens were reported (as a dead engine core's)."""

    async def generate(self, prompts, params, on_tokens=None):
        gens = await super().generate(prompts, params)
        if on_tokens is not None:
            for i, gen in enumerate(gens):
                on_tokens(i, gen.token_ids[:3], gen.log_probs[:3])
        await asyncio.sleep(0.05)
        raise RuntimeError("engine core died")


async def test_a_failure_after_the_first_delta_ends_the_stream_with_an_error(model_dir):
    """The client raises OpenAI's APIError from the error event; the rollout carries the engine's error."""
    cfg = run_config(model_dir, temperature=3.0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = FailsMidway(str(model_dir), HFEngineConfig(), seed=0)
    endpoint = Endpoint(engine, tokenizer, cfg.rollout)
    await endpoint.start()
    try:
        with endpoint.conversation() as session:
            got = []
            async with openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=session.key, max_retries=0) as client:
                stream = await client.chat.completions.create(
                    model="policy", messages=prompt_messages("What is 2+2?"), max_tokens=20, temperature=3.0, seed=1,
                    stream=True,
                )
                with pytest.raises(openai.APIError, match="engine core died"):
                    async for chunk in stream:
                        got += [c.delta.content for c in chunk.choices if c.delta.content]
            assert got, "the stream failed before its first delta"
            assert isinstance(session.capture.failure, RuntimeError) and session.capture.trajectories() == []
    finally:
        await endpoint.close()
        await engine.close()


async def test_a_client_that_hangs_up_cancels_its_call(hot_stack):
    """A stream closed after its first delta: the call is cancelled (nothing of it captured), the endpoint answers
    the next call."""
    _, _, loop = hot_stack
    endpoint = loop.endpoint
    with endpoint.conversation() as session:
        async with openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=session.key, max_retries=0) as client:
            stream = await _long_story(client)
            async for chunk in stream:
                if any(c.delta.content for c in chunk.choices):
                    break
            await stream.close()
            await asyncio.sleep(0.5)
            assert session.capture.num_calls == 0
            ok = await client.chat.completions.create(model="policy", messages=prompt_messages("2+2?"), max_tokens=4)
            assert ok.choices[0].finish_reason in ("stop", "length", "tool_calls") and session.capture.num_calls == 1


async def test_a_stop_sequence_ends_the_reply_and_the_sequence_at_its_token(stack, policy):
    """The same seeded call without and with a stop sequence taken from the middle of its reply: the reply stops
    before it, the sequence holds exactly the tokens sampled up to the one that completed it (the same ids and
    log-probs as the unstopped reply's first tokens), and a later call continues it with the eos inserted, mask 0."""
    _, _, loop = stack
    endpoint, tok = loop.endpoint, loop.tokenizer
    messages = prompt_messages("What is 25+17?")
    with endpoint.conversation() as session:
        free = await _chat(endpoint, session, messages=messages, seed=7, max_tokens=30)
    [whole] = session.capture.trajectories()
    text = free.choices[0].message.content
    assert len(text) >= 12, text
    stop = text[6:9]
    assert stop not in text[:8]  # its first occurrence is where we cut it from
    with endpoint.conversation() as session:
        out = await _chat(endpoint, session, messages=messages, seed=7, max_tokens=30, stop=[stop, "never-seen"])
        assert out.choices[0].message.content == text[:6] and out.choices[0].finish_reason == "stop"
        [traj] = session.capture.trajectories()
        k = len(traj.response_ids)
        assert traj.response_ids == whole.response_ids[:k] and traj.log_probs == whole.log_probs[:k]
        assert stop in tok.decode(traj.response_ids) and stop not in tok.decode(traj.response_ids[:-1])
        assert traj.finish_reason == "stop" and out.usage.completion_tokens == k
        reply = out.choices[0].message.model_dump(exclude_none=True)
        await _chat(endpoint, session, messages=messages + [reply, {"role": "user", "content": "and?"}], max_tokens=5)
    [traj] = session.capture.trajectories()
    assert traj.response_ids[k] == tok.eos_token_id and traj.response_mask[k] == 0  # the eos it never sampled
    assert_token_exact(policy, traj)


EXTERNAL_AGENT = Path(__file__).resolve().parents[1] / "fixtures" / "external_agent.py"


def command_loop(model_dir, engine, tokenizer, **openai_cfg):
    cfg = run_config(model_dir, openai={"command": [sys.executable, str(EXTERNAL_AGENT)], **openai_cfg})
    return cfg, make_agent_loop(cfg, engine, tokenizer, {}, load_reward(cfg.rollout))


async def test_an_agent_in_another_process_drives_its_rollouts(model_dir, stack, policy, monkeypatch):
    """rollout.openai.command: a plain openai-client program (tests/fixtures/external_agent.py, no rlbus import) runs
    once per rollout with its own key and base URL in the environment; its calls are captured token-exact."""
    _, engine, base = stack
    # The first call names the calculator (tool_choice): each rollout is two turns around a tool call, whatever
    # the tiny model would have chosen (left to it, 4 samples made no call in one run of make test).
    monkeypatch.setenv("AGENT_TOOL_CHOICE", "calculator")
    cfg, loop = command_loop(model_dir, engine, base.tokenizer)
    try:
        groups = await loop.rollout_many(tasks(cfg, 2), 2)
    finally:
        await loop.close()
    trajs = [t for g in groups for t in g]
    assert [len(g) for g in groups] == [2, 2]
    assert all(t.num_tool_calls >= 1 and t.num_turns == 2 for t in trajs)
    for traj in trajs:
        assert_token_exact(policy, traj)
    assert loop.endpoint._sessions == {}  # every key died with its rollout


@pytest.mark.parametrize("mode,expect", [("bad_model", "exited with code 1.*NotFoundError"), ("hang", "TimeoutError")])
async def test_a_failing_or_hanging_agent_process_fails_its_rollout(
    model_dir, stack, tmp_path, monkeypatch, mode, expect
):
    _, engine, base = stack
    monkeypatch.setenv("AGENT_MODE", mode)
    monkeypatch.setenv("AGENT_PID_FILE", str(tmp_path / "pid"))
    cfg, loop = command_loop(model_dir, engine, base.tokenizer, timeout_s=4.0)
    try:
        with pytest.raises(AgentFailed, match=expect):
            await loop.rollout_group(tasks(cfg, 1)[0], 1)
    finally:
        await loop.close()
    if mode == "hang":  # the rollout's timeout killed the process
        pid = int((tmp_path / "pid").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


AGENT_HOST = """
import sys, types
from rlbus.bus.loop import run
from rlbus.producers.agent_loops.openai_agent import command_agent
from rlbus.schemas.wire import PromptTask
client = types.SimpleNamespace(base_url="http://127.0.0.1:9/v1", api_key="rlbus-k")
task = PromptTask(task_id="t", prompt=[{"role": "user", "content": "1+1"}], ground_truth="2", n=1)
run(command_agent(sys.argv[1:], "policy")(client, task))
"""


def test_an_agent_process_dies_with_its_producer(tmp_path, monkeypatch):
    """A producer SIGKILLed mid-rollout leaves no agent program behind: the kernel ends the command's process (the
    agent loop's own code, on the event loop the producer runs, in a process of its own that the test kills)."""
    pid_file = tmp_path / "pid"
    monkeypatch.setenv("AGENT_MODE", "hang")
    monkeypatch.setenv("AGENT_PID_FILE", str(pid_file))
    host = subprocess.Popen([sys.executable, "-c", AGENT_HOST, sys.executable, str(EXTERNAL_AGENT)])
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text().strip()):
            assert host.poll() is None and time.monotonic() < deadline, "the agent program never started"
            time.sleep(0.1)
        agent = int(pid_file.read_text())
        os.kill(agent, 0)  # running, under the host
    finally:
        host.kill()
        host.wait()
    deadline = time.monotonic() + 10
    while True:
        try:
            os.kill(agent, 0)
        except ProcessLookupError:
            break
        # a zombie until its new parent reaps it counts as ended
        if Path(f"/proc/{agent}/stat").read_text().split(") ")[1].startswith("Z"):
            break
        assert time.monotonic() < deadline, f"agent {agent} outlived its producer"
        time.sleep(0.1)


@pytest.mark.parametrize(
    "asked, param",
    [({"temperature": 0.5}, "temperature"), ({"top_p": 0.9}, "top_p"), ({"extra_body": {"top_k": 20}}, "top_k")],
)
async def test_sampling_parameters_other_than_the_runs_are_refused(stack, asked, param):
    """The trainer recomputes every sample at rollout.temperature / top_p / top_k: a request asking for other values
    is refused with OpenAI's error naming the parameter, and nothing is sampled or captured; restating the run's
    own values is fine, on both routes."""
    cfg, _, loop = stack
    endpoint = loop.endpoint
    with endpoint.conversation() as session:
        async with openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=session.key, max_retries=0) as client:
            with pytest.raises(openai.BadRequestError) as e:
                await client.chat.completions.create(model="policy", messages=prompt_messages("1+1?"), max_tokens=4,
                                                     **asked)
            assert e.value.param == param and f"rollout.{param}" in str(e.value)
            with pytest.raises(openai.BadRequestError) as e:
                await client.completions.create(model="policy", prompt="<|im_start|>user\n1+1?", max_tokens=4, **asked)
            assert e.value.param == param
            assert session.capture.num_calls == 0
            same = {"temperature": cfg.rollout.temperature, "top_p": cfg.rollout.top_p,
                    "extra_body": {"top_k": cfg.rollout.top_k}}
            await client.chat.completions.create(model="policy", messages=prompt_messages("1+1?"), max_tokens=4, **same)
            assert session.capture.num_calls == 1


async def test_an_over_long_completion_prompt_names_the_prompt(stack):
    _, _, loop = stack
    endpoint = loop.endpoint
    with endpoint.conversation() as session:
        async with openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=session.key, max_retries=0) as client:
            with pytest.raises(openai.BadRequestError) as e:
                await client.completions.create(model="policy", prompt="7+" * 3000, max_tokens=4)
    assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
