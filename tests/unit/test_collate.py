"""consumers/collate.py: stored trajectories -> the trainer's [B, T] batch, every field aligned with input_ids.

    .venv/bin/python -m pytest -q tests/unit/test_collate.py
"""

from __future__ import annotations

import pytest
import torch

from rlbus.consumers.collate import collate
from rlbus.schemas.wire import SampleMeta

PAD = 99


def _sample(key: str, prompt: list[int], response: list[int], mask: list[int], reward: float,
            version: int = 3) -> tuple[SampleMeta, dict[str, torch.Tensor]]:
    meta = SampleMeta(key=key, prompt_len=len(prompt), response_len=len(response), reward=reward)
    tensors = {
        "prompt_ids": torch.tensor(prompt),
        "response_ids": torch.tensor(response),
        "response_mask": torch.tensor(mask),
        # behaviour log-probs; deliberately nonzero where the mask is 0 to check they are zeroed there
        "rollout_log_probs": torch.tensor([-0.5 - i for i in range(len(response))], dtype=torch.float32),
        "versions": torch.tensor([version if m else -1 for m in mask]),
    }
    return meta, tensors


def test_layout_of_a_tool_call_trajectory_and_a_short_one():
    # sample 0: prompt 3 tokens; response: 2 generated, 2 inserted (tool output), 2 generated
    a = _sample("g/0", [1, 2, 3], [10, 11, 20, 21, 12, 13], [1, 1, 0, 0, 1, 1], reward=1.0)
    b = _sample("g/1", [1, 2], [14], [1], reward=0.25, version=4)
    batch = collate([a, b], [0, 0], pad_id=PAD)
    assert batch.batch_size == torch.Size([2])
    assert batch["input_ids"].tolist() == [[1, 2, 3, 10, 11, 20, 21, 12, 13], [1, 2, 14] + [PAD] * 6]
    assert batch["attention_mask"].tolist() == [[1] * 9, [1, 1, 1] + [0] * 6]
    assert batch["position_ids"].tolist() == [list(range(9)), [0, 1, 2] + [0] * 6]
    assert batch["response_mask"].tolist() == [[0, 0, 0, 1, 1, 0, 0, 1, 1], [0, 0, 1] + [0] * 6]
    lp = batch["rollout_log_probs"]
    assert lp[0].tolist() == [0, 0, 0, -0.5, -1.5, 0, 0, -4.5, -5.5]  # exactly 0 off the mask
    assert lp[1].tolist() == [0, 0, -0.5] + [0] * 6
    assert batch["versions"].tolist() == [[-1, -1, -1, 3, 3, -1, -1, 3, 3], [-1, -1, 4] + [-1] * 6]
    # the reward sits on the last generated token only
    rewards = batch["token_level_rewards"]
    assert rewards[0].tolist() == [0] * 8 + [1.0] and rewards[1].tolist() == [0, 0, 0.25] + [0] * 6
    assert batch["group_index"].tolist() == [0, 0]
    assert batch["input_ids"].dtype == torch.long and batch["response_mask"].dtype == torch.float32


def test_reward_lands_on_the_last_generated_token_before_inserted_tail():
    # a response that ends with inserted tokens (cut off after a tool call): reward on the last mask-1 token
    s = _sample("g/0", [1], [10, 11, 20], [1, 1, 0], reward=2.0)
    batch = collate([s], [5])
    assert batch["token_level_rewards"][0].tolist() == [0, 0, 2.0, 0]
    assert batch["group_index"].tolist() == [5]


def test_a_sample_with_no_generated_token_gets_no_reward_and_no_loss():
    s = _sample("g/0", [1, 2], [20, 21], [0, 0], reward=1.0)
    batch = collate([s], [0])
    assert batch["token_level_rewards"].sum() == 0 and batch["response_mask"].sum() == 0


def test_refuses_what_it_cannot_align():
    meta, t = _sample("g/0", [1, 2], [10], [1], reward=0.0)
    with pytest.raises(ValueError, match="at least one sample"):
        collate([], [])
    with pytest.raises(ValueError, match="group_index has 2 entries for 1 samples"):
        collate([(meta, t)], [0, 1])
    with pytest.raises(ValueError, match="lacks fields"):
        collate([(meta, {k: v for k, v in t.items() if k != "versions"})], [0])
    wrong = SampleMeta(key="g/0", prompt_len=2, response_len=5, reward=0.0)  # announced != stored
    with pytest.raises(ValueError, match=r"stored lengths \(2, 1\) != announced \(2, 5\)"):
        collate([(wrong, t)], [0])
