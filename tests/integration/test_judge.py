"""The judge role as a real `rlbus judge` process on a free loopback port, serving a tiny model (random weights: its
replies' quality is not the point, their plumbing is), and the judge reward scoring through it.

What a user relies on: requests that arrive together are generated together (fewer batches than requests, and 8
concurrent requests cost less than 8 one after another); past max_concurrency and max_queue a request is answered
429 at once, and the reward retries it; a judge killed mid-scoring costs the reward retries, not the run, when a new
one comes up within the retry window, and an InfrastructureError, never a reward of 0, when none does.

    .venv/bin/python -m pytest -q tests/integration/test_judge.py
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import openai
import pytest

from rlbus.bus.ray_cluster import free_port
from rlbus.common.model.init_model import init_model
from rlbus.producers.rewards.judge import make_judge_reward
from rlbus.producers.rewards.registry import checked
from rlbus.schemas.errors import InfrastructureError
from rlbus.schemas.judge import URL_FILE, JudgeConfig
from rlbus.schemas.wire import ChatMessage, PromptTask
from tests.support.runs import log_tail, start_role, stop, write_config

TASK = PromptTask(task_id="t-1", prompt=[ChatMessage(role="user", content="What is 2+3?")], ground_truth="5")
START_TIMEOUT_S = 60.0


@dataclass
class Served:
    proc: subprocess.Popen
    url: str  # http://127.0.0.1:<port>/v1
    model: str  # judge.model: the name requests carry
    run_dir: Path


@pytest.fixture(scope="module")
def judge_model(tmp_path_factory) -> Path:
    # Random weights (no warm start): the cheapest model that generates, built in a few seconds.
    return init_model(tmp_path_factory.mktemp("judge") / "model", steps=0, check_target=0, num_threads=1,
                      log=lambda *_: None)


def health(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url.removesuffix("/v1") + "/health", timeout=2) as r:
            return json.loads(r.read())
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


async def health_async(url: str) -> dict | None:
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as s:
            async with s.get(url.removesuffix("/v1") + "/health") as r:
                return await r.json()
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None


def start_judge(tmp_path: Path, model: Path, name: str = "judge", **judge) -> Served:
    """`rlbus judge` on `judge` settings, once it serves (its URL file written, /health answering)."""
    run_dir = tmp_path / "run"
    url_file = run_dir / URL_FILE
    url_file.unlink(missing_ok=True)
    cfg = {"name": "judgetest", "model": {"path": str(model)}, "judge": {"model": str(model), **judge},
           "logging": {"run_dir": str(run_dir)}}
    proc = start_role("judge", write_config(tmp_path / f"{name}.yaml", cfg), tmp_path / "logs", name=name)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"rlbus judge exited with {proc.returncode}:\n{log_tail(proc)}")
        if url_file.is_file() and health(url := url_file.read_text().strip()) is not None:
            return Served(proc, url, str(model), run_dir)
        time.sleep(0.2)
    stop(proc, signal.SIGKILL)
    pytest.fail(f"rlbus judge did not serve within {START_TIMEOUT_S:.0f}s:\n{log_tail(proc)}")


@pytest.fixture(scope="module")
def judge(tmp_path_factory, judge_model) -> Served:
    served = start_judge(tmp_path_factory.mktemp("served"), judge_model, max_concurrency=8, max_batch_size=8)
    yield served
    stop(served.proc)


def ask(client: openai.AsyncOpenAI, model: str, i: int, max_tokens: int = 16):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": f"Grade answer {i}"}],
                                          max_tokens=max_tokens, temperature=0)


async def test_concurrent_requests_are_generated_in_fewer_batches(judge):
    client = openai.AsyncOpenAI(base_url=judge.url, api_key="none", max_retries=0)
    await ask(client, judge.model, 0)  # the first forward pass is slow (allocations)
    one = eight = float("inf")
    for _ in range(3):  # the best of three: the machine's other work only ever slows a try down
        t0 = time.perf_counter()
        reply = await ask(client, judge.model, 0)
        one = min(one, time.perf_counter() - t0)
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.completion_tokens >= 1
    for _ in range(3):
        before = health(judge.url)
        t0 = time.perf_counter()
        replies = await asyncio.gather(*(ask(client, judge.model, i) for i in range(8)))
        eight = min(eight, time.perf_counter() - t0)
        after = health(judge.url)
        assert len(replies) == 8 and after["served"] - before["served"] == 8
        assert after["batched_sequences"] - before["batched_sequences"] == 8
        batches = after["batches"] - before["batches"]
        assert batches < 8, f"8 concurrent requests were generated in {batches} batches"
    print(f"judge latency: one request {one * 1e3:.0f} ms, 8 concurrent {eight * 1e3:.0f} ms")
    assert eight < 8 * one
    await client.close()


async def test_the_judge_answers_as_openai_does(judge):
    client = openai.AsyncOpenAI(base_url=judge.url, api_key="none", max_retries=0)
    assert [m.id for m in (await client.models.list()).data] == [judge.model]
    with pytest.raises(openai.NotFoundError, match="model_not_found"):
        await client.chat.completions.create(model="gpt-x", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="n = 1"):
        await client.chat.completions.create(model=judge.model, messages=[{"role": "user", "content": "hi"}], n=2)
    with pytest.raises(openai.BadRequestError, match="messages"):
        await client.chat.completions.create(model=judge.model, messages=[])
    await client.close()


async def test_the_reward_scores_through_the_served_role(judge):
    # judge.url empty: the reward reads the URL the role wrote in its run directory.
    reward = make_judge_reward(JudgeConfig(model=judge.model), run_dir=judge.run_dir)
    scores = await asyncio.gather(*(checked(reward, "judge")(f"<answer>{i}</answer>", "5", task=TASK)
                                    for i in range(4)))
    assert all(0.0 <= s <= 1.0 for s in scores)
    assert reward.num_requests == 4 and reward.num_retries == 0
    await reward.close()


async def test_requests_beyond_the_queue_are_answered_429_and_the_reward_retries_them(tmp_path, judge_model):
    served = start_judge(tmp_path, judge_model, max_concurrency=1, max_queue=1)
    client = openai.AsyncOpenAI(base_url=served.url, api_key="none", max_retries=0)
    try:
        # Greedy on random weights never samples eos here: the first request holds the one slot for 400 tokens.
        first = asyncio.create_task(ask(client, served.model, 0, max_tokens=400))
        while ((await health_async(served.url)) or {}).get("active") != 1:
            await asyncio.sleep(0.01)
        more = await asyncio.gather(*(ask(client, served.model, i) for i in range(1, 6)), return_exceptions=True)
        busy = [r for r in more if isinstance(r, openai.RateLimitError)]
        assert len(busy) == 4 and "max_queue" in str(busy[0]), more  # one waited in the queue, four were refused
        assert sum(isinstance(r, openai.types.chat.ChatCompletion) for r in more) == 1
        await first
        # The reward meets the judge as busy (one request at work, one waiting), is refused, and retries its way in.
        fill = [asyncio.create_task(ask(client, served.model, 7, max_tokens=400))]
        while ((await health_async(served.url)) or {}).get("active") != 1:
            await asyncio.sleep(0.01)
        fill.append(asyncio.create_task(ask(client, served.model, 8, max_tokens=400)))
        while ((await health_async(served.url)) or {}).get("waiting") != 1:
            await asyncio.sleep(0.01)
        reward = make_judge_reward(JudgeConfig(url=served.url, model=served.model, retries=40, backoff_s=0.05,
                                               max_backoff_s=0.2))
        assert 0.0 <= await reward("<answer>5</answer>", "5", task=TASK) <= 1.0
        assert reward.num_retries >= 1 and reward.num_requests == 1
        await asyncio.gather(*fill)
        assert health(served.url)["rejected"] >= 5
        await reward.close()
    finally:
        await client.close()
        stop(served.proc)


async def start_judge_async(tmp_path: Path, model: Path, name: str, **judge) -> subprocess.Popen:
    """`rlbus judge` started without waiting for it on the event loop (rewards in flight go on meanwhile)."""
    cfg = {"name": "judgetest", "model": {"path": str(model)}, "judge": {"model": str(model), **judge},
           "logging": {"run_dir": str(tmp_path / "run")}}
    return start_role("judge", write_config(tmp_path / f"{name}.yaml", cfg), tmp_path / "logs", name=name)


async def kill_mid_scoring(served_url: str, proc: subprocess.Popen) -> None:
    """SIGKILL the judge (a process this test started) once it is generating."""
    while ((await health_async(served_url)) or {}).get("active", 0) == 0:
        await asyncio.sleep(0.01)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


async def test_a_killed_judge_costs_retries_not_the_run(tmp_path, judge_model):
    port = free_port()
    a = start_judge(tmp_path, judge_model, name="judge-a", port=port)
    url, b = a.url, None
    assert url == f"http://127.0.0.1:{port}/v1"
    try:
        # Long replies, so that the kill lands while all eight are in flight; a retry window (~30 s at least) that
        # covers a new role's start.
        reward = make_judge_reward(JudgeConfig(url=url, model=a.model, max_new_tokens=300, retries=60,
                                               backoff_s=0.2, max_backoff_s=1.0))
        scoring = [asyncio.create_task(reward(f"<answer>{i}</answer>", "5", task=TASK)) for i in range(8)]
        await kill_mid_scoring(url, a.proc)
        assert not all(t.done() for t in scoring)
        b = await start_judge_async(tmp_path, judge_model, "judge-b", port=port)  # the same port
        try:
            scores = await asyncio.wait_for(asyncio.gather(*scoring), timeout=START_TIMEOUT_S)
        except (asyncio.TimeoutError, InfrastructureError):
            pytest.fail(f"the rewards did not come through the restarted judge:\n{log_tail(b)}")
        assert len(scores) == 8 and all(0.0 <= s <= 1.0 for s in scores)
        assert reward.num_retries >= 1 and reward.num_requests == 8
        await reward.close()

        # This time none comes back: every reward in flight fails as the judge's, not as a score.
        quick = make_judge_reward(JudgeConfig(url=url, model=a.model, max_new_tokens=300, retries=2, backoff_s=0.1,
                                              max_backoff_s=0.2))
        scoring = [asyncio.create_task(quick(f"<answer>{i}</answer>", "5", task=TASK)) for i in range(4)]
        await kill_mid_scoring(url, b)
        results = await asyncio.gather(*scoring, return_exceptions=True)
        assert all(isinstance(r, InfrastructureError) for r in results), results
        assert results[0].source == f"judge {url}" and "3 attempt(s)" in results[0].reason
        await quick.close()
    finally:
        stop(a.proc, signal.SIGKILL)
        if b is not None:
            stop(b, signal.SIGKILL)
