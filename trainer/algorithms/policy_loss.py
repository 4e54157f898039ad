"""Policy losses (PPO clip with asymmetric and dual clip, GSPO, CISPO, SAPO, GMPO, DPPO) and loss aggregation with
an explicit global normaliser. The loss modes carry verl's names (`actor.policy_loss.loss_mode`: vanilla, gspo,
cispo, sapo, geo_mean, dppo_tv, dppo_kl) and its numerics (`tests/unit/test_policy_losses_vs_verl.py` compares
against verl 0.9.1 itself).

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
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:  # only its fields are read; the math stays free of the config
    from rlbus.schemas.config import AlgorithmConfig

PolicyLossMode = Literal["vanilla", "gspo", "cispo", "sapo", "geo_mean", "dppo_tv", "dppo_kl"]
POLICY_LOSS_MODES: tuple[str, ...] = ("vanilla", "gspo", "cispo", "sapo", "geo_mean", "dppo_tv", "dppo_kl")
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
    # fraction of tokens where the clipped objective was the active one (verl's pg_clipfrac: geo_mean counts those
    # with A > 0, dppo_* the tokens dropped from the trust region)
    clipfrac: float
    # verl's pg_clipfrac_lower: the dual clip (vanilla: A < 0, ratio > clip_ratio_c), the clip of A < 0 tokens
    # (geo_mean), the truncation of kept tokens' ratio at clip_ratio_c (dppo_*); 0 for the other modes
    dual_clipfrac: float
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
    """What every token-level policy loss ends with: L * w (weights without gradient), the aggregation, the token
    statistics."""
    if token_weights_BT is not None:
        loss_BT = loss_BT * token_weights_BT.detach()
    return _output(aggregate_loss(loss_BT, mask_BT, agg_mode, norm), mask_BT, clipped_BT, dual_BT, log_ratio_BT)


def _output(
    loss: torch.Tensor,
    mask_BT: torch.Tensor,
    clipped_BT: torch.Tensor,
    dual_BT: torch.Tensor | None,
    log_ratio_BT: torch.Tensor,
) -> PolicyLossOutput:
    """The output of an aggregated `loss`, with the token statistics over `mask_BT` (no gradient)."""
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


def sapo_loss(
    log_probs_BT: torch.Tensor,
    old_log_probs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    response_mask_BT: torch.Tensor,
    *,
    norm: LossNormaliser,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    log_ratio_clamp: float = 20.0,
    token_weights_BT: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """SAPO (Gao et al. 2025, arXiv 2511.20347): a soft, temperature-controlled gate in place of the hard clip.

        rho = exp(clamp(log pi - log pi_old, -c, c)),   tau = tau_pos where A > 0, else tau_neg
        f   = sigmoid(tau (rho - 1)) * 4 / tau          (slope 1 at rho = 1, like the plain ratio; then fading)
        L   = -f * A,    L = L * w

    Always aggregated seq-mean-token-mean, whatever `loss_agg_mode` says (verl's choice, the paper's objective).
    No token is clipped: clipfrac and dual_clipfrac are 0, as verl reports them.
    """
    mask_BT = response_mask_BT.float()
    log_ratio_BT = (log_probs_BT - old_log_probs_BT).clamp(-log_ratio_clamp, log_ratio_clamp)
    adv_BT = advantages_BT.float()
    tau_BT = torch.where(adv_BT > 0, adv_BT.new_tensor(tau_pos), adv_BT.new_tensor(tau_neg))
    gate_BT = torch.sigmoid(tau_BT * (torch.exp(log_ratio_BT) - 1.0)) * (4.0 / tau_BT)
    never_BT = torch.zeros_like(mask_BT, dtype=torch.bool)
    return _finish(-gate_BT * adv_BT, mask_BT, "seq-mean-token-mean", norm, token_weights_BT, clipped_BT=never_BT,
                   dual_BT=None, log_ratio_BT=log_ratio_BT)  # fmt: skip


def _seq_mean(x_BT: torch.Tensor, mask_BT: torch.Tensor, n_B: torch.Tensor) -> torch.Tensor:
    """sum_t m x / n per sequence [B]; masked-out positions are selected out (garbage there cannot leak in)."""
    return torch.where(mask_BT > 0, x_BT * mask_BT, torch.zeros_like(x_BT)).sum(dim=-1) / n_B


def gmpo_loss(
    log_probs_BT: torch.Tensor,
    old_log_probs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    response_mask_BT: torch.Tensor,
    *,
    norm: LossNormaliser,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    token_weights_BT: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """GMPO (Zhao et al. 2025, arXiv 2507.20673; verl's geo_mean): the PPO objective on the geometric mean of the
    token ratios, each token's log ratio clipped to [-eps_low, eps_high] (a clip range in log space).

        d_{i,t} = log pi - log pi_old                                          (not clamped)
        c_{i,t} = sign(A) min(sign(A) d, sign(A) clip(d, -eps_low, eps_high))  (the pessimistic side, per token)
        r_i = exp(sum_t m c / n_i),  A_i = sum_t m A / n_i,  w_i = exp(sum_t m log(w + 1e-10) / n_i)
        L_i = -A_i r_i w_i,          loss = sum_i L_i / N_seq

    One loss per sequence, so `loss_agg_mode` does not apply (verl ignores it too). verl averages L_i over the rows
    of its micro-batch, fully masked rows included; rlbus divides by N_seq, the sequences of the whole optimizer
    batch with a response token (as its seq-mean modes do), so that micro-batching does not change the loss. The
    IS weights enter as their per-sequence geometric mean, as in verl.
    """
    mask_BT = response_mask_BT.float()
    log_ratio_BT = log_probs_BT - old_log_probs_BT
    adv_BT = advantages_BT.float()
    sign_BT = torch.sign(adv_BT)
    clamped_BT = log_ratio_BT.clamp(-clip_ratio_low, clip_ratio_high)
    pessimistic_BT = sign_BT * torch.minimum(sign_BT * log_ratio_BT, sign_BT * clamped_BT)
    n_B = mask_BT.sum(dim=-1).clamp(min=1)
    loss_B = -_seq_mean(adv_BT, mask_BT, n_B) * torch.exp(_seq_mean(pessimistic_BT, mask_BT, n_B))
    if token_weights_BT is not None:
        loss_B = loss_B * torch.exp(_seq_mean(torch.log(token_weights_BT.detach().float() + 1e-10), mask_BT, n_B))
    loss = loss_B.sum() / max(norm.num_seqs, 1.0)
    clipped_BT = log_ratio_BT != clamped_BT
    return _output(loss, mask_BT, clipped_BT & (adv_BT > 0), clipped_BT & (adv_BT < 0), log_ratio_BT)


def dppo_loss(
    divergence: Literal["tv", "kl"],
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
    """DPPO-Binary (arXiv 2602.04879; verl's dppo_tv / dppo_kl): a trust region on the divergence between the old
    and new probability of the sampled token, not on their ratio. A token that left the region in the direction its
    advantage pushes is dropped; the others train with the truncated IS ratio as a stop-gradient weight:

        p, p_old = exp(log pi), exp(log pi_old),     rho = exp(clamp(log pi - log pi_old, -c, c))
        tv:  D = p - p_old;  kept where A > 0: D <= delta_high,   else: D >= -delta_low
        kl:  D = p_old log(p_old / p) + (1 - p_old) log((1 - p_old + 1e-8) / (1 - p + 1e-8))   (binary KL)
             kept where A > 0: D <= delta_high or p <= p_old,   else: D <= delta_low or p >= p_old
        L   = -A * sg[min(rho, clip_ratio_c)] * log pi * kept,    L = L * w

    delta_low / delta_high are clip_ratio_low / clip_ratio_high (verl reuses them as the divergence thresholds) and
    the IS truncation is clip_ratio_c. clipfrac is the dropped fraction, dual_clipfrac the kept tokens whose ratio
    was truncated (verl's pg_clipfrac_lower). Like CISPO's, the loss value carries log pi itself.
    """
    mask_BT = response_mask_BT.float()
    log_ratio_BT = (log_probs_BT - old_log_probs_BT).clamp(-log_ratio_clamp, log_ratio_clamp)
    ratio_BT = torch.exp(log_ratio_BT)
    adv_BT = advantages_BT.float()
    with torch.no_grad():
        p_BT, p_old_BT = torch.exp(log_probs_BT), torch.exp(old_log_probs_BT)
        if divergence == "tv":
            up_ok_BT, down_ok_BT = (p_BT - p_old_BT) <= clip_ratio_high, (p_BT - p_old_BT) >= -clip_ratio_low
        elif divergence == "kl":
            kl_BT = p_old_BT * (old_log_probs_BT - log_probs_BT) + (1 - p_old_BT) * torch.log(
                (1.0 - p_old_BT + 1e-8) / (1.0 - p_BT + 1e-8))  # fmt: skip
            up_ok_BT = (kl_BT <= clip_ratio_high) | (p_BT <= p_old_BT)
            down_ok_BT = (kl_BT <= clip_ratio_low) | (p_BT >= p_old_BT)
        else:
            raise ValueError(f"divergence: {divergence!r} is neither tv nor kl")
        kept_BT = torch.where(adv_BT > 0, up_ok_BT, down_ok_BT)
        truncated_BT = ratio_BT.clamp(max=clip_ratio_c)
    loss_BT = -adv_BT * truncated_BT * log_probs_BT * kept_BT.float()
    return _finish(loss_BT, mask_BT, agg_mode, norm, token_weights_BT, clipped_BT=~kept_BT,
                   dual_BT=(ratio_BT > clip_ratio_c) & kept_BT, log_ratio_BT=log_ratio_BT)  # fmt: skip


def policy_loss_kwargs(cfg: AlgorithmConfig) -> dict[str, Any]:
    """The hyperparameters `policy_loss` takes, from the algorithm config (what the trainer passes)."""
    return {"clip_ratio_low": cfg.clip_ratio_low, "clip_ratio_high": cfg.clip_ratio_high,
            "clip_ratio_c": cfg.clip_ratio_c, "log_ratio_clamp": cfg.log_ratio_clamp,
            "tau_pos": cfg.tau_pos, "tau_neg": cfg.tau_neg}  # fmt: skip


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
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
    token_weights_BT: torch.Tensor | None = None,
) -> PolicyLossOutput:
    """The policy loss of `mode` (verl's `policy_loss.loss_mode`): vanilla (PPO clip + dual clip), gspo, cispo,
    sapo (soft gate; tau_pos / tau_neg), geo_mean (GMPO; clip_ratio_* in log space), dppo_tv / dppo_kl (DPPO;
    clip_ratio_* are divergence thresholds, clip_ratio_c the IS truncation)."""
    args = (log_probs_BT, old_log_probs_BT, advantages_BT, response_mask_BT)
    clip = {"clip_ratio_low": clip_ratio_low, "clip_ratio_high": clip_ratio_high}
    common = {"norm": norm, "token_weights_BT": token_weights_BT}
    if mode == "vanilla":
        return ppo_clip_loss(*args, agg_mode=agg_mode, clip_ratio_c=clip_ratio_c, log_ratio_clamp=log_ratio_clamp,
                             **clip, **common)  # fmt: skip
    if mode == "gspo":
        return gspo_loss(*args, agg_mode=agg_mode, **clip, **common)
    if mode == "cispo":
        return cispo_loss(*args, agg_mode=agg_mode, log_ratio_clamp=log_ratio_clamp, **clip, **common)
    if mode == "sapo":
        return sapo_loss(*args, tau_pos=tau_pos, tau_neg=tau_neg, log_ratio_clamp=log_ratio_clamp, **common)
    if mode == "geo_mean":
        return gmpo_loss(*args, **clip, **common)
    if mode in ("dppo_tv", "dppo_kl"):
        divergence: Literal["tv", "kl"] = "tv" if mode == "dppo_tv" else "kl"
        return dppo_loss(divergence, *args, agg_mode=agg_mode, clip_ratio_c=clip_ratio_c,
                         log_ratio_clamp=log_ratio_clamp, **clip, **common)  # fmt: skip
    raise ValueError(f"loss_mode: unknown policy loss {mode!r}; choose from {', '.join(POLICY_LOSS_MODES)}")
