"""The producer's OpenAI-compatible endpoint under test: a tiny warm-started quickstart model (shared by the test
modules of a session), an HF engine and an `openai` agent loop with its endpoint started, and the trainer's own
log-probs to hold each captured sequence against (tests/integration/test_endpoint*.py).
"""

from __future__ import annotations

import contextlib

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlbus.common.data.datasets import load_dataset
from rlbus.common.model.init_model import init_model
from rlbus.producers.agent_loops import make_agent_loop
from rlbus.producers.engines.hf import HFEngine
from rlbus.producers.rewards import load_reward
from rlbus.schemas.config import HFEngineConfig
from rlbus.schemas.config_io import from_dict
from rlbus.schemas.wire import PromptTask
from rlbus.trainer.engine import token_log_probs

AGENT = "rlbus.producers.agents.calculator:rollout"


@pytest.fixture(scope="session")
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


async def chat(endpoint, session, **kwargs):
    """One chat call through the real `openai` client with a rollout session's key."""
    async with openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=session.key, max_retries=0) as client:
        return await client.chat.completions.create(model="policy", **kwargs)
