"""The Tinker API's built-in losses, as its documentation defines them: sums over tokens, never means.

Every datum carries `target_tokens` (what position i of `model_input` predicts) and per-token inputs; the model
gives `target_logprobs` p (log-probs of the targets, [B, T], padded rows masked out). With q the sampler's log-probs
(`logprobs` input), A the advantages and w the weights:

    cross_entropy         L = -sum w p
    importance_sampling   L = -sum exp(p - q) A
    ppo                   L = -sum min(exp(p - q) A, clip(exp(p - q), lo, hi) A)       lo, hi: clip_*_threshold
    cispo                 L = -sum sg[clip(exp(p - q), lo, hi)] p A

The three policy losses are rlbus's own (trainer/algorithms/policy_loss.py, verl's numerics): `ppo_clip_loss` with
the dual clip switched off is Tinker's PPO, and with unbounded clips its importance-sampling REINFORCE; `cispo_loss`
is CISPO. Aggregated as `seq-mean-token-sum` over a normaliser of one sequence, each is the plain token sum. Both
clamp log(p / q) to +-20 before the exponential (verl's guard), which Tinker's formulas do not write; it changes
nothing short of a ratio of e^20. `clip_low_threshold` / `clip_high_threshold` (loss_fn_config) default to 0.8 / 1.2,
Tinker's epsilon of 0.2.

Outputs per datum: `logprobs` (p, one per token), as the SDK documents for all four; `forward_backward_custom`
(client-side in the SDK) needs exactly that: a `forward` with cross_entropy, then a `forward_backward` with
cross_entropy whose weights are -dC/dp, whose gradient is then that of the user's loss C.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from rlbus.tinker_api.proto import Datum
from rlbus.tinker_api.wire import BadRequest
from rlbus.trainer.algorithms.policy_loss import LossNormaliser, cispo_loss, ppo_clip_loss

#: loss_fn -> the per-token inputs it reads besides target_tokens (a missing `weights` counts as all ones)
INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("weights",),
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
    "cispo": ("logprobs", "advantages"),
}
DEFAULT_CLIP = (0.8, 1.2)  # (clip_low_threshold, clip_high_threshold): a ratio outside is clipped
_SUM = LossNormaliser(num_tokens=1.0, num_seqs=1.0)  # seq-mean-token-sum over "one sequence": the token sum


@dataclass
class Batch:
    """A request's data as padded tensors: row i holds datum i's N_i positions, then padding (mask 0)."""

    input_ids_BT: torch.Tensor  # int64
    attention_mask_BT: torch.Tensor  # int64, 1 on real positions
    targets_BT: torch.Tensor  # int64, target_tokens (0 on padding)
    inputs: dict[str, torch.Tensor]  # float32 [B, T] per loss input (0 on padding)
    lengths: list[int]  # N_i


def _per_token(datum: Datum, name: str, n: int, i: int) -> np.ndarray:
    arr = datum.inputs[name].reshape(-1)
    if arr.shape[0] != n:
        raise BadRequest(f"data[{i}].loss_fn_inputs[{name!r}]: {arr.shape[0]} values for {n} tokens of model_input")
    return arr


def make_batch(data: list[Datum], loss_fn: str, vocab_size: int) -> Batch:
    """The padded batch of `data` for `loss_fn`; a BadRequest names a missing or misshapen input."""
    if loss_fn not in INPUTS:
        raise BadRequest(f"loss_fn {loss_fn!r} is not served here; served: {', '.join(INPUTS)}")
    if not data:
        raise BadRequest("data: no datum given")
    lengths = [len(d.tokens) for d in data]
    if min(lengths) == 0:
        raise BadRequest(f"data[{lengths.index(0)}].model_input: empty")
    B, T = len(data), max(lengths)
    ids, targets = torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.long)
    inputs = {name: torch.zeros(B, T) for name in INPUTS[loss_fn]}
    for i, (d, n) in enumerate(zip(data, lengths)):
        if "target_tokens" not in d.inputs:
            raise BadRequest(f"data[{i}].loss_fn_inputs: target_tokens is required by {loss_fn}")
        tgt = _per_token(d, "target_tokens", n, i).astype(np.int64)
        if (tgt < 0).any() or (tgt >= vocab_size).any():
            raise BadRequest(f"data[{i}].loss_fn_inputs['target_tokens']: ids must be in [0, {vocab_size})")
        if min(d.tokens) < 0 or max(d.tokens) >= vocab_size:
            raise BadRequest(f"data[{i}].model_input: token ids must be in [0, {vocab_size})")
        ids[i, :n] = torch.tensor(d.tokens, dtype=torch.long)
        targets[i, :n] = torch.from_numpy(tgt)
        mask[i, :n] = 1
        for name in INPUTS[loss_fn]:
            if name not in d.inputs:
                if name == "weights":
                    inputs[name][i, :n] = 1.0
                    continue
                raise BadRequest(f"data[{i}].loss_fn_inputs: {name} is required by {loss_fn}")
            inputs[name][i, :n] = torch.from_numpy(_per_token(d, name, n, i).astype(np.float32))
    return Batch(ids, mask, targets, inputs, lengths)


def _clip_range(config: dict[str, float | str]) -> tuple[float, float]:
    lo = float(config.get("clip_low_threshold", DEFAULT_CLIP[0]))
    hi = float(config.get("clip_high_threshold", DEFAULT_CLIP[1]))
    if not 0 <= lo <= 1 <= hi:
        raise BadRequest(f"loss_fn_config: clip_low_threshold {lo} and clip_high_threshold {hi} must satisfy "
                         "0 <= low <= 1 <= high")
    return lo, hi


def check_config(loss_fn: str, config: dict[str, float | str]) -> None:
    """Refuse loss_fn_config keys the loss does not read (a typo would otherwise train with the defaults)."""
    known = {"clip_low_threshold", "clip_high_threshold"} if loss_fn in ("ppo", "cispo") else set()
    unknown = sorted(set(config) - known)
    if unknown:
        raise BadRequest(f"loss_fn_config: {unknown} are not read by {loss_fn} (it reads {sorted(known) or 'none'})")
    if known:
        _clip_range(config)


def loss_sum(loss_fn: str, config: dict[str, float | str], logprobs_BT: torch.Tensor, batch: Batch) -> torch.Tensor:
    """The loss of the batch (a scalar with the graph of `logprobs_BT`): the token sum of `loss_fn`."""
    mask_BT = batch.attention_mask_BT.float()
    if loss_fn == "cross_entropy":
        return -(logprobs_BT * batch.inputs["weights"] * mask_BT).sum()
    q_BT, adv_BT = batch.inputs["logprobs"], batch.inputs["advantages"]
    if loss_fn == "importance_sampling":  # no clip on either side: -exp(p - q) A
        return ppo_clip_loss(logprobs_BT, q_BT, adv_BT, mask_BT, norm=_SUM, agg_mode="seq-mean-token-sum",
                             clip_ratio_low=math.inf, clip_ratio_high=math.inf, clip_ratio_c=math.inf).loss
    lo, hi = _clip_range(config)
    if loss_fn == "ppo":  # Tinker's PPO has no dual clip: its bound at infinity never binds
        return ppo_clip_loss(logprobs_BT, q_BT, adv_BT, mask_BT, norm=_SUM, agg_mode="seq-mean-token-sum",
                             clip_ratio_low=1.0 - lo, clip_ratio_high=hi - 1.0, clip_ratio_c=math.inf).loss
    if loss_fn == "cispo":
        return cispo_loss(logprobs_BT, q_BT, adv_BT, mask_BT, norm=_SUM, agg_mode="seq-mean-token-sum",
                          clip_ratio_low=1.0 - lo, clip_ratio_high=hi - 1.0).loss
    raise BadRequest(f"loss_fn {loss_fn!r} is not served here; served: {', '.join(INPUTS)}")
