"""Rollout correction: importance weights (TIS, IcePop) and rejection (MIS) between the behaviour policy mu (the
rollout engine's `rollout_log_probs`) and the proximal policy pi_prox (recomputed by the trainer), and the mismatch
metrics of every step. Names, semantics and numbers are those of verl 0.9.1's `rollout_corr_helper` (a verl
`algorithm.rollout_correction` block maps onto AlgorithmConfig's `rollout_*` fields one to one).

Per response token, with m the response mask and the log ratio lr = log pi_prox - log mu (clamped to +-B before
any exp, B = log_ratio_clamp = 20 by default, verl's SAFETY_BOUND):

    IS weights (rollout_is)
        token      w_t = exp(lr_t)
        sequence   w_t = exp(clamp(sum_s m_s lr_s))              the product of the row's token ratios, on every token
      then, with rollout_is_threshold:
        a number U          TIS     w = min(w, U)
        "L_U" (quoted)      IcePop  w = w if L <= w <= U else 0      (a zero weight drops the token's gradient)
      rollout_is_batch_normalize divides w by its mean over the step's tokens (token) or sequences (sequence).

    Rejection (rollout_rs; every listed option must pass; a rejected token leaves the loss AND its normaliser)
        k1 = -lr     k2 = lr^2 / 2     k3 = exp(lr) - 1 - lr      (estimators of KL(mu || pi_prox))
        token_kN       per token
        seq_sum_kN     sum over the row, the whole row kept or rejected
        seq_mean_kN    mean over the row; seq_mean_k1 is the geometric-mean ratio ("Geo-RS"):
                       exp(seq_mean_k1) = (prod mu / pi_prox)^(1/n)
        seq_max_k2/k3  max over the row
      k1 options keep log L <= stat <= log U (bounds on exp(k1) = mu / pi_prox, as verl); k2/k3 keep stat <= U.

Metrics (`mismatch_metrics`): mismatch/kl_k1 and mismatch/kl_k3 (KL(mu || pi_prox), k1 and k3 estimators), and with
IS weights is/weight_mean, is/truncated_frac and is/below_frac (share above U / below L, or 1/U for TIS), is/ess
(normalised effective sample size), is/masked_frac (IcePop: share zeroed), is/p5, is/p50, is/p95, is/max, and with
rejection rs/masked_frac (tokens) and rs/seq_masked_frac (rows with a rejected token). Everything is made of sums
(`MismatchSums`, all-reduced across micro-batches and ranks) plus the applied weights for the percentiles.

Tested against verl itself by `pytest tests/unit/test_rollout_correction.py`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:  # only its parsed fields are read; the math stays free of the config
    from rlbus.schemas.config import AlgorithmConfig

ISLevel = Literal["token", "sequence"]
PERCENTILES = (5, 50, 95)


@dataclass(frozen=True)
class CorrectionSpec:
    """What to apply between mu and pi_prox: the parsed rollout_* fields of AlgorithmConfig."""

    is_level: ISLevel | None  # None: no importance weight
    is_upper: float  # TIS cap, or IcePop's upper bound
    is_lower: float | None  # None: TIS (truncate); else IcePop (zero outside [lower, upper])
    batch_normalize: bool = False
    rs: tuple[tuple[str, float | None, float], ...] = ()  # (verl option name, lower (k1 only), upper)
    safety_bound: float = 20.0  # |log ratio| clamp before exp

    @classmethod
    def from_config(cls, cfg: AlgorithmConfig) -> CorrectionSpec:
        """rollout_is unset keeps the historical weight of off_policy=decoupled: token TIS at is_cap."""
        lower, upper = cfg.is_bounds
        level: ISLevel | None = cfg.rollout_is
        if level is None:
            level, lower, upper = ("token", None, cfg.is_cap) if cfg.off_policy == "decoupled" else (None, None, upper)
        return cls(level, upper, lower, cfg.rollout_is_batch_normalize, cfg.rs_bounds, cfg.log_ratio_clamp)

    @property
    def needs_whole_batch(self) -> bool:
        """Whether the correction must see every row before the first update: rejection changes the loss
        normaliser, batch normalisation needs the step's mean weight."""
        return bool(self.rs) or self.batch_normalize


@dataclass
class MismatchSums:
    """Additive statistics of one shard (float64 sums): all-reduce them (sum), then `mismatch_metrics`."""

    num_tokens: float = 0.0  # response tokens (before rejection)
    num_rows: float = 0.0  # rows, empty ones too (verl's denominator for the sequence shares)
    k1: float = 0.0  # sum of m * (log mu - log pi_prox)
    k3: float = 0.0  # sum of m * (exp(lr) - 1 - lr)
    w: float = 0.0  # sum of m * w (applied weights, before batch normalisation)
    w2: float = 0.0  # sum of m * w^2
    above: float = 0.0  # tokens (token level) or rows (sequence level) whose raw weight is above the upper bound
    below: float = 0.0  # ... below the lower bound (1 / upper for TIS)
    outside: float = 0.0  # IcePop: tokens whose raw weight is outside [lower, upper]
    seq_w: float = 0.0  # sum over rows with a response token of their mean weight (sequence batch normalisation)
    num_seqs: float = 0.0  # rows with a response token
    rejected_tokens: float = 0.0  # response tokens rejected
    rejected_rows: float = 0.0  # rows with at least one rejected response token

    def as_list(self) -> list[float]:
        return [getattr(self, f.name) for f in fields(self)]

    @classmethod
    def from_list(cls, values: list[float]) -> MismatchSums:
        return cls(*values)

    def __add__(self, other: MismatchSums) -> MismatchSums:
        return MismatchSums.from_list([a + b for a, b in zip(self.as_list(), other.as_list())])


@dataclass
class Correction:
    """The correction of one shard [B, T]: what the loss uses, and what the metrics are made of."""

    weights_BT: torch.Tensor | None  # applied IS weights (0 off the response mask), None without rollout_is
    mask_BT: torch.Tensor  # the response mask with rejected tokens removed
    sums: MismatchSums
    values_N: torch.Tensor | None  # the applied weights, one per token (token level) or per non-empty row (sequence)


def _masked_sum_B(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    # where, not only a product: an inf/nan at a padded position must not reach the row's sum
    return torch.where(mask_BT > 0, x_BT * mask_BT, torch.zeros_like(x_BT)).sum(dim=-1)


def importance_weights(
    log_ratio_BT: torch.Tensor, mask_BT: torch.Tensor, spec: CorrectionSpec
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(applied weights [B, T], raw weights [B, T], the row log ratio sum [B] or None at token level), no grad.

    Both weights are 0 off the mask. `spec.is_level` must be set.
    """
    with torch.no_grad():
        lr_BT, mask_BT = log_ratio_BT.float(), mask_BT.float()
        b = spec.safety_bound
        seq_log_ratio_B = None
        if spec.is_level == "token":
            raw_BT = torch.exp(lr_BT.clamp(-b, b))
        elif spec.is_level == "sequence":
            seq_log_ratio_B = _masked_sum_B(lr_BT, mask_BT)
            raw_BT = torch.exp(seq_log_ratio_B.clamp(-b, b)).unsqueeze(-1).expand_as(lr_BT)
        else:
            raise ValueError(f"rollout_is: unknown level {spec.is_level!r}; choose from token, sequence")
        # 0 off the mask by `where`: a NaN log-prob at a padded position would survive a product with 0 and reach
        # the gradient through the loss's weight
        raw_BT = torch.where(mask_BT > 0, raw_BT * mask_BT, torch.zeros_like(raw_BT))
        if spec.is_lower is None:
            weights_BT = raw_BT.clamp(max=spec.is_upper)
        else:
            inside_BT = (raw_BT >= spec.is_lower) & (raw_BT <= spec.is_upper)
            weights_BT = torch.where(inside_BT, raw_BT, torch.zeros_like(raw_BT))
        return weights_BT, raw_BT, seq_log_ratio_B


def _row_stat(option: str, token_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """The per-row statistic of a seq_* option [B]; an empty row gets 0."""
    if option.startswith("seq_sum"):
        return _masked_sum_B(token_BT, mask_BT)
    n_B = mask_BT.sum(dim=-1)
    if option.startswith("seq_mean"):
        return _masked_sum_B(token_BT, mask_BT) / n_B.clamp(min=1)
    row_max_B = token_BT.masked_fill(mask_BT <= 0, float("-inf")).max(dim=-1).values  # seq_max
    return torch.where(n_B > 0, row_max_B, torch.zeros_like(row_max_B))


def rejection_mask(log_ratio_BT: torch.Tensor, mask_BT: torch.Tensor, spec: CorrectionSpec) -> torch.Tensor:
    """The response mask [B, T] with every token (or row) that fails one of `spec.rs` set to 0, no grad."""
    with torch.no_grad():
        mask_BT = mask_BT.float()
        if not spec.rs or mask_BT.numel() == 0:
            return mask_BT.clone()
        lr_BT = log_ratio_BT.float().clamp(-spec.safety_bound, spec.safety_bound)
        divergence = {"k1": -lr_BT, "k2": 0.5 * lr_BT.square(), "k3": torch.exp(lr_BT) - 1.0 - lr_BT}
        keep_BT = torch.ones_like(mask_BT, dtype=torch.bool)
        for option, lower, upper in spec.rs:
            token_BT = divergence[option[-2:]]
            stat = token_BT if option.startswith("token") else _row_stat(option, token_BT, mask_BT).unsqueeze(-1)
            if option.endswith("k1"):
                assert lower is not None  # AlgorithmConfig.rs_bounds gives k1 both bounds
                ok = (stat >= math.log(lower)) & (stat <= math.log(upper))
            else:
                ok = stat <= upper
            keep_BT = keep_BT & ok
        return mask_BT * keep_BT.float()


def correct(
    proximal_BT: torch.Tensor, behaviour_BT: torch.Tensor, mask_BT: torch.Tensor, spec: CorrectionSpec
) -> Correction:
    """Weights, rejection and this shard's sums for the rows given (any rows: everything is per row or a sum).

    Batch normalisation is not applied here (it needs the step's mean over all ranks): see `batch_norm_factor`.
    """
    with torch.no_grad():
        mask_BT = mask_BT.float()
        lr_BT = proximal_BT.float() - behaviour_BT.float()
        m64 = mask_BT.double()
        clamped_BT = lr_BT.clamp(-spec.safety_bound, spec.safety_bound)
        k3_BT = torch.exp(clamped_BT) - 1.0 - clamped_BT
        n_B = mask_BT.sum(dim=-1)
        zero = m64.new_zeros(())
        parts = {
            "num_tokens": m64.sum(), "num_rows": m64.new_tensor(float(mask_BT.shape[0])),
            "k1": _masked_sum_B(-lr_BT.double(), m64).sum(), "k3": _masked_sum_B(k3_BT.double(), m64).sum(),
        }  # fmt: skip
        weights_BT = values_N = None
        if spec.is_level is not None:
            weights_BT, raw_BT, seq_log_ratio_B = importance_weights(lr_BT, mask_BT, spec)
            lower = spec.is_lower if spec.is_lower is not None else 1.0 / spec.is_upper
            log_lower = math.log(lower) if lower > 0 else -math.inf  # TIS with an infinite cap: nothing is below
            w64 = weights_BT.double()
            parts["w"] = (w64 * m64).sum()
            parts["w2"] = (w64.clamp(min=0.0, max=spec.is_upper).square() * m64).sum()
            if seq_log_ratio_B is None:
                parts["above"] = ((raw_BT > spec.is_upper).double() * m64).sum()
                parts["below"] = ((raw_BT < lower).double() * m64).sum()
                values_N = weights_BT[mask_BT > 0]
            else:  # per row, on the unclamped log sum, over every row (verl's sequence-level shares)
                parts["above"] = (seq_log_ratio_B > math.log(spec.is_upper)).double().sum()
                parts["below"] = (seq_log_ratio_B < log_lower).double().sum()
                values_N = weights_BT.max(dim=-1).values[n_B > 0]  # a row's tokens all carry its weight
            if spec.is_lower is not None:
                parts["outside"] = (((raw_BT < spec.is_lower) | (raw_BT > spec.is_upper)).double() * m64).sum()
            row_w_B = _masked_sum_B(w64, m64) / n_B.double().clamp(min=1)
            parts["seq_w"] = row_w_B[n_B > 0].sum()
        parts["num_seqs"] = (n_B > 0).double().sum()
        kept_BT = rejection_mask(lr_BT, mask_BT, spec)
        if spec.rs:
            rejected_BT = mask_BT - kept_BT
            parts["rejected_tokens"] = rejected_BT.double().sum()
            parts["rejected_rows"] = (rejected_BT > 0).any(dim=-1).double().sum()
        names = [f.name for f in fields(MismatchSums)]
        sums = MismatchSums.from_list(torch.stack([parts.get(n, zero) for n in names]).tolist())  # one sync
        return Correction(weights_BT, kept_BT, sums, values_N)


def batch_norm_factor(sums: MismatchSums, spec: CorrectionSpec) -> float:
    """The mean weight of the step (sums over all ranks) that rollout_is_batch_normalize divides by; 1 if ~0."""
    if spec.is_level == "sequence":
        mean = sums.seq_w / max(sums.num_seqs, 1e-8)
    else:
        mean = sums.w / (sums.num_tokens + 1e-8)
    return mean if mean > 1e-8 else 1.0


def percentiles(values_N: torch.Tensor, qs: tuple[float, ...]) -> list[float]:
    """Linear-interpolation quantiles (torch.quantile's default) by one sort: torch.quantile refuses > 2^24 values."""
    v_N = values_N.double().sort().values
    n = v_N.numel()
    out = []
    for q in qs:
        pos = q * (n - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        out.append(float(v_N[lo] + (v_N[hi] - v_N[lo]) * (pos - lo)))
    return out


def mismatch_metrics(
    sums: MismatchSums, spec: CorrectionSpec, *, values_N: torch.Tensor | None = None
) -> dict[str, float]:
    """The step's metrics from sums over every shard and the applied weights of every shard (`values_N`)."""
    n = sums.num_tokens
    out = {"mismatch/kl_k1": sums.k1 / max(n, 1.0), "mismatch/kl_k3": sums.k3 / max(n, 1.0)}
    if spec.is_level is not None:
        units = sums.num_rows if spec.is_level == "sequence" else n  # what the above/below shares count
        out["is/weight_mean"] = sums.w / max(n, 1.0)
        out["is/truncated_frac"] = sums.above / max(units, 1.0)
        out["is/below_frac"] = sums.below / max(units, 1.0)
        # ESS / n = (sum w)^2 / (n sum w^2) = 1 / mean((w / mean w)^2): 1 when all weights are equal; 0 when all are 0
        out["is/ess"] = sums.w**2 / (n * sums.w2) if sums.w2 > 0 else 0.0
        if spec.is_lower is not None:
            out["is/masked_frac"] = sums.outside / max(n, 1.0)
        if values_N is not None and values_N.numel():
            for q, v in zip(PERCENTILES, percentiles(values_N, tuple(p / 100 for p in PERCENTILES))):
                out[f"is/p{q}"] = v
            out["is/max"] = float(values_N.max())
        if spec.batch_normalize:
            out["is/batch_norm_factor"] = batch_norm_factor(sums, spec)
    if spec.rs:
        out["rs/masked_frac"] = sums.rejected_tokens / max(n, 1.0)
        out["rs/seq_masked_frac"] = sums.rejected_rows / max(sums.num_rows, 1.0)
    return out
