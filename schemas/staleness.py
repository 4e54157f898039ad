"""Staleness and admission: the one place that says how far behind the trainer a rollout may be.

Invariant 2 of docs/architecture.md. The policy version is the number of completed trainer steps; every generated
token records the version of the weights that produced it (-1 for tokens the policy did not generate). Three roles
ask the same questions and all ask them here:

- the feeder (trainer rank 0), before releasing a prompt: `allowance(...)`, AReaL's admission rule
      released - abandoned <= (version + max_staleness + 1) * groups_per_step
- a producer, after rolling out a group: `too_stale(...)` (give the task back rather than publish a group the
  trainer will drop);
- the batcher, when a group arrives: `rolled_back(...)` and `too_stale(...)`, and the trainer's metrics:
  `lag(...)` per sample and `histogram(...)`.

A sample with no generated token (an empty response) carries no version: it says nothing about staleness and is
left out of every judgement (its SampleMeta versions are NO_VERSION). Pure functions, no I/O; part of the contract
(schemas/), so the wire types, the feeder, producers and the batcher all read the same rule.

    .venv/bin/python -m pytest -q tests/unit/test_staleness.py
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlbus.schemas.config import TrainerConfig

#: Why a release was lost, when staleness lost it (the batcher's words, the feeder's record): a group too stale to
#: train, or one made by weights a restarted trainer lost. Such losses say nothing about the example, so they count
#: against `feeder.max_stale_releases`, not `feeder.max_attempts`.
LOST_TOO_STALE = "too stale"
LOST_ROLLED_BACK = "made by weights a restarted trainer lost"
STALENESS_LOSSES = frozenset({LOST_TOO_STALE, LOST_ROLLED_BACK})

#: The version of a token the policy did not generate, and of a sample (or group) with no generated token.
NO_VERSION = -1


def generated_span(versions: Sequence[int], mask: Sequence[int]) -> tuple[int, int]:
    """(oldest, newest) version among the generated (mask 1) tokens; (NO_VERSION, NO_VERSION) if there are none."""
    generated = [v for v, m in zip(versions, mask) if m]
    if not generated:
        return NO_VERSION, NO_VERSION
    return min(generated), max(generated)


def oldest(versions: Iterable[int]) -> int:
    """The oldest of per-sample oldest versions, samples without a version left out (NO_VERSION if none has one)."""
    return min((v for v in versions if v != NO_VERSION), default=NO_VERSION)


def newest(versions: Iterable[int]) -> int:
    """The newest of per-sample newest versions (NO_VERSION if no sample has one)."""
    return max((v for v in versions if v != NO_VERSION), default=NO_VERSION)


def lag(version: int, oldest_version: int) -> int | None:
    """How many versions `oldest_version` trails the trainer's `version`; None when there is no version."""
    return None if oldest_version == NO_VERSION else version - oldest_version


def too_stale(version: int, oldest_version: int, cfg: TrainerConfig, max_staleness: int | None = None) -> bool:
    """Whether a group whose oldest token is `oldest_version` is dropped at trainer version `version`.

    Only under `staleness_policy: drop` (`correct` keeps every group for the importance weights). A group with no
    generated token is never too stale. `max_staleness: 0` admits only tokens of the current version.
    `max_staleness`, when given, is the bound in force instead of the configured one (the trainer's stability guard
    lowers it for a while: trainer/guard.py).
    """
    if cfg.staleness_policy != "drop":
        return False
    behind = lag(version, oldest_version)
    bound = cfg.max_staleness if max_staleness is None else max_staleness
    return behind is not None and behind > bound


def rolled_back(version: int, newest_version: int) -> bool:
    """Whether a group holds tokens of a version the trainer has not reached: weights of steps a restarted trainer
    lost (it resumed from an older checkpoint). No version of the live timeline produced them."""
    return newest_version > version


def allowance(version: int, released: int, abandoned: int, cfg: TrainerConfig, max_staleness: int | None = None) -> int:
    """How many more prompt tasks the feeder may release at trainer version `version` (<= 0: none).

    `abandoned` counts releases that will never become a trained group (dropped stale, skipped, payload lost,
    rolled back, dead-lettered), so they do not hold admission slots. `max_staleness`, when given, is the bound in
    force instead of the configured one (as in `too_stale`).
    """
    bound = cfg.max_staleness if max_staleness is None else max_staleness
    return (version + bound + 1) * cfg.groups_per_step - (released - abandoned)


def histogram(lags: Iterable[int]) -> dict[int, int]:
    """Samples per version lag, every bucket from 0 to the largest lag present (empty buckets are 0)."""
    counts = Counter(lags)
    return {k: counts.get(k, 0) for k in range(max(counts, default=-1) + 1)}


#: Groups and steps the lag sizer remembers (its measurements are of the recent past).
LAG_WINDOW = 32
#: The share of the KL budget (guard.max_mismatch_kl) above which a latency lag steps down instead of up: the lag
#: settles where its tokens' mismatch stays under half of what the guard would act on.
KL_BACKOFF = 0.5


class LagSizer:
    """The staleness bound that hides the latency episodes wait on, between `max_staleness` and
    `max_staleness_for_latency`.

    Hiding a wait of L seconds at a step time of T seconds takes about L / T steps of lag: while an episode waits on a
    tool, an environment or a judge, the trainer goes on, and the tokens the episode generated before the wait age
    by a version a step. Under a fixed bound of max_staleness those episodes would be restarted (partial rollout) or
    dropped, and admission would hold back the very tasks that fill the wait, so the trainer would wait instead.
    The bound in force is therefore

        clamp(1 + ceil(p90 of a group's wait / median step time), max_staleness, max_staleness_for_latency)

    reached one step at a time (it rises by at most one a step, and falls at once), where a group's wait is its
    slowest sample's time outside generation (tool calls and scoring: a group is done when
    its last episode is) and a step's time is the trainer's own work, not its wait for data (otherwise a trainer
    starved by a tight bound would measure long steps and never loosen it). A run whose episodes do not wait
    (the quickstart's calculator answers in microseconds) keeps max_staleness. Tokens generated after a wait are on
    fresh weights (each turn is a new engine call, and producers load new weights between calls), so only the
    tokens before it are old, and the decoupled PPO objective (proximal log-probs recomputed by the trainer,
    truncated importance weights) corrects for them, as far as their policy is close to the proximal one: while the
    step's mismatch KL is over half the guard's `max_mismatch_kl` the bound steps down instead of up, so it settles
    where the correction holds rather than climbing into the guard. The guard's tightening, if it still comes, holds
    the bound down (`hold`), and it climbs back from there.
    Pure: the trainer feeds it measurements and reads `bound()`.
    """

    floor: int
    ceiling: int
    _waits: list[float]
    _steps: list[float]
    _bound: int  # the bound in force

    def __init__(self, floor: int, ceiling: int, *, kl_budget: float = math.inf):
        self.floor, self.ceiling = floor, max(floor, ceiling)
        self.kl_budget = kl_budget
        self._waits, self._steps = [], []
        self._bound = floor

    def group(self, wait_s: float) -> None:
        """A group arrived whose slowest sample spent `wait_s` seconds outside generation."""
        self._waits = (self._waits + [wait_s])[-LAG_WINDOW:]

    def step(self, work_s: float, mismatch_kl: float = math.nan) -> None:
        """The trainer's own work on a step took `work_s` seconds, and its tokens' behaviour policy was
        `mismatch_kl` (KL, k3) from the proximal one. The bound moves towards what the waits need, up by at most one
        a step (a policy that moves fast early in a run meets old tokens gradually, not all at once: a jump from 2
        to 16 between two steps would hand the trainer groups 14 versions older than any it had corrected for), down
        at once; and while the mismatch is over half of `kl_budget` (the guard's `max_mismatch_kl`) it steps down by
        one instead of up: lag past what the off-policy correction handles costs more than the wait it hides."""
        self._steps = (self._steps + [work_s])[-LAG_WINDOW:]
        move = -1 if mismatch_kl > KL_BACKOFF * self.kl_budget else 1
        self._bound = max(self.floor, min(self.need(), self._bound + move))

    def hold(self, bound: int) -> None:
        """Something else (the stability guard's tightening) holds the bound at `bound` for now: when it lets go, the
        bound climbs back from there, one a step, as from any lower bound."""
        self._bound = min(self._bound, bound)

    def need(self) -> int:
        """The bound the measured waits call for, within [floor, ceiling]."""
        if self.ceiling == self.floor or not self._waits or not self._steps:
            return self.floor
        waits, steps = sorted(self._waits), sorted(self._steps)
        p90 = waits[min(len(waits) - 1, int(0.9 * len(waits)))]
        step_s = max(steps[len(steps) // 2], 1e-3)
        return max(self.floor, min(self.ceiling, 1 + math.ceil(p90 / step_s)))

    def bound(self) -> int:
        return self._bound
