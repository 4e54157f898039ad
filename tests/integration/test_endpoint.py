"""The producer's OpenAI-compatible endpoint, served over real HTTP on loopback to the real `openai` client, backed by
the HF engine on a tiny warm-started quickstart model (it calls the calculator about half the time).

What a user relies on: an OpenAI agent's multi-turn, tool-calling conversations come back as sequences whose
behaviour log-probs are the trainer's own at the same weights (importance weight 1), with mask 1 exactly on sampled
tokens; a bad request gets the error the client raises for it; a key works only while its rollout runs.

    .venv/bin/python -m pytest -q tests/integration/test_endpoint.py
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from rlbus.bus.proc import state as proc_state
from rlbus.common.model.demos import prompt_messages
from rlbus.producers.agent_loops import make_agent_loop
from rlbus.producers.agent_loops.openai_agent import AgentFailed
from rlbus.producers.agents.calculator import CALCULATOR_TOOL
from rlbus.producers.rewards import load_reward
from tests.support.endpoint import (  # noqa: F401 - fixtures among them
    AGENT,
    assert_token_exact,
    chat,
    hot_stack,
    model_dir,
    policy,
    run_config,
    stack,
    started,
    tasks,
    trainer_log_probs,
)
from tests.support.engines import one_torch_thread  # noqa: F401 - a fixture (pytestmark below)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

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




async def test_tool_choice_forces_a_call_of_the_right_function_and_none_forbids_one(stack, policy):
    """The same seeded call (8 samples) under each tool_choice: "auto" lets the model answer without a call (it
    calls about half the time), "required" and a named function make every reply a call of the right function,
    "none" makes none a call. Forced tokens are context (never trained); the sampled rest is token-exact."""
    _, _, loop = stack
    endpoint, tok = loop.endpoint, loop.tokenizer
    ask = {"messages": prompt_messages("What is 12*31?"), "n": 8, "seed": 3, "max_tokens": 40}
    with endpoint.conversation() as auto_session:
        auto = await chat(endpoint, auto_session, tools=[CALCULATOR_TOOL], **ask)
    calls = [bool(c.message.tool_calls) for c in auto.choices]
    assert 0 < sum(calls) < 8, calls  # the model left to itself both calls and answers
    for choice, tools, name in [
        ("required", [CALCULATOR_TOOL], "calculator"),
        ({"type": "function", "function": {"name": "lookup"}}, [CALCULATOR_TOOL, LOOKUP_TOOL], "lookup"),
    ]:
        with endpoint.conversation() as session:
            out = await chat(endpoint, session, tools=tools, tool_choice=choice, **ask)
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
        none = await chat(endpoint, session, tools=[CALCULATOR_TOOL], tool_choice="none", **ask)
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
        first = await chat(endpoint, session, messages=messages, tools=[CALCULATOR_TOOL], tool_choice="required")
        message = first.choices[0].message
        messages += [
            message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "372"},
        ]
        second = await chat(endpoint, session, messages=messages, tools=[CALCULATOR_TOOL], tool_choice="required")
    assert second.choices[0].message.tool_calls[0].function.name == "calculator"
    [traj] = session.capture.trajectories()
    assert traj.num_turns == 2
    opening = tok.encode('<tool_call>{"name": "calculator", "arguments":', add_special_tokens=False)
    inserted = [t for t, m in zip(traj.response_ids, traj.response_mask) if not m]
    assert inserted[-len(opening) :] == opening and "<tool_response>372" in tok.decode(inserted)
    assert_token_exact(policy, traj)


async def test_a_stop_sequence_ends_the_reply_and_the_sequence_at_its_token(stack, policy):
    """The same seeded call without and with a stop sequence taken from the middle of its reply: the reply stops
    before it, the sequence holds exactly the tokens sampled up to the one that completed it (the same ids and
    log-probs as the unstopped reply's first tokens), and a later call continues it with the eos inserted, mask 0."""
    _, _, loop = stack
    endpoint, tok = loop.endpoint, loop.tokenizer
    messages = prompt_messages("What is 25+17?")
    with endpoint.conversation() as session:
        free = await chat(endpoint, session, messages=messages, seed=7, max_tokens=30)
    [whole] = session.capture.trajectories()
    text = free.choices[0].message.content
    assert len(text) >= 12, text
    stop = text[6:9]
    assert stop not in text[:8]  # its first occurrence is where we cut it from
    with endpoint.conversation() as session:
        out = await chat(endpoint, session, messages=messages, seed=7, max_tokens=30, stop=[stop, "never-seen"])
        assert out.choices[0].message.content == text[:6] and out.choices[0].finish_reason == "stop"
        [traj] = session.capture.trajectories()
        k = len(traj.response_ids)
        assert traj.response_ids == whole.response_ids[:k] and traj.log_probs == whole.log_probs[:k]
        assert stop in tok.decode(traj.response_ids) and stop not in tok.decode(traj.response_ids[:-1])
        assert traj.finish_reason == "stop" and out.usage.completion_tokens == k
        reply = out.choices[0].message.model_dump(exclude_none=True)
        await chat(endpoint, session, messages=messages + [reply, {"role": "user", "content": "and?"}], max_tokens=5)
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


# The failing agent gets room to start its interpreter and import openai on a busy machine; the hanging one is cut
# off after a few seconds.
@pytest.mark.parametrize("mode,expect,timeout_s", [("bad_model", "exited with code 1.*NotFoundError", 60.0),
                                                   ("hang", "TimeoutError", 4.0)])
async def test_a_failing_or_hanging_agent_process_fails_its_rollout(
    model_dir, stack, tmp_path, monkeypatch, mode, expect, timeout_s
):
    _, engine, base = stack
    monkeypatch.setenv("AGENT_MODE", mode)
    monkeypatch.setenv("AGENT_PID_FILE", str(tmp_path / "pid"))
    cfg, loop = command_loop(model_dir, engine, base.tokenizer, timeout_s=timeout_s)
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
        if proc_state(agent) == "Z":
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
