"""Streaming from the producer's OpenAI-compatible endpoint, to the real `openai` client over loopback HTTP: a
streamed reply is the same reply and the same captured sequence as an unstreamed one, text arrives while the reply
is sampled, an engine failure after the first delta ends the stream with an error, and a client that hangs up
cancels its call.

    .venv/bin/python -m pytest -q tests/integration/test_endpoint_streaming.py
"""

from __future__ import annotations

import asyncio

import openai
import pytest
from transformers import AutoTokenizer

from rlbus.common.model.demos import prompt_messages
from rlbus.producers.agents.calculator import CALCULATOR_TOOL
from rlbus.producers.endpoint import Endpoint
from rlbus.producers.engines.hf import HFEngine
from rlbus.schemas.config import HFEngineConfig
from tests.support.endpoint import (  # noqa: F401 - fixtures among them
    assert_token_exact,
    chat,
    hot_stack,
    model_dir,
    policy,
    run_config,
    stack,
    started,
)
from tests.support.engines import one_torch_thread  # noqa: F401 - a fixture (pytestmark below)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


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
        plain = await chat(endpoint, plain_session, logprobs=True, **ask)
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
