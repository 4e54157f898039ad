"""The optimizer side shared by the policy and the critic: AdamW, the LR schedule, gradient clipping under FSDP2.

Tests: `pytest tests/unit/test_optimizer.py tests/unit/test_guard.py`.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from rlbus.schemas.config import TrainerConfig

log = logging.getLogger("rlbus.trainer")


def lr_factor(update: int, *, schedule: str, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the base LR for optimizer update `update` (0-based): linear warmup, then constant or cosine."""
    if update < warmup:
        return (update + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (update - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_scheduler(
    optimizer: torch.optim.Optimizer, cfg: TrainerConfig, *, warmup_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """The LR schedule of `cfg` over optimizer updates: a step makes `mini_batches` of them."""
    total = cfg.total_steps * cfg.mini_batches
    warmup = warmup_steps * cfg.mini_batches
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda u: lr_factor(u, schedule=cfg.lr_schedule, warmup=warmup, total=total, min_ratio=cfg.min_lr_ratio),
    )


def clipped_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, max_norm: float, *, skip_zero: bool = True
) -> tuple[float, float, bool]:
    """One optimizer update of an FSDP2 model: clip its gradients, step AdamW unless their norm is NaN/inf (such a
    gradient would poison the weights and Adam's moments: the update is skipped), step the LR schedule either way.

    With `skip_zero`, an update whose gradient is exactly zero is skipped too: a mini-batch whose groups each scored
    alike has no advantage and so no signal, yet AdamW would still move every weight by its momentum, a step of up
    to the LR per weight. Late in a run, when most groups score alike, such updates come several in a row and moved
    a near-deterministic policy away from what it had learned (docs/benchmarks.md, "updates with no gradient").
    The norm is global (identical on every rank), so every rank skips alike. Returns (the norm before clipping, the
    LR the update used, whether AdamW stepped)."""
    grad_norm = clip_grad_norm(model, max_norm)
    lr = float(optimizer.param_groups[0]["lr"])
    stepped = math.isfinite(grad_norm) and not (skip_zero and grad_norm == 0.0)
    if stepped:
        optimizer.step()
    scheduler.step()
    return grad_norm, lr, stepped


def clip_grad_norm(model: nn.Module | list[nn.Parameter], max_norm: float) -> float:
    """Clip the gradients of an FSDP2 model (or of some of its parameters) to `max_norm` (global over shards);
    returns the norm before clipping."""
    params = [p for p in (model.parameters() if isinstance(model, nn.Module) else model) if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)


def make_optimizer(params: list[nn.Parameter] | list[dict[str, Any]], cfg: TrainerConfig) -> torch.optim.AdamW:
    """AdamW over `params` (or param groups) with the config's hyper-parameters; its fused kernel with
    `trainer.fused_optimizer`.

    The fused kernel does the whole update in one pass per tensor (CPU and CUDA, float parameters, DTensors
    included): 5.9x faster than the foreach one at SmolLM2's size on CPU (bench/bf16.py), equal within float
    rounding (tests/unit/test_optimizer.py). Where this torch refuses it for these parameters, the default kernel
    is used and the log says so.
    """
    kwargs = {"lr": cfg.lr, "betas": tuple(cfg.betas), "weight_decay": cfg.weight_decay}
    if cfg.fused_optimizer:
        try:
            return torch.optim.AdamW(params, fused=True, **kwargs)
        except RuntimeError as e:  # torch's own check: a device or dtype without the fused kernel
            log.warning("trainer.fused_optimizer: torch %s has no fused AdamW for these parameters (%s); using the "
                        "default kernel", torch.__version__, e)  # fmt: skip
    return torch.optim.AdamW(params, **kwargs)


def train_state(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, num_updates: int, *,
                keep: Callable[[str], bool] | None = None) -> dict[str, Any]:
    """Sharded state of one trained FSDP2 model for torch.distributed.checkpoint: weights, AdamW, LR schedule.
    `keep`: only the weights it names (LoRA's adapter: the frozen base is the one the model was built from)."""
    weights = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=keep is not None))
    if keep is not None:  # an output head tied to the frozen embedding escapes ignore_frozen_params
        weights = {k: v for k, v in weights.items() if keep(k)}
    return {
        "model": weights,
        "optim": get_optimizer_state_dict(model, optimizer),
        "scheduler": scheduler.state_dict(),
        "num_updates": num_updates,
    }


def load_train_state(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, state: dict[str, Any], *,
                     partial: bool = False) -> int:
    """Restore what `train_state` saved (`partial`: saved with a `keep`); returns the update count."""
    set_model_state_dict(model, state["model"], options=StateDictOptions(strict=not partial))
    # The saved param groups carry the kernel choice (fused / foreach) of the run that saved them; this run's
    # config decides, so trainer.fused_optimizer takes effect on a resume too. The moments are the same either way.
    kernels = [(g.get("fused"), g.get("foreach")) for g in optimizer.param_groups]
    set_optimizer_state_dict(model, optimizer, state["optim"])
    for group, (fused, foreach) in zip(optimizer.param_groups, kernels):
        group["fused"], group["foreach"] = fused, foreach
    scheduler.load_state_dict(state["scheduler"])
    return int(state["num_updates"])
