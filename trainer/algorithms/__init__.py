"""The learning math as pure functions on tensors: advantages, PPO policy loss, off-policy and rollout correction, KL.

No model, no process group here; `trainer/engine.py` composes these. Tests: `pytest tests/unit/test_algorithms.py`.
"""

from rlbus.trainer.algorithms.advantages import (
    compute_advantages,
    grpo_advantages,
    rloo_advantages,
    sequence_scores,
)
from rlbus.trainer.algorithms.kl import apply_kl_reward_penalty, entropy_from_logits, kl_estimate
from rlbus.trainer.algorithms.off_policy import needs_proximal, old_log_probs_for
from rlbus.trainer.algorithms.policy_loss import (
    LOSS_AGG_MODES,
    LossNormaliser,
    PolicyLossOutput,
    aggregate_loss,
    masked_mean,
    ppo_clip_loss,
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

__all__ = [
    "LOSS_AGG_MODES",
    "Correction",
    "CorrectionSpec",
    "LossNormaliser",
    "MismatchSums",
    "PolicyLossOutput",
    "aggregate_loss",
    "apply_kl_reward_penalty",
    "batch_norm_factor",
    "compute_advantages",
    "correct",
    "entropy_from_logits",
    "grpo_advantages",
    "importance_weights",
    "kl_estimate",
    "masked_mean",
    "mismatch_metrics",
    "needs_proximal",
    "old_log_probs_for",
    "ppo_clip_loss",
    "rejection_mask",
    "rloo_advantages",
    "sequence_scores",
]
