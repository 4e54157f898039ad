"""DAPO's overlong reward shaping and overlong filtering (trainer/algorithms/overlong.py) on collated batches.

    .venv/bin/python -m pytest -q tests/unit/test_overlong.py

The penalty is compared with verl 0.9.1's DAPO reward manager itself (verl/workers/reward_manager/dapo.py,
`DAPORewardManager.__call__`, the `overlong_buffer_cfg.enable` branch), called on the same lengths through a fake
tokenizer. The truncation mask is checked on every policy loss: a truncated sample adds nothing to the loss or its
gradient. tests/integration/test_overlong_engine.py checks the trainer's step does both.
"""

from __future__ import annotations

import importlib.metadata
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest
import torch

from rlbus.consumers.collate import collate
from rlbus.schemas.config import AlgorithmConfig, RunConfig
from rlbus.schemas.wire import SampleMeta
from rlbus.trainer import algorithms as A

L_MAX, BUFFER = 16, 6  # rollout.max_response_tokens, algorithm.overlong_buffer_tokens
PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def dapo():
    """verl 0.9.1's DAPO reward manager and DataProto: fail (not skip) when they are missing."""
    try:
        version = importlib.metadata.version("verl")
        from verl import DataProto
        from verl.workers.reward_manager.dapo import DAPORewardManager
    except ImportError as e:
        pytest.fail(f"verl 0.9.1 is the numerics reference of this test and cannot be imported ({e})")
    assert version == "0.9.1", f"the reference is verl 0.9.1, found {version}"
    return SimpleNamespace(DataProto=DataProto, Manager=DAPORewardManager)


class WordTokenizer:
    """What DAPORewardManager needs of a tokenizer: decode and eos_token."""

    eos_token = "<eos>"

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(str(int(i)) for i in ids)


def batch_of(lengths: list[int], scores: list[float], finish: list[str] | None = None):
    """A collated single-turn batch: sample i has `lengths[i]` generated tokens and reward `scores[i]`."""
    finish = finish or ["stop"] * len(lengths)
    samples = []
    for i, (n, r, f) in enumerate(zip(lengths, scores, finish)):
        meta = SampleMeta(key=f"g/{i}", prompt_len=len(PROMPT), response_len=n, reward=r, finish_reason=f)
        samples.append((meta, {"prompt_ids": torch.tensor(PROMPT), "response_ids": torch.arange(n) + 10,
                               "response_mask": torch.ones(n), "rollout_log_probs": -torch.ones(n),
                               "versions": torch.zeros(n, dtype=torch.long)}))  # fmt: skip
    return collate(samples, [0] * len(samples))


def verl_rewards(dapo, lengths: list[int], scores: list[float], factor: float) -> torch.Tensor:
    """verl's DAPO token rewards [B, L_MAX] for responses of these lengths whose score is `scores`."""
    B, P = len(lengths), len(PROMPT)
    attention = torch.zeros(B, P + L_MAX, dtype=torch.long)
    attention[:, :P] = 1
    for i, n in enumerate(lengths):
        attention[i, P : P + n] = 1
    data = dapo.DataProto.from_dict(
        tensors={"prompts": torch.tensor([PROMPT] * B), "responses": torch.full((B, L_MAX), 10),
                 "attention_mask": attention},
        non_tensors={"reward_model": np.array([{"ground_truth": str(s)} for s in scores], dtype=object),
                     "data_source": np.array(["math"] * B, dtype=object)},
    )  # fmt: skip
    buffer = SimpleNamespace(enable=True, len=BUFFER, penalty_factor=factor, log=False)
    manager = dapo.Manager(WordTokenizer(), num_examine=0, compute_score=lambda ground_truth, **_: float(ground_truth),
                           max_resp_len=L_MAX, overlong_buffer_cfg=buffer)  # fmt: skip
    return manager(data)


def spec(factor: float = 1.0, *, buffer: int = BUFFER, mask_truncated: bool = False) -> A.OverlongSpec:
    cfg = AlgorithmConfig(overlong_buffer_tokens=buffer, overlong_penalty_factor=factor, mask_truncated=mask_truncated)
    return A.OverlongSpec.from_config(cfg, L_MAX)


@pytest.mark.parametrize("factor", [1.0, 0.5])
def test_penalty_equals_verls_dapo_reward_manager_on_every_length(dapo, factor: float) -> None:
    lengths = list(range(1, L_MAX + 1))  # before, at the start of, inside and at the end of the buffer
    scores = [float(i % 3) - 0.5 for i in lengths]
    batch = batch_of(lengths, scores)
    rewards_BT, _ = A.shape_rewards(dict(batch.items()), batch["response_mask"], spec(factor))
    ours = torch.stack([rewards_BT[i, len(PROMPT) : len(PROMPT) + L_MAX] for i in range(len(lengths))])
    ours = torch.nn.functional.pad(ours, (0, L_MAX - ours.shape[-1]))
    theirs = verl_rewards(dapo, lengths, scores, factor)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)  # value and position: the last response token


def test_penalty_at_the_boundaries_of_the_buffer() -> None:
    # verl dapo.py: expected_len = max_resp_len - len; exceed_len = L - expected_len;
    # overlong_reward = min(-exceed_len / len * penalty_factor, 0)
    L = torch.tensor([1, L_MAX - BUFFER - 1, L_MAX - BUFFER, L_MAX - BUFFER + 1, L_MAX - 3, L_MAX])
    got = A.overlong_penalty(L, spec(0.5)).tolist()
    assert got == pytest.approx([0.0, 0.0, 0.0, -0.5 / BUFFER, -0.5 * 3 / BUFFER, -0.5])
    assert A.overlong_penalty(L, spec(buffer=0)).tolist() == [0.0] * 6  # off: nothing, whatever the length
    assert A.overlong_penalty(torch.tensor([L_MAX]), spec(buffer=L_MAX)).tolist() == [-1.0]  # buffer = whole budget


def test_collate_records_length_and_truncation_and_shaping_leaves_the_rest_alone() -> None:
    batch = batch_of([4, 16, 16], [1.0, 1.0, 0.0], ["stop", "length", "max_turns"])
    assert batch["response_len"].tolist() == [4, 16, 16]
    assert batch["truncated"].tolist() == [False, True, False]  # max_turns is no length cut
    data = dict(batch.items())
    off_rewards, off_mask = A.shape_rewards(data, batch["response_mask"], A.OverlongSpec())
    assert torch.equal(off_rewards, batch["token_level_rewards"]) and off_mask is batch["response_mask"]
    rewards, kept = A.shape_rewards(data, batch["response_mask"], spec(mask_truncated=True))
    assert rewards.sum(-1).tolist() == pytest.approx([1.0, 0.0, -1.0])
    assert torch.equal(kept, batch["response_mask"] * torch.tensor([[1.0], [0.0], [1.0]]))
    assert A.OverlongSpec().batch_keys == () and spec(mask_truncated=True).batch_keys == ("response_len", "truncated")


@pytest.mark.parametrize("mode", A.POLICY_LOSS_MODES)
def test_a_truncated_sample_adds_nothing_to_the_loss_or_its_gradient(mode: str) -> None:
    g = torch.Generator().manual_seed(0)
    batch = batch_of([5, 9, 16, 12], [1.0, 0.0, 1.0, 0.5], ["stop", "stop", "length", "stop"])
    data, mask = dict(batch.items()), batch["response_mask"]
    _, kept = A.shape_rewards(data, mask, spec(mask_truncated=True))
    old = -torch.rand(mask.shape, generator=g) * 3.0
    new = old + torch.randn(mask.shape, generator=g) * 0.3
    adv = torch.randn(mask.shape[0], 1, generator=g) * mask  # the baseline kept every sample: its advantage stays

    def loss_and_grad(rows: list[int], m: torch.Tensor) -> tuple[float, torch.Tensor]:
        x = new[rows].clone().requires_grad_(True)
        norm = A.LossNormaliser(*A.LossNormaliser.local_counts(m[rows]), scale=float(L_MAX))
        out = A.policy_loss(mode, x, old[rows], adv[rows], m[rows], norm=norm, agg_mode="seq-mean-token-mean")
        out.loss.backward()
        return float(out.loss.detach()), x.grad

    masked, grad = loss_and_grad([0, 1, 2, 3], kept)
    without, grad_without = loss_and_grad([0, 1, 3], mask)  # the batch as if the truncated sample were not in it
    assert masked == pytest.approx(without, rel=1e-6, abs=1e-8)
    assert float(grad[2].abs().sum()) == 0.0
    torch.testing.assert_close(grad[[0, 1, 3]], grad_without)
    _, grad_unmasked = loss_and_grad([0, 1, 2, 3], mask)  # off: the truncated sample trains like the others
    assert float(grad_unmasked[2].abs().sum()) > 0.0


def test_overlong_config_is_validated() -> None:
    for field, value in (("overlong_buffer_tokens", -1), ("overlong_penalty_factor", -0.5), ("tau_pos", 0.0),
                         ("tau_neg", -1.0)):  # fmt: skip
        with pytest.raises(ValueError, match=field):
            AlgorithmConfig(**{field: value})
    base = {"name": "r", "model": {"path": "m"}, "rollout": {"max_new_tokens": 8, "max_response_tokens": 64}}
    ok = msgspec.convert({**base, "algorithm": {"overlong_buffer_tokens": 64}}, RunConfig)
    assert ok.algorithm.overlong_buffer_tokens == 64
    with pytest.raises(msgspec.ValidationError, match="algorithm.overlong_buffer_tokens"):
        msgspec.convert({**base, "algorithm": {"overlong_buffer_tokens": 65}}, RunConfig)
    with pytest.raises(ValueError, match="overlong_buffer_tokens"):  # an engine given no L_max cannot ramp to it
        A.OverlongSpec.from_config(AlgorithmConfig(overlong_buffer_tokens=4), 0)
