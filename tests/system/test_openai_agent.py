"""`rlbus up` trains agents written against the OpenAI API (`rollout.agent_loop: openai`), through each producer's
endpoint, on the tiny test model, the quickstart's calculator task:

- an agent written with an agent framework from PyPI: the OpenAI Agents SDK (producers/agents/agents_sdk.py, the
  optional extra rlbus[agents], which `make setup` installs), named in the config as a function;
- an agent that runs in its own process (`rollout.openai.command`): tests/fixtures/external_agent.py, plain
  `openai`-client code that imports nothing of rlbus, started once per rollout with that rollout's key and the
  producer's endpoint in OPENAI_API_KEY / OPENAI_BASE_URL.

The first try of the task of index 0 sends a bad request (an unknown model name): the client raises, the rollout
fails, the task is dead-lettered (bus.max_deliver 1) and released again, and the retry is trained -- all named in
the ledger.

    .venv/bin/python -m pytest -q tests/system/test_openai_agent.py
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from rlbus.consumers.ledger import read_ledger
from rlbus.trainer.metrics import read_metrics
from tests.support.runs import check_ledger, log_tail, small_run_config, start_role, stop, write_config

pytestmark = pytest.mark.slow

SDK_AGENT = """
from rlbus.producers.agents import agents_sdk


async def rollout(client, task):
    if task.index == 0 and task.attempt == 0:  # a bad request: the client raises openai.NotFoundError
        await client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    return await agents_sdk.rollout(client, task)
"""
EXTERNAL_AGENT = Path(__file__).resolve().parents[1] / "fixtures" / "external_agent.py"


@pytest.fixture(scope="module")
def calculator_model_dir(tmp_path_factory):
    """The quickstart's model after 60 warm-start steps (~10 s): it calls the calculator in about half of its first
    turns, with calls the parser reads (the shared tiny_model_dir's wider model, after 30 steps, rarely does)."""
    from rlbus.common.model.init_model import init_model

    return init_model(tmp_path_factory.mktemp("agent") / "model", steps=60, check_target=0, num_threads=1,
                      log=lambda *_: None)


def _train(tmp_path: Path, model_dir: Path, run_name: str, openai: dict) -> Path:
    """Three steps of `rlbus up` with the agent `openai` names; the checks both agents must pass. The run dir."""
    run_dir = tmp_path / "run"
    cfg = small_run_config(
        run_name,
        run_dir,
        model_dir,
        "",
        "",
        "",
        bus={"max_deliver": 1},
        rollout={
            "num_producers": 1,
            "agent_loop": "openai",
            "tools": [],
            "openai": openai,
            "max_new_tokens": 40,  # room for a whole tool call
            "max_response_tokens": 120,
        },
        trainer={"total_steps": 3},
        feeder={"shuffle": False},
    )
    up = start_role("up", write_config(tmp_path / "run.yaml", cfg), tmp_path / "logs", name="up")
    try:
        assert up.wait(timeout=400) == 0, log_tail(up)
    finally:
        stop(up, signal.SIGKILL)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["response_length/mean"] > 0 for r in rows)
    assert sum(r["tool_calls/mean"] for r in rows) > 0  # the agent ran the calculator between model calls
    check_ledger(run_dir, cfg)
    ledger = read_ledger(run_dir)
    assert "e0-i0-a0" in ledger.dead_lettered and "e0-i0-a0" in ledger.reissued
    assert "e0-i0-a1" in ledger.trained
    return run_dir


def test_rlbus_up_trains_an_agents_sdk_agent(tmp_path, calculator_model_dir, run_name, monkeypatch):
    pytest.importorskip("agents", reason="the OpenAI Agents SDK is the optional extra rlbus[agents] (make setup)")
    (tmp_path / "my_agent.py").write_text(SDK_AGENT)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the launcher's children import the agent from here
    _train(tmp_path, calculator_model_dir, run_name, {"function": "my_agent:rollout"})


def test_rlbus_up_trains_an_agent_in_another_process(tmp_path, calculator_model_dir, run_name, monkeypatch):
    monkeypatch.setenv("AGENT_MODE", "bad_model")  # the launcher's children pass it on to the agent's processes
    run_dir = _train(tmp_path, calculator_model_dir, run_name,
                     {"command": [sys.executable, str(EXTERNAL_AGENT)], "timeout_s": 120.0})  # fmt: skip
    # The process's own error (its stderr's tail) names what failed, in the dead letter and the producer's log.
    assert "NotFoundError" in (run_dir / "events" / "dead_letters.jsonl").read_text()
    assert "NotFoundError" in (run_dir / "logs" / "producer-0.log").read_text()
