"""The learning math as pure functions on tensors: advantages, PPO policy loss, off-policy correction, KL.

No model, no process group here; `trainer/engine.py` composes these. Tests: `pytest tests/unit/test_algorithms.py`.
"""

from rlbus.trainer.algorithms.advantages import (
    compute_advantages,
    grpo_advantages,
    rloo_advantages,
    sequence_scores,
)
from rlbus.trainer.algorithms.kl import apply_kl_reward_penalty, entropy_from_logits, kl_estimate
from rlbus.trainer.algorithms.off_policy import (
    ImportanceWeights,
    importance_weights_for,
    needs_proximal,
    old_log_probs_for,
    truncated_importance_weights,
)
from rlbus.trainer.algorithms.policy_loss import (
    LOSS_AGG_MODES,
    LossNormaliser,
    PolicyLossOutput,
    aggregate_loss,
    masked_mean,
    ppo_clip_loss,
)

__all__ = [
    "LOSS_AGG_MODES",
    "ImportanceWeights",
    "LossNormaliser",
    "PolicyLossOutput",
    "aggregate_loss",
    "apply_kl_reward_penalty",
    "compute_advantages",
    "entropy_from_logits",
    "grpo_advantages",
    "importance_weights_for",
    "kl_estimate",
    "masked_mean",
    "needs_proximal",
    "old_log_probs_for",
    "ppo_clip_loss",
    "rloo_advantages",
    "sequence_scores",
    "truncated_importance_weights",
]
