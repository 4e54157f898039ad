"""Outcome advantages for group-sampled RL (GRPO, Dr.GRPO, RLOO), as pure tensor functions.

Each sample i of a batch has a sequence score s_i = sum_t r_{i,t} * m_{i,t} (the reward sits on the last valid
response token; a KL-in-reward penalty, if any, is spread over the response tokens). Samples with the same
`group_index` were generated from the same prompt and form a group G(i) of size n_i. The sequence advantage A_i is
broadcast to every response token: A_{i,t} = A_i * m_{i,t}.

Tested by `pytest tests/unit/test_algorithms.py`.
"""

from __future__ import annotations

from typing import Literal

import torch

AdvEstimator = Literal["grpo", "rloo"]


def sequence_scores(token_level_rewards_BT: torch.Tensor, response_mask_BT: torch.Tensor) -> torch.Tensor:
    """s_i = sum_t r_{i,t} * m_{i,t}, shape [B] (float32)."""
    return (token_level_rewards_BT.float() * response_mask_BT.float()).sum(dim=-1)


def _group_stats(
    scores_B: torch.Tensor, group_index_B: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample (group size n, group mean, group unbiased std) gathered back to [B]. std is 0 where n == 1."""
    _, inverse_B = torch.unique(group_index_B, return_inverse=True)
    num_groups = int(inverse_B.max().item()) + 1 if inverse_B.numel() else 0
    zeros_G = torch.zeros(num_groups, dtype=scores_B.dtype, device=scores_B.device)
    count_G = zeros_G.scatter_add(0, inverse_B, torch.ones_like(scores_B))
    mean_G = zeros_G.scatter_add(0, inverse_B, scores_B) / count_G
    dev_B = scores_B - mean_G[inverse_B]
    sq_G = zeros_G.scatter_add(0, inverse_B, dev_B * dev_B)
    # Unbiased (n - 1) like torch.std, which verl uses; a one-sample group has no spread.
    std_G = torch.where(count_G > 1, (sq_G / (count_G - 1).clamp(min=1)).sqrt(), torch.zeros_like(sq_G))
    return count_G[inverse_B], mean_G[inverse_B], std_G[inverse_B]


def grpo_advantages(
    scores_B: torch.Tensor, group_index_B: torch.Tensor, *, norm_by_std: bool = True, epsilon: float = 1e-6
) -> torch.Tensor:
    """GRPO: A_i = (s_i - mean_G(i)) / (std_G(i) + epsilon); Dr.GRPO (norm_by_std=False): A_i = s_i - mean_G(i).

    std is the unbiased group standard deviation. A group of one sample has no baseline to compare with, so its
    advantage is 0 (it contributes no gradient).
    """
    count_B, mean_B, std_B = _group_stats(scores_B.float(), group_index_B)
    adv_B = scores_B.float() - mean_B
    if norm_by_std:
        adv_B = adv_B / (std_B + epsilon)
    return torch.where(count_B > 1, adv_B, torch.zeros_like(adv_B))


def rloo_advantages(scores_B: torch.Tensor, group_index_B: torch.Tensor) -> torch.Tensor:
    """RLOO: A_i = s_i - (1 / (n - 1)) * sum_{j in G(i), j != i} s_j  ( = n / (n - 1) * (s_i - mean_G(i)) ).

    A group of one sample has no leave-one-out baseline: its advantage is 0.
    """
    count_B, mean_B, _ = _group_stats(scores_B.float(), group_index_B)
    loo_baseline_B = (mean_B * count_B - scores_B.float()) / (count_B - 1).clamp(min=1)
    adv_B = scores_B.float() - loo_baseline_B
    return torch.where(count_B > 1, adv_B, torch.zeros_like(adv_B))


def compute_advantages(
    token_level_rewards_BT: torch.Tensor,
    response_mask_BT: torch.Tensor,
    group_index_B: torch.Tensor,
    *,
    estimator: AdvEstimator = "grpo",
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
) -> torch.Tensor:
    """Token-level advantages [B, T]: the estimator's sequence advantage on every response token, 0 elsewhere.

    Every group must be whole in the batch passed here (a split group would get a wrong baseline).
    """
    scores_B = sequence_scores(token_level_rewards_BT, response_mask_BT)
    if estimator == "grpo":
        adv_B = grpo_advantages(scores_B, group_index_B, norm_by_std=norm_by_std, epsilon=epsilon)
    elif estimator == "rloo":
        adv_B = rloo_advantages(scores_B, group_index_B)
    else:
        raise ValueError(f"adv_estimator: unknown estimator {estimator!r}; choose from grpo, rloo")
    return adv_B.unsqueeze(-1) * response_mask_BT.float()
