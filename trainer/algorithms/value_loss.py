"""The critic's clipped value loss (PPO's), and the value metrics of a step.

    L_v = 1/2 * agg( max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2) )

V the values being trained, V_old those the advantages were computed with, R the GAE returns, c
`critic.cliprange_value`; aggregated like the policy loss, over the whole update's tokens (`LossNormaliser`).
Numerics are verl 0.9.1's `compute_value_loss` (`tests/unit/test_advantages_vs_verl.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlbus.trainer.algorithms.policy_loss import LossAggMode, LossNormaliser, aggregate_loss


@dataclass
class ValueLossOutput:
    """The aggregated value loss (with grad) and this shard's sums for the step's value metrics."""

    loss: torch.Tensor  # scalar, this shard's share of the whole-update loss
    clipped_tokens: float  # tokens where the clipped error was the larger one (the clip was active)
    num_tokens: float  # response tokens of this shard


def value_loss(
    values_BT: torch.Tensor,
    returns_BT: torch.Tensor,
    old_values_BT: torch.Tensor,
    response_mask_BT: torch.Tensor,
    *,
    norm: LossNormaliser,
    cliprange_value: float,
    agg_mode: LossAggMode = "token-mean",
) -> ValueLossOutput:
    mask_BT = response_mask_BT.float()
    clipped_values_BT = torch.max(torch.min(values_BT, old_values_BT + cliprange_value),
                                  old_values_BT - cliprange_value)  # fmt: skip
    err_BT = (values_BT - returns_BT) ** 2
    err_clipped_BT = (clipped_values_BT - returns_BT) ** 2
    loss = 0.5 * aggregate_loss(torch.max(err_BT, err_clipped_BT), mask_BT, agg_mode, norm)
    with torch.no_grad():
        clipped = float(((err_clipped_BT > err_BT).float() * mask_BT).sum())
    return ValueLossOutput(loss=loss, clipped_tokens=clipped, num_tokens=float(mask_BT.sum()))


@dataclass
class ValueSums:
    """Sums over a step's response tokens from which the value metrics follow; they add across shards."""

    n: float = 0.0  # tokens
    v: float = 0.0  # sum V_old
    r: float = 0.0  # sum R
    r2: float = 0.0  # sum R^2
    e: float = 0.0  # sum (R - V_old)
    e2: float = 0.0  # sum (R - V_old)^2

    @staticmethod
    def of(old_values_BT: torch.Tensor, returns_BT: torch.Tensor, mask_BT: torch.Tensor) -> ValueSums:
        m = mask_BT.float()
        err = (returns_BT - old_values_BT) * m
        return ValueSums(float(m.sum()), float((old_values_BT * m).sum()), float((returns_BT * m).sum()),
                         float((returns_BT**2 * m).sum()), float(err.sum()), float((err**2).sum()))  # fmt: skip

    def as_list(self) -> list[float]:
        return [self.n, self.v, self.r, self.r2, self.e, self.e2]

    def metrics(self) -> dict[str, float]:
        """critic/values_mean, critic/returns_mean and critic/vf_explained_var: verl's 1 - Var[R - V] / (Var[R] +
        1e-5), unbiased variances over the step's response tokens (0 with fewer than two tokens, where verl's is NaN).
        """
        n = max(self.n, 1.0)
        explained = 0.0
        if self.n > 1:
            var_r = (self.r2 - self.r**2 / self.n) / (self.n - 1)
            var_e = (self.e2 - self.e**2 / self.n) / (self.n - 1)
            explained = 1.0 - var_e / (var_r + 1e-5)
        return {"critic/values_mean": self.v / n, "critic/returns_mean": self.r / n,
                "critic/vf_explained_var": explained}  # fmt: skip
