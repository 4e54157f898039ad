"""On-policy distillation's advantage: the negative per-token reverse KL to a teacher, mixed with the environment's.

The student samples; its producer scores every sampled token with the teacher (producers/teacher.py), and the batch
carries `teacher_log_probs` [B, T] next to the behaviour log-probs `rollout_log_probs` (consumers/collate.py), both
exactly 0 where response_mask is 0. With b = log pi_behaviour(token) and q = log pi_teacher(token) (both at
rollout.temperature), on each generated token

    k_t     = b_t - q_t                     the single-sample estimate of KL(student || teacher) at that token (k1)
    k_t     = clamp(k_t, -c, c)             algorithm.distill.kl_clamp = c > 0 (verl's loss_max_clamp)
    A_kl(t) = -k_t                          or, with discount g > 0, -sum_{s >= t} g^(s - t) k_s over generated tokens
    A(t)    = (1 - w) A_env(t) + w A_kl(t)  w = algorithm.distill.weight; A_env is adv_estimator's advantage

The references, on the same inputs:
- tinker-cookbook's `incorporate_kl_penalty` (tinker_cookbook/distillation/train_on_policy.py): advantages +=
  -kl_penalty_coef * mask * (sampled_logprobs - teacher_logprobs), then discounted by kl_discount_factor (its
  discounted future sum); the sampled log-probs are the behaviour ones, as here. Its mixing, A_env + c A_kl, is
  this one's w = c / (1 + c) scaled by 1 + c (pure distillation, w = 1, is its environment reward of 0 and c = 1).
  The discount here runs over generated tokens only, passing over inserted ones (tool output) as GAE does
  (trainer/algorithms/advantages.py); on a single turn, where they are contiguous, the two are the same.
- verl 0.9.1's distillation with `use_policy_gradient: true` and `loss_mode: k1` (verl/trainer/distillation/
  losses.py): a policy-gradient loss with advantages -kl_penalty(log_prob, teacher_logprobs, "k1"), added to the
  task's loss with distillation_loss_coef. verl takes log_prob from the policy being updated, here it is the
  behaviour policy's, as tinker's: the same at a step's first update of fresh samples, and what makes the
  advantage a property of the recorded batch (no forward needed, so `rlbus replay` redoes it exactly).
- prime-rl's teacher_tau / adv_tau: A = adv_tau A_env + teacher_tau A_kl, i.e. adv_tau = 1 - w, teacher_tau = w.

A_kl is not normalised by the group (GRPO's z-score applies to A_env alone, before mixing): the KL is already per
token and on a natural scale (nats), and tinker-cookbook too adds it after the environment's advantage is computed.

    .venv/bin/python -m pytest -q tests/unit/test_distill.py
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # only its fields are read; the math stays free of the config
    from rlbus.schemas.config import AlgorithmConfig

#: The batch field the producers' teacher fills (consumers/collate.py).
TEACHER_KEY = "teacher_log_probs"


@dataclass(frozen=True)
class DistillSpec:
    """How the trainer mixes the teacher's signal into the advantage; the default does nothing."""

    weight: float = 0.0  # w: 0 = the environment's advantage alone, 1 = the teacher's alone
    discount: float = 0.0  # g: 0 = each token's own reverse KL
    kl_clamp: float = 0.0  # c: 0 = no clamp

    @classmethod
    def from_config(cls, cfg: AlgorithmConfig) -> DistillSpec:
        d = cfg.distill
        return cls(d.weight if d.enabled else 0.0, d.discount, d.kl_clamp)

    @property
    def batch_keys(self) -> tuple[str, ...]:
        """The batch fields this needs beyond the trainer's own (none when off, so older recordings still replay)."""
        return (TEACHER_KEY,) if self.weight else ()


def reverse_kl(behaviour_BT: torch.Tensor, teacher_BT: torch.Tensor, mask_BT: torch.Tensor,
               clamp: float = 0.0) -> torch.Tensor:  # fmt: skip
    """k_t = log pi_behaviour - log pi_teacher per token [B, T] (float32), clamped to [-clamp, clamp] when clamp > 0,
    exactly 0 where the mask is 0."""
    k_BT = behaviour_BT.float() - teacher_BT.float()
    if clamp:
        k_BT = k_BT.clamp(-clamp, clamp)
    return torch.where(mask_BT > 0, k_BT, torch.zeros_like(k_BT))


def discounted_sum(x_BT: torch.Tensor, mask_BT: torch.Tensor, discount: float) -> torch.Tensor:
    """sum_{s >= t} discount^(s - t) x_s over the masked-in positions s, at each masked-in t (0 elsewhere): masked-out
    positions are passed over, neither a term nor a step of the discount."""
    if not discount:
        return x_BT * (mask_BT > 0)
    out_BT = torch.zeros_like(x_BT)
    running_B = torch.zeros_like(x_BT[:, 0])
    for t in range(x_BT.shape[1] - 1, -1, -1):
        on_B = mask_BT[:, t] > 0
        running_B = torch.where(on_B, x_BT[:, t] + discount * running_B, running_B)
        out_BT[:, t] = torch.where(on_B, running_B, torch.zeros_like(running_B))
    return out_BT


def distill_advantages(behaviour_BT: torch.Tensor, teacher_BT: torch.Tensor, mask_BT: torch.Tensor,
                       spec: DistillSpec) -> torch.Tensor:  # fmt: skip
    """A_kl [B, T]: the negative reverse KL, discounted over later generated tokens when spec.discount > 0."""
    return -discounted_sum(reverse_kl(behaviour_BT, teacher_BT, mask_BT, spec.kl_clamp), mask_BT, spec.discount)


def mix_distill(adv_env_BT: torch.Tensor, data: Mapping[str, torch.Tensor], mask_BT: torch.Tensor, spec: DistillSpec,
                add_metric: Callable[[str, float, float], None] | None = None) -> torch.Tensor:  # fmt: skip
    """(1 - w) A_env + w A_kl of a batch's tensors (`rollout_log_probs`, `teacher_log_probs`); A_env itself when off.

    `add_metric(name, sum, count)` receives the token sums of `distill/reverse_kl` (k_t before the clamp, its mean
    over generated tokens estimates KL(student || teacher) per token), `distill/teacher_log_prob` and
    `distill/clamped_frac`; the trainer all-reduces them into per-token means.
    """
    if not spec.weight:
        return adv_env_BT
    behaviour_BT, teacher_BT = data["rollout_log_probs"], data[TEACHER_KEY]
    adv_kl_BT = distill_advantages(behaviour_BT, teacher_BT, mask_BT, spec)
    if add_metric is not None:
        on_BT = mask_BT > 0
        n = float(on_BT.sum())
        k_BT = reverse_kl(behaviour_BT, teacher_BT, mask_BT)
        add_metric("distill/reverse_kl", float(k_BT.sum()), n)
        add_metric("distill/teacher_log_prob", float((teacher_BT.float() * on_BT).sum()), n)
        clamped = float(((k_BT.abs() > spec.kl_clamp) & on_BT).sum()) if spec.kl_clamp else 0.0
        add_metric("distill/clamped_frac", clamped, n)
    if spec.weight == 1:
        return adv_kl_BT
    return (1.0 - spec.weight) * adv_env_BT + spec.weight * adv_kl_BT
