"""Advantages as pure tensor functions: group outcome ones (GRPO, Dr.GRPO, RLOO, REINFORCE++-baseline), discounted
returns (REINFORCE++) and GAE with a learned value (PPO with a critic). Names and numerics are verl 0.9.1's
`algorithm.adv_estimator` ones (`tests/unit/test_advantages_vs_verl.py` compares against verl itself).

Each sample i of a batch has a sequence score s_i = sum_t r_{i,t} * m_{i,t} (the reward sits on the last valid
response token; a KL-in-reward penalty, if any, is spread over the response tokens). Samples with the same
`group_index` were generated from the same prompt and form a group G(i) of size n_i. The sequence advantage A_i is
broadcast to every response token: A_{i,t} = A_i * m_{i,t}.

REINFORCE++, its baseline variant and GAE whiten their advantages over the whole batch (verl's `masked_whiten` on
the driver); here a batch is split over FSDP ranks, so the whitening's sums go through a `reduce` the caller hands in
(an all-reduce over ranks; identity in one process): the result is the whole batch's, whatever the split.

Tested by `pytest tests/unit/test_algorithms.py tests/unit/test_advantages_vs_verl.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

AdvEstimator = Literal["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae"]
ADV_ESTIMATORS: tuple[str, ...] = ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae")
Reduce = Callable[[list[float]], list[float]]  # sums over every shard of the batch (an all-reduce), elementwise


def _local(xs: list[float]) -> list[float]:
    return xs


def masked_whiten(values_BT: torch.Tensor, mask_BT: torch.Tensor, *, reduce: Reduce = _local) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) with the mean and the unbiased variance over the masked-in positions of the
    whole batch (every shard's, through `reduce`), as verl's `masked_whiten`, including its 1e-8s.

    rlbus differs where verl raises: with one masked-in position there is no spread (verl raises on n = 1) and with
    none nothing to whiten (n = 0): both give zeros, so such a batch trains nothing instead of stopping the run.
    """
    mask_BT = mask_BT.to(values_BT.dtype)
    total, n = reduce([float((values_BT * mask_BT).sum()), float(mask_BT.sum())])
    if n <= 1:
        return torch.zeros_like(values_BT)
    mean = total / (n + 1e-8)
    centered_BT = values_BT - mean
    (sq,) = reduce([float((centered_BT**2 * mask_BT).sum())])
    var = sq / (n + 1e-8) * (n / (n - 1))
    return centered_BT * torch.rsqrt(torch.tensor(var + 1e-8, dtype=values_BT.dtype))


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


def reinforce_pp_baseline_advantages(scores_B: torch.Tensor, group_index_B: torch.Tensor) -> torch.Tensor:
    """REINFORCE++-baseline's sequence advantage before whitening: s_i - mean_G(i); a group of one keeps s_i.

    The group of one follows verl (its baseline is 0), unlike GRPO's here, which gives it 0: after the batch-wide
    whitening its score still says how it compares with the batch.
    """
    count_B, mean_B, _ = _group_stats(scores_B.float(), group_index_B)
    return scores_B.float() - torch.where(count_B > 1, mean_B, torch.zeros_like(mean_B))


def discounted_returns(
    token_level_rewards_BT: torch.Tensor, response_mask_BT: torch.Tensor, gamma: float
) -> torch.Tensor:
    """REINFORCE++'s returns G_t = r_t + gamma * G_{t'} over response tokens (t' the next one with m = 1).

    A token with m = 0 (tool output, prompt, padding) is context, not an action: it gets no return and the running
    return passes over it unchanged, so a reward after a tool call still reaches the tokens before it.
    """
    rewards_BT = token_level_rewards_BT.float()
    mask_BT = response_mask_BT.float()
    returns_BT = torch.zeros_like(rewards_BT)
    running_B = torch.zeros_like(rewards_BT[:, 0])
    for t in reversed(range(rewards_BT.shape[1])):
        new_B = rewards_BT[:, t] + gamma * running_B
        returns_BT[:, t] = new_B * mask_BT[:, t]
        running_B = new_B * mask_BT[:, t] + running_B * (1 - mask_BT[:, t])
    return returns_BT


def gae_advantages_returns(
    token_level_rewards_BT: torch.Tensor,
    values_BT: torch.Tensor,
    response_mask_BT: torch.Tensor,
    *,
    gamma: float,
    lam: float,
    reduce: Reduce = _local,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (Schulman et al. 2016) over response tokens: (whitened advantages, returns = raw advantages + values).

        delta_t = r_t + gamma * V_{t'} - V_t,   A_t = delta_t + gamma * lam * A_{t'}    (t' = next token with m = 1)

    Tokens with m = 0 are skipped: neither their value nor their TD error enters, the recursion passes over them.
    Both outputs are 0 where m = 0 (verl leaves carried values there, which its losses mask out).
    """
    rewards_BT = token_level_rewards_BT.float()
    values_BT = values_BT.float()
    mask_BT = response_mask_BT.float()
    next_value_B = torch.zeros_like(rewards_BT[:, 0])
    last_gae_B = torch.zeros_like(next_value_B)
    adv_BT = torch.zeros_like(rewards_BT)
    for t in reversed(range(rewards_BT.shape[1])):
        delta_B = rewards_BT[:, t] + gamma * next_value_B - values_BT[:, t]
        gae_B = delta_B + gamma * lam * last_gae_B
        m_B = mask_BT[:, t]
        next_value_B = values_BT[:, t] * m_B + (1 - m_B) * next_value_B
        last_gae_B = gae_B * m_B + (1 - m_B) * last_gae_B
        adv_BT[:, t] = last_gae_B
    returns_BT = (adv_BT + values_BT) * mask_BT
    return masked_whiten(adv_BT, mask_BT, reduce=reduce) * mask_BT, returns_BT


def compute_advantages(
    token_level_rewards_BT: torch.Tensor,
    response_mask_BT: torch.Tensor,
    group_index_B: torch.Tensor,
    *,
    estimator: AdvEstimator = "grpo",
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
    gamma: float = 1.0,
    reduce: Reduce = _local,
) -> torch.Tensor:
    """Token-level advantages [B, T] of a critic-free estimator, 0 where the response mask is 0.

    grpo / rloo: the sequence advantage on every response token; every group must be whole in the batch passed
    here (a split group would get a wrong baseline). reinforce_plus_plus_baseline: the same with the group mean,
    then whitened over the batch. reinforce_plus_plus: discounted returns whitened over the batch. (gae needs
    values: `gae_advantages_returns`.)
    """
    mask_BT = response_mask_BT.float()
    if estimator == "reinforce_plus_plus":
        returns_BT = discounted_returns(token_level_rewards_BT, mask_BT, gamma)
        return masked_whiten(returns_BT, mask_BT, reduce=reduce) * mask_BT
    scores_B = sequence_scores(token_level_rewards_BT, response_mask_BT)
    if estimator == "grpo":
        adv_B = grpo_advantages(scores_B, group_index_B, norm_by_std=norm_by_std, epsilon=epsilon)
    elif estimator == "rloo":
        adv_B = rloo_advantages(scores_B, group_index_B)
    elif estimator == "reinforce_plus_plus_baseline":
        adv_BT = reinforce_pp_baseline_advantages(scores_B, group_index_B).unsqueeze(-1) * mask_BT
        return masked_whiten(adv_BT, mask_BT, reduce=reduce) * mask_BT
    else:
        choices = ", ".join(e for e in ADV_ESTIMATORS if e != "gae")
        raise ValueError(f"adv_estimator: {estimator!r} is not a critic-free estimator; choose from {choices}")
    return adv_B.unsqueeze(-1) * mask_BT
