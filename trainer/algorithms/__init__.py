"""The learning math as pure functions on tensors: advantages, PPO policy loss, off-policy and rollout correction, KL.

No model, no process group here; `trainer/engine.py` composes these. Tests: `pytest tests/unit/test_algorithms.py`.
"""

from rlbus.trainer.algorithms.advantages import (
    ADV_ESTIMATORS,
    compute_advantages,
    discounted_returns,
    gae_advantages_returns,
    grpo_advantages,
    masked_whiten,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    sequence_scores,
)
from rlbus.trainer.algorithms.distill import DistillSpec, distill_advantages, mix_distill, reverse_kl
from rlbus.trainer.algorithms.kl import apply_kl_reward_penalty, entropy_from_logits, kl_estimate
from rlbus.trainer.algorithms.off_policy import needs_proximal, old_log_probs_for
from rlbus.trainer.algorithms.overlong import OverlongSpec, overlong_penalty, shape_rewards
from rlbus.trainer.algorithms.policy_loss import (
    LOSS_AGG_MODES,
    POLICY_LOSS_MODES,
    LossNormaliser,
    PolicyLossOutput,
    aggregate_loss,
    cispo_loss,
    dppo_loss,
    gmpo_loss,
    gspo_loss,
    masked_mean,
    policy_loss,
    policy_loss_kwargs,
    ppo_clip_loss,
    sapo_loss,
)
from rlbus.trainer.algorithms.rollout_correction import (
    Correction,
    CorrectionSpec,
    MismatchSums,
    batch_norm_factor,
    correct,
    importance_weights,
    mismatch_metrics,
    rejection_mask,
)
from rlbus.trainer.algorithms.value_loss import ValueLossOutput, ValueSums, value_loss

__all__ = [
    "ADV_ESTIMATORS",
    "LOSS_AGG_MODES",
    "POLICY_LOSS_MODES",
    "Correction",
    "CorrectionSpec",
    "DistillSpec",
    "LossNormaliser",
    "MismatchSums",
    "OverlongSpec",
    "PolicyLossOutput",
    "ValueLossOutput",
    "ValueSums",
    "aggregate_loss",
    "apply_kl_reward_penalty",
    "batch_norm_factor",
    "cispo_loss",
    "compute_advantages",
    "correct",
    "discounted_returns",
    "distill_advantages",
    "dppo_loss",
    "entropy_from_logits",
    "gae_advantages_returns",
    "gmpo_loss",
    "grpo_advantages",
    "gspo_loss",
    "importance_weights",
    "kl_estimate",
    "masked_mean",
    "masked_whiten",
    "mismatch_metrics",
    "mix_distill",
    "needs_proximal",
    "old_log_probs_for",
    "overlong_penalty",
    "policy_loss",
    "policy_loss_kwargs",
    "ppo_clip_loss",
    "reinforce_pp_baseline_advantages",
    "rejection_mask",
    "reverse_kl",
    "rloo_advantages",
    "sapo_loss",
    "sequence_scores",
    "shape_rewards",
    "value_loss",
]
