"""The trainer's step applies DAPO's overlong shaping and filtering (algorithm.overlong_*, mask_truncated): a real
one-rank FSDP2 step on CPU whose advantages carry the penalty and whose update ignores a truncated sample.

    .venv/bin/python -m pytest -q tests/integration/test_overlong_engine.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

from rlbus.schemas.config import AlgorithmConfig, TrainerConfig
from tests.integration.test_fsdp import VOCAB, build_tiny_qwen2, make_batch

T = 24  # make_batch's width
BUDGET = 16  # rollout.max_response_tokens: these samples' responses have 7 to 15 tokens, the buffer the last 8
TRUNCATED = 1  # the row cut at the length limit


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny_qwen2_overlong"))


def batches() -> tuple[TensorDict, TensorDict]:
    """Two batches of two groups that differ only in the truncated sample's response tokens and log-probs."""
    batch = make_batch(num_groups=2, group_size=4, T=T, seed=0, shared_prompts=True)
    prompt_len = (batch["response_mask"] > 0).float().argmax(dim=-1)  # the first response token (before the tools)
    batch["response_len"] = batch["attention_mask"].sum(-1) - prompt_len
    batch["truncated"] = torch.arange(8) == TRUNCATED
    changed = batch.clone()
    response = (torch.arange(T) >= prompt_len[TRUNCATED]) & (batch["attention_mask"][TRUNCATED] > 0)
    g = torch.Generator().manual_seed(1)
    changed["input_ids"][TRUNCATED] = torch.where(response, torch.randint(2, VOCAB, (T,), generator=g),
                                                  batch["input_ids"][TRUNCATED])  # fmt: skip
    changed["rollout_log_probs"][TRUNCATED] = batch["rollout_log_probs"][TRUNCATED] * 0.5
    return batch, changed


def _worker(model_dir: str) -> dict:
    from rlbus.trainer.dist import destroy_distributed, init_distributed
    from rlbus.trainer.engine import TrainEngine

    torch.set_num_threads(1)
    init_distributed("cpu")
    out: dict = {}
    for masked in (True, False):
        algo = AlgorithmConfig(mask_truncated=masked, overlong_buffer_tokens=8, overlong_penalty_factor=0.5)
        for name, batch in zip(("batch", "changed"), batches()):
            engine = TrainEngine(model_dir, TrainerConfig(micro_batch_size=3, lr=1e-2), algo, temperature=0.9,
                                 max_response_tokens=BUDGET)  # fmt: skip
            engine.train_step(batch)
            out[masked, name] = {"weights": {k: v.clone() for k, v in engine.full_state_dict().items()},
                                 "advantages": engine.computed["advantages"].clone()}  # fmt: skip
    destroy_distributed()
    return out


def test_the_step_shapes_rewards_and_leaves_a_truncated_sample_out_of_the_update(tiny_model: Path) -> None:
    from rlbus.trainer import algorithms as A
    from rlbus.trainer.dist import spawn_local

    out = spawn_local(1, _worker, str(tiny_model))[0]
    batch, _ = batches()
    data, mask = dict(batch.items()), batch["response_mask"]
    spec = A.OverlongSpec(buffer_tokens=8, penalty_factor=0.5, max_response_tokens=BUDGET)
    assert float(A.overlong_penalty(batch["response_len"], spec).min()) < 0, "no sample reached the buffer"
    rewards, _ = A.shape_rewards(data, mask, spec)
    expected = A.compute_advantages(rewards, mask, batch["group_index"])  # the truncated sample keeps its baseline
    torch.testing.assert_close(out[True, "batch"]["advantages"], expected)
    assert not torch.allclose(expected, A.compute_advantages(batch["token_level_rewards"], mask, batch["group_index"]))
    # mask_truncated: what the truncated sample's tokens were does not reach the weights; without it, it does
    for name, w in out[True, "batch"]["weights"].items():
        torch.testing.assert_close(w, out[True, "changed"]["weights"][name], msg=name)
    unmasked, changed = out[False, "batch"]["weights"], out[False, "changed"]["weights"]
    differ = [name for name, w in unmasked.items() if not torch.equal(w, changed[name])]
    assert differ, "without mask_truncated the truncated sample should train like the others"
