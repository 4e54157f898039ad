"""Off-policy correction: which log-probs play "old" in the PPO ratio, and whether the proximal pass is needed.

Three log-probs exist per response token:
    mu    behaviour: what the rollout engine sampled with (maybe several versions behind; `rollout_log_probs`)
    prox  proximal:  recomputed with the trainer's current weights once per step, before the first update
    pi    current:   recomputed inside every micro-batch, with grad

Modes (AlgorithmConfig.off_policy):
    decoupled  ratio pi / prox (trust region around the proximal policy) and an importance weight between prox and
               mu that corrects for sampling from mu (decoupled PPO, Hilton et al. 2022; AReaL): by default the
               per-token w = min(exp(prox - mu), C) (truncated IS, C = is_cap); `rollout_is` chooses another
    bypass     ratio pi / mu, no weight: skips the recomputation (cheap; exact only when rollouts are on-policy)
    none       ratio pi / prox, no weight: standard PPO that ignores the rollout/trainer mismatch

The weights, the rejection of tokens or sequences (`rollout_rs`, any mode) and the mismatch metrics are in
`rollout_correction.py`. Tested by `pytest tests/unit/test_algorithms.py`.
"""

from __future__ import annotations

from typing import Literal

import torch

OffPolicyMode = Literal["decoupled", "bypass", "none"]


def needs_proximal(mode: OffPolicyMode) -> bool:
    """Whether the mode needs log-probs recomputed with the current weights before the first update."""
    return mode in ("decoupled", "none")


def old_log_probs_for(
    mode: OffPolicyMode, behaviour_log_probs_BT: torch.Tensor, proximal_log_probs_BT: torch.Tensor | None
) -> torch.Tensor:
    """The log-probs the PPO ratio is taken against: mu for bypass, prox otherwise."""
    if mode == "bypass":
        return behaviour_log_probs_BT
    if proximal_log_probs_BT is None:
        raise ValueError(f"off_policy: mode {mode!r} needs proximal log-probs recomputed with the current weights")
    return proximal_log_probs_BT
