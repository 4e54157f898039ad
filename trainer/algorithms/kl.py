"""KL to a frozen reference policy (k1, k3 estimators), the KL-in-reward penalty, and entropy from logits.

With x = log pi_ref - log pi (per sampled token):
    k1 = -x = log pi - log pi_ref              unbiased estimate of KL(pi || pi_ref), can be negative
    k3 = exp(x) - x - 1                        unbiased and always >= 0 (Schulman, "Approximating KL divergence")

Used either as a loss term (kl_coef * agg(k)) or subtracted from the token rewards before the advantages
(r_{i,t} - kl_coef * k_{i,t} on response tokens).

Tested by `pytest tests/unit/test_algorithms.py`.
"""

from __future__ import annotations

from typing import Literal

import torch

KLType = Literal["k1", "k3"]


def kl_estimate(
    log_probs_BT: torch.Tensor, ref_log_probs_BT: torch.Tensor, kl_type: KLType = "k3", *, clamp: float = 10.0
) -> torch.Tensor:
    """Per-token KL(pi || pi_ref) estimate [B, T]. k3 is clamped to [-clamp, clamp] as its exp can blow up."""
    log_ratio_BT = ref_log_probs_BT.float() - log_probs_BT.float()
    if kl_type == "k1":
        return -log_ratio_BT
    if kl_type == "k3":
        log_ratio_BT = log_ratio_BT.clamp(-20.0, 20.0)
        return (torch.exp(log_ratio_BT) - log_ratio_BT - 1.0).clamp(-clamp, clamp)
    raise ValueError(f"kl_type: unknown estimator {kl_type!r}; choose from k1, k3")


def apply_kl_reward_penalty(
    token_level_rewards_BT: torch.Tensor,
    log_probs_BT: torch.Tensor,
    ref_log_probs_BT: torch.Tensor,
    response_mask_BT: torch.Tensor,
    *,
    kl_coef: float,
    kl_type: KLType = "k1",
) -> torch.Tensor:
    """r'_{i,t} = r_{i,t} - kl_coef * k_{i,t} * m_{i,t}: the KL penalty moved into the reward."""
    kl_BT = kl_estimate(log_probs_BT, ref_log_probs_BT, kl_type)
    return token_level_rewards_BT.float() - kl_coef * kl_BT * response_mask_BT.float()


def entropy_from_logits(logits_BTV: torch.Tensor) -> torch.Tensor:
    """H = logsumexp(z) - sum_v softmax(z)_v z_v per position [B, T] (pass logits already divided by temperature)."""
    logits_BTV = logits_BTV.float()
    probs_BTV = torch.softmax(logits_BTV, dim=-1)
    return torch.logsumexp(logits_BTV, dim=-1) - (probs_BTV * logits_BTV).sum(dim=-1)
