"""DAPO's overlong reward shaping and overlong filtering (Yu et al. 2025, arXiv 2503.14476), applied by the trainer
to the rewards and loss mask of its batch, so that a recorded batch replays to the same step.

Soft overlong punishment (`algorithm.overlong_buffer_tokens` = B > 0, `overlong_penalty_factor` = f), with L the
sample's response length (tool output included, as rollout.max_response_tokens counts it) and L_max =
rollout.max_response_tokens, is verl 0.9.1's DAPO reward manager (verl/workers/reward_manager/dapo.py, the
`overlong_buffer_cfg.enable` branch of `__call__`):

    penalty = min(-(L - (L_max - B)) / B * f, 0)        0 up to L_max - B, then linear down to -f at L_max

added to the reward on the sample's last generated token, where the sample's reward sits. Overlong filtering
(`algorithm.mask_truncated`): a sample whose generation was cut at a length limit (finish_reason "length": the
response budget or one turn's max_new_tokens) leaves the loss; it keeps its place in its group's baseline, as a
rejected token keeps its sequence's score (trainer/engine.py).

The batch carries what both need (consumers/collate.py): `response_len` [B] and `truncated` [B]. Tested by
`pytest tests/unit/test_overlong.py` (against verl's reward manager itself).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # only its fields are read; the math stays free of the config
    from rlbus.schemas.config import AlgorithmConfig


@dataclass(frozen=True)
class OverlongSpec:
    """What the trainer does about long responses; the default does nothing."""

    buffer_tokens: int = 0  # B: length of the penalty's ramp; 0 = no penalty
    penalty_factor: float = 1.0  # f: the penalty at L_max
    max_response_tokens: int = 0  # L_max: where the ramp ends (rollout.max_response_tokens)
    mask_truncated: bool = False  # truncated samples leave the loss

    @classmethod
    def from_config(cls, cfg: AlgorithmConfig, max_response_tokens: int) -> OverlongSpec:
        spec = cls(cfg.overlong_buffer_tokens, cfg.overlong_penalty_factor, max_response_tokens, cfg.mask_truncated)
        if spec.buffer_tokens > max_response_tokens:
            raise ValueError(f"overlong_buffer_tokens: {spec.buffer_tokens} is more than the "
                             f"{max_response_tokens} response tokens where the penalty ends")  # fmt: skip
        return spec

    @property
    def batch_keys(self) -> tuple[str, ...]:
        """The batch fields this needs beyond the trainer's own (none when off, so older recordings still replay)."""
        return (("response_len",) if self.buffer_tokens else ()) + (("truncated",) if self.mask_truncated else ())


def overlong_penalty(response_len_B: torch.Tensor, spec: OverlongSpec) -> torch.Tensor:
    """min(-(L - (L_max - B)) / B * f, 0) per sample [B] (float32); zeros when the penalty is off."""
    if not spec.buffer_tokens:
        return torch.zeros(response_len_B.shape, dtype=torch.float32, device=response_len_B.device)
    exceed_B = response_len_B.float() - (spec.max_response_tokens - spec.buffer_tokens)
    return (-exceed_B / spec.buffer_tokens * spec.penalty_factor).clamp(max=0.0)


def add_on_last_token(rewards_BT: torch.Tensor, mask_BT: torch.Tensor, value_B: torch.Tensor) -> torch.Tensor:
    """rewards + value on each row's last masked-in position (where collate puts the reward); a row without one
    is left as it is."""
    T = mask_BT.shape[-1]
    has_B = (mask_BT > 0).any(dim=-1)
    last_B = T - 1 - (mask_BT > 0).flip(-1).to(torch.int8).argmax(dim=-1)
    onehot_BT = torch.nn.functional.one_hot(last_B, T).to(rewards_BT.dtype) * has_B.unsqueeze(-1)
    return rewards_BT + value_B.to(rewards_BT.dtype).unsqueeze(-1) * onehot_BT


def shape_rewards(
    data: dict[str, torch.Tensor], mask_BT: torch.Tensor, spec: OverlongSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token rewards [B, T] with the overlong penalty, the mask the loss may use [B, T]) of a batch's tensors.

    The second is `mask_BT` less the truncated samples' rows under mask_truncated, else `mask_BT` itself.
    """
    rewards_BT = data["token_level_rewards"].float()
    if spec.buffer_tokens:
        rewards_BT = add_on_last_token(rewards_BT, mask_BT, overlong_penalty(data["response_len"], spec))
    if not spec.mask_truncated:
        return rewards_BT, mask_BT
    return rewards_BT, mask_BT * (~data["truncated"].bool()).to(mask_BT.dtype).unsqueeze(-1)
