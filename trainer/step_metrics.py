"""A train step's metrics, gathered over micro-batches, updates and ranks.

`_Accumulator` sums (value, weight) pairs per metric over a step and all-reduces them once at its end;
`correction_metrics` turns the rollout correction's sums (and its IS weights, for percentiles) into the step's
mismatch/*, is/* and rs/* metrics over all ranks. `TrainEngine.train_step` (trainer/engine.py) and the critic
(trainer/critic.py) add to one accumulator. Both end in collectives: every rank must call `_Accumulator.reduce` and
`correction_metrics` together. Tests: `pytest tests/integration/test_fsdp.py`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from rlbus.trainer import algorithms as algo
from rlbus.trainer.dist import all_reduce, world_size


def correction_metrics(
    sums: algo.MismatchSums, values_N: torch.Tensor | None, spec: algo.CorrectionSpec
) -> dict[str, float]:
    """mismatch/*, is/*, rs/* of the step: sums over all ranks, percentiles of every rank's weights."""
    total = algo.MismatchSums.from_list(all_reduce(sums.as_list(), "sum"))
    if values_N is not None and world_size() > 1:
        # Percentiles do not add up: gather the weights (one float per token, or per sequence at sequence
        # level), padded with NaN to the longest rank's count, the padding dropped after.
        (longest,) = all_reduce([float(values_N.numel())], "max")
        padded_N = values_N.new_full((int(longest),), float("nan"))
        padded_N[: values_N.numel()] = values_N
        parts = [torch.empty_like(padded_N) for _ in range(world_size())]
        dist.all_gather(parts, padded_N)
        values_N = torch.cat(parts)
        values_N = values_N[~values_N.isnan()]
    return algo.mismatch_metrics(total, spec, values_N=values_N)


#: Per-update counts, summed over a step's updates rather than averaged.
COUNTED = ("/skipped_updates", "/zero_grad_updates")


class _Accumulator:
    """Sums (value, weight) pairs per metric over a step, then all-reduces them once: sum(value) / sum(weight)."""

    def __init__(self) -> None:
        self.sums: dict[str, list[float]] = {}
        self.global_names: set[str] = set()

    def add(self, name: str, value: float, weight: float) -> None:
        s = self.sums.setdefault(name, [0.0, 0.0])
        s[0] += value
        s[1] += weight

    def add_update(self, prefix: str, grad_norm: float, lr: float, stepped: bool = True) -> None:
        """An optimizer update's grad norm and LR, and whether it stepped (`clipped_step`'s three); counts the updates
        skipped: for a NaN/inf norm (`skipped_updates`), and otherwise for a norm of exactly zero
        (`zero_grad_updates`, trainer.skip_zero_grad_updates)."""
        self.add_global(f"{prefix}/grad_norm", grad_norm)
        self.add_global(f"{prefix}/lr", lr)
        if not math.isfinite(grad_norm):
            self.add_global(f"{prefix}/skipped_updates", 1.0)
        elif not stepped:
            self.add_global(f"{prefix}/zero_grad_updates", 1.0)

    def add_global(self, name: str, value: float) -> None:
        """A value that is already identical on every rank (grad norm, LR): averaged over updates, not ranks."""
        self.global_names.add(name)
        self.add(name, value, 1.0)

    def reduce(self, *, num_updates: int) -> dict[str, float]:
        names = sorted(self.sums)
        flat = [x for n in names for x in self.sums[n]]
        total = all_reduce(flat, "sum")
        world = all_reduce([1.0], "sum")[0]
        out: dict[str, float] = {}
        for i, n in enumerate(names):
            value, weight = total[2 * i], total[2 * i + 1]
            if n in self.global_names:
                value, weight = value / world, weight / world
                out[n] = value if n.endswith(COUNTED) else value / max(weight, 1.0)
            elif n in ("actor/pg_loss", "critic/vf_loss"):  # summed over ranks = each update's whole-batch loss;
                # the mean over updates
                out[n] = value / num_updates
            elif weight == 0.0:  # a plain total (token counts)
                out[n] = value
            else:
                out[n] = value / weight
        return out
