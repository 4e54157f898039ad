"""Off-policy correction: which log-probs play "old" in the PPO ratio, and the truncated importance weight.

Three log-probs exist per response token:
    mu    behaviour: what the rollout engine sampled with (maybe several versions behind; `rollout_log_probs`)
    prox  proximal:  recomputed with the trainer's current weights once per step, before the first update
    pi    current:   recomputed inside every micro-batch, with grad

Modes (AlgorithmConfig.off_policy):
    decoupled  ratio pi / prox (trust region around the proximal policy) and a per-token weight
               w = min(exp(prox - mu), C) (truncated IS, C = is_cap) that corrects for sampling from mu
               (decoupled PPO, Hilton et al. 2022; AReaL)
    bypass     ratio pi / mu, no weight: skips the recomputation (cheap; exact only when rollouts are on-policy)
    none       ratio pi / prox, no weight: standard PPO that ignores the rollout/trainer mismatch

Tested by `pytest tests/unit/test_algorithms.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from rlbus.trainer.algorithms.policy_loss import masked_mean

OffPolicyMode = Literal["decoupled", "bypass", "none"]


def needs_proximal(mode: OffPolicyMode) -> bool:
    """Whether the mode needs log-probs recomputed with the current weights before the first update."""
    return mode in ("decoupled", "none")


@dataclass
class ImportanceWeights:
    """Per-token weights w [B, T] (no grad) and their masked statistics over this shard."""

    weights_BT: torch.Tensor
    weight_mean: float  # masked mean of w (after truncation)
    truncated_frac: float  # fraction of tokens whose raw weight exceeded the cap
    num_tokens: float


def truncated_importance_weights(
    proximal_log_probs_BT: torch.Tensor,
    behaviour_log_probs_BT: torch.Tensor,
    response_mask_BT: torch.Tensor,
    *,
    cap: float,
    log_ratio_clamp: float = 20.0,
) -> ImportanceWeights:
    """w_{i,t} = min(exp(clamp(prox - mu, -c, c)), cap) on response tokens, 1 elsewhere (where it is unused)."""
    mask_BT = response_mask_BT.float()
    with torch.no_grad():
        log_w_BT = (proximal_log_probs_BT.float() - behaviour_log_probs_BT.float()).clamp(
            -log_ratio_clamp, log_ratio_clamp
        )
        raw_BT = torch.exp(log_w_BT)
        weights_BT = torch.where(mask_BT > 0, raw_BT.clamp(max=cap), torch.ones_like(raw_BT))
        return ImportanceWeights(
            weights_BT=weights_BT,
            weight_mean=float(masked_mean(weights_BT, mask_BT)),
            truncated_frac=float(masked_mean((raw_BT > cap).float(), mask_BT)),
            num_tokens=float(mask_BT.sum()),
        )


def old_log_probs_for(
    mode: OffPolicyMode, behaviour_log_probs_BT: torch.Tensor, proximal_log_probs_BT: torch.Tensor | None
) -> torch.Tensor:
    """The log-probs the PPO ratio is taken against: mu for bypass, prox otherwise."""
    if mode == "bypass":
        return behaviour_log_probs_BT
    if proximal_log_probs_BT is None:
        raise ValueError(f"off_policy: mode {mode!r} needs proximal log-probs recomputed with the current weights")
    return proximal_log_probs_BT


def importance_weights_for(
    mode: OffPolicyMode,
    behaviour_log_probs_BT: torch.Tensor,
    proximal_log_probs_BT: torch.Tensor | None,
    response_mask_BT: torch.Tensor,
    *,
    cap: float,
    log_ratio_clamp: float = 20.0,
) -> ImportanceWeights | None:
    """Truncated IS weights for `decoupled`, None for the modes that apply no weight."""
    if mode != "decoupled":
        return None
    if proximal_log_probs_BT is None:
        raise ValueError("off_policy: decoupled needs proximal log-probs recomputed with the current weights")
    return truncated_importance_weights(
        proximal_log_probs_BT, behaviour_log_probs_BT, response_mask_BT, cap=cap, log_ratio_clamp=log_ratio_clamp
    )
