"""Policy losses (PPO clip with asymmetric and dual clip, GSPO, CISPO) and loss aggregation with an explicit
global normaliser. The loss modes carry verl's names (`actor.policy_loss.loss_mode`: vanilla, gspo, cispo) and its
numerics (`tests/unit/test_policy_losses_vs_verl.py` compares against verl 0.9.1 itself).

Notation: m_{i,t} is the response mask, n_i = sum_t m_{i,t} the number of response tokens of sequence i, L_{i,t}
the per-token loss. The aggregation modes follow verl's `agg_loss`, but every mode divides by a normaliser of the
WHOLE optimizer batch (all micro-batches on all ranks), so that summing the micro-batch losses over micro-batches
and ranks gives exactly the whole-batch loss (not a mean of micro-batch means):

    token-mean               sum_{i,t} m L / N_tok                     N_tok = global number of response tokens
    seq-mean-token-sum       sum_i (sum_t m L) / N_seq                 N_seq = global number of sequences with n_i > 0
    seq-mean-token-mean      sum_i (sum_t m L / n_i) / N_seq
    seq-mean-token-sum-norm  sum_i (sum_t m L) / (N_seq * C)           C = a constant length (Dr.GRPO)

Tested by `pytest tests/unit/test_algorithms.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

PolicyLossMode = Literal["vanilla", "gspo", "cispo"]
POLICY_LOSS_MODES: tuple[str, ...] = ("vanilla", "gspo", "cispo")
GSPO_LOG_RATIO_MAX = 10.0  # verl's clamp of GSPO's log sequence ratio (above only) before exp
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
LOSS_AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class LossNormaliser:
    """The whole-batch denominators of the aggregation (summed over micro-batches and ranks by the caller)."""

    num_tokens: float  # N_tok: response tokens in the whole optimizer batch
    num_seqs: float  # N_seq: sequences with at least one response token in the whole optimizer batch
    scale: float = 1.0  # C of seq-mean-token-sum-norm (a fixed length, e.g. the maximum response length)

    @staticmethod
    def local_counts(response_mask_BT: torch.Tensor) -> tuple[float, float]:
        """(response tokens, sequences with a response token) of one shard; all-reduce (sum) these across shards."""
        n_B = response_mask_BT.float().sum(dim=-1)
        return float(n_B.sum().item()), float((n_B > 0).sum().item())


def masked_mean(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """sum(x * m) / max(sum(m), 1): the mean over masked-in positions (0 for an empty mask)."""
    mask_BT = mask_BT.to(x_BT.dtype)
    return (x_BT * mask_BT).sum() / mask_BT.sum().clamp(min=1)


def aggregate_loss(
    loss_BT: torch.Tensor, mask_BT: torch.Tensor, mode: LossAggMode, norm: LossNormaliser
) -> torch.Tensor:
    """This shard's share of the whole-batch loss (see the module docstring for each mode's formula).

    Positions with m = 0 contribute nothing, whatever their loss value (they are selected out with `where`, so even
    inf/nan at padded positions cannot leak in).
    """
    mask_BT = mask_BT.to(loss_BT.dtype)
    masked_BT = torch.where(mask_BT > 0, loss_BT * mask_BT, torch.zeros_like(loss_BT))
    if mode == "token-mean":
        return masked_BT.sum() / max(norm.num_tokens, 1.0)
    seq_sum_B = masked_BT.sum(dim=-1)
    if mode == "seq-mean-token-sum":
        return seq_sum_B.sum() / max(norm.num_seqs, 1.0)
    if mode == "seq-mean-token-mean":
        n_B = mask_BT.sum(dim=-1)
        return (seq_sum_B / n_B.clamp(min=1)).sum() / max(norm.num_seqs, 1.0)
    if mode == "seq-mean-token-sum-norm":
        return seq_sum_B.sum() / (max(norm.num_seqs, 1.0) * norm.scale)
    raise ValueError(f"loss_agg_mode: unknown mode {mode!r}; choose from {', '.join(LOSS_AGG_MODES)}")


@dataclass
class PolicyLossOutput:
    """The aggregated loss (with grad) and this shard's token-level statistics as masked means over its tokens."""

    loss: torch.Tensor  # scalar, this shard's share of the whole-batch loss
    clipfrac: float  # fraction of tokens where the clipped objective was the active one
    dual_clipfrac: float  # fraction of tokens where the dual clip (A < 0, ratio > clip_ratio_c) was active
    approx_kl: float  # mean of (old - new) log-prob: the k1 estimate of KL(old || new)
    num_tokens: float  # response tokens of this shard (to weight the fractions when combining shards)


def _finish(
    loss_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    agg_mode: LossAggMode,
    norm: LossNormaliser,
    token_weights_BT: torch.Tensor | None,
    clipped_BT: torch.Tensor,
    dual_BT: torch.Tensor | None,
    log_ratio_BT: torch.Tensor,
) -> PolicyLossOutput:
    """What every policy loss ends with: L * w (weights without gradient), the aggregation, the token statistics."""
    if token_weights_BT is not None:
        loss_BT = loss_BT * token_weights_BT.detach()
    loss = aggregate_loss(loss_BT, mask_BT, agg_mode, norm)
    with torch.no_grad():
        return PolicyLossOutput(
            loss=loss,
            clipfrac=float(masked_mean(clipped_BT.float(), mask_BT)),
            dual_clipfrac=0.0 if dual_BT is None else float(masked_mean(dual_BT.float(), mask_BT)),
            approx_kl=float(masked_mean(-log_ratio_BT.detach(), mask_BT)),
            num_tokens=float(mask_BT.sum()),
        )


def ppo_clip_loss(
    log_probs_BT: torch.Tensor,
    old_log_probs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    response_mask_BT: torch.Tensor,
    *,
    norm: LossNormaliser,
    agg_mode: LossAggMode = "token-mean",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    log_ratio_clamp: float = 20.0,
    token_weights_BT: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """PPO clipped surrogate with clip-higher and dual clip.

        rho   = exp(clamp(log pi - log pi_old, -c, c))                    c = log_ratio_clamp
        L1    = max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high))        (standard PPO clip)
        L     = min(L1, -A * clip_ratio_c)   where A < 0;   L1 elsewhere    (dual clip, Ye et al. 2020)
        L     = L * w                                                       (w = token_weights, e.g. IS weights)

    then `aggregate_loss(L, m, agg_mode, norm)`. `token_weights` must carry no gradient.
    """
    mask_BT = response_mask_BT.float()
    log_ratio_BT = (log_probs_BT - old_log_probs_BT).clamp(-log_ratio_clamp, log_ratio_clamp)
    ratio_BT = torch.exp(log_ratio_BT)
    adv_BT = advantages_BT.float()
    loss_unclipped_BT = -adv_BT * ratio_BT
    loss_clipped_BT = -adv_BT * ratio_BT.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_ppo_BT = torch.maximum(loss_unclipped_BT, loss_clipped_BT)
    loss_dual_bound_BT = -adv_BT * clip_ratio_c
    negative_BT = adv_BT < 0
    loss_BT = torch.where(negative_BT, torch.minimum(loss_ppo_BT, loss_dual_bound_BT), loss_ppo_BT)
    return _finish(loss_BT, mask_BT, agg_mode, norm, token_weights_BT, clipped_BT=loss_clipped_BT > loss_unclipped_BT,
                   dual_BT=negative_BT & (loss_ppo_BT > loss_dual_bound_BT), log_ratio_BT=log_ratio_BT)  # fmt: skip


def gspo_loss(
    log_probs_BT: torch.Tensor,
    old_log_probs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    response_mask_BT: torch.Tensor,
    *,
    norm: LossNormaliser,
    agg_mode: LossAggMode = "token-mean",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    token_weights_BT: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """GSPO (Zheng et al. 2025): the PPO clip on a sequence-level ratio, the geometric mean of the token ratios.

        s_i     = exp( sum_t m (log pi - log pi_old) / max(n_i, 1) )
        s_{i,t} = sg[s_i] * pi_{i,t} / sg[pi_{i,t}]        (value s_i; the gradient of log pi_{i,t}, scaled by s_i)
        L       = max(-A s_{i,t}, -A clip(s_{i,t}, 1 - eps_low, 1 + eps_high))     no dual clip
        L       = L * w

    The log of s_{i,t} is clamped from above at 10 (verl's choice), not from below, and the token log ratio is not
    clamped; a sequence is whole in every micro-batch, so s_i needs nothing from other micro-batches or ranks.
    verl recommends seq-mean-token-mean aggregation for GSPO (the paper's); any mode is accepted, as in verl.
    """
    mask_BT = response_mask_BT.float()
    log_ratio_BT = log_probs_BT - old_log_probs_BT
    n_B = mask_BT.sum(dim=-1).clamp(min=1)
    seq_log_ratio_B = (log_ratio_BT * mask_BT).sum(dim=-1) / n_B
    log_seq_ratio_BT = log_probs_BT - log_probs_BT.detach() + seq_log_ratio_B.detach().unsqueeze(-1)
    seq_ratio_BT = torch.exp(log_seq_ratio_BT.clamp(max=GSPO_LOG_RATIO_MAX))
    adv_BT = advantages_BT.float()
    loss_unclipped_BT = -adv_BT * seq_ratio_BT
    loss_clipped_BT = -adv_BT * seq_ratio_BT.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_BT = torch.maximum(loss_unclipped_BT, loss_clipped_BT)
    return _finish(loss_BT, mask_BT, agg_mode, norm, token_weights_BT, clipped_BT=loss_clipped_BT > loss_unclipped_BT,
                   dual_BT=None, log_ratio_BT=log_ratio_BT)  # fmt: skip


def cispo_loss(
    log_probs_BT: torch.Tensor,
    old_log_probs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    response_mask_BT: torch.Tensor,
    *,
    norm: LossNormaliser,
    agg_mode: LossAggMode = "token-mean",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    log_ratio_clamp: float = 20.0,
    token_weights_BT: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """CISPO (MiniMax-M1, 2025): REINFORCE weighted by a clipped, stop-gradient importance ratio; no token dropped.

        rho = exp(clamp(log pi - log pi_old, -c, c))
        L   = -sg[clip(rho, 1 - eps_low, 1 + eps_high)] * A * log pi,    L = L * w

    Unlike PPO's clip, a token whose ratio left the range keeps its gradient (of log pi, with the clipped weight).
    The loss value carries log pi itself, so it is not comparable with PPO's; its gradient is what matters.
    """
    mask_BT = response_mask_BT.float()
    log_ratio_BT = (log_probs_BT - old_log_probs_BT).clamp(-log_ratio_clamp, log_ratio_clamp)
    ratio_BT = torch.exp(log_ratio_BT)
    clipped_BT = ratio_BT.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high).detach()
    loss_BT = -clipped_BT * advantages_BT.float() * log_probs_BT
    return _finish(loss_BT, mask_BT, agg_mode, norm, token_weights_BT, clipped_BT=ratio_BT != clipped_BT,
                   dual_BT=None, log_ratio_BT=log_ratio_BT)  # fmt: skip


def policy_loss(
    mode: PolicyLossMode,
    log_probs_BT: torch.Tensor,
    old_log_probs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    response_mask_BT: torch.Tensor,
    *,
    norm: LossNormaliser,
    agg_mode: LossAggMode = "token-mean",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float = 3.0,
    log_ratio_clamp: float = 20.0,
    token_weights_BT: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """The policy loss of `mode` (verl's `policy_loss.loss_mode`): vanilla (PPO clip + dual clip), gspo, cispo."""
    common = {"norm": norm, "agg_mode": agg_mode, "clip_ratio_low": clip_ratio_low,
              "clip_ratio_high": clip_ratio_high, "token_weights_BT": token_weights_BT}  # fmt: skip
    args = (log_probs_BT, old_log_probs_BT, advantages_BT, response_mask_BT)
    if mode == "vanilla":
        return ppo_clip_loss(*args, clip_ratio_c=clip_ratio_c, log_ratio_clamp=log_ratio_clamp, **common)
    if mode == "gspo":
        return gspo_loss(*args, **common)
    if mode == "cispo":
        return cispo_loss(*args, log_ratio_clamp=log_ratio_clamp, **common)
    raise ValueError(f"loss_mode: unknown policy loss {mode!r}; choose from {', '.join(POLICY_LOSS_MODES)}")
