"""The stability guard: watches every step's metrics and acts before one bad update flips the policy.

The trainer's controller (trainer/service.py) hands each step's metrics row to `StabilityGuard.observe`, which
judges five rules against `GuardConfig` thresholds (defaults from healthy quickstart runs: docs/debugging.md, "The stability guard"):

    entropy_collapse  window mean of actor/entropy < entropy_min while the window mean of reward/mean has never yet
                      reached converged_reward (a near-deterministic policy is healthy only once it is right: the
                      quickstart's entropy falls to ~0.003 when its reward is ~1.0; a fall after convergence is
                      reward_drop's, and low-entropy dips after it fired this rule on 2 of 20 healthy runs)
    mismatch_kl       mismatch/kl_k3 (KL of the behaviour policy to the proximal one) > max_mismatch_kl
    grad_spike        actor/grad_norm > grad_spike_factor x the median of recent non-zero norms, and > grad_spike_min
    clip_fraction     actor/clipfrac > max_clipfrac
    reward_drop       best window mean of reward/mean so far - the current window mean > reward_drop

and returns what to do (`Verdict`): each fired rule's actions (`guard.actions`, or its own in `guard.rule_actions`):

    warn      a GuardAction event (events.guard, archived in events/guard.jsonl), the live view, `rlbus status`
    tighten   for `tighten_steps` steps: the LR schedule times `tighten_lr_factor` and the staleness bound lowered to
              `tighten_max_staleness` (the feeder's admission and the batcher read `effective_max_staleness`)
    rollback  the trainer restores the newest checkpoint taken before the trouble began (`rollback_before`), re-issues
              the prompts of the steps it drops, and goes on tightened (at most `max_rollbacks` times a run)

The guard's state (`GuardState`: recent metrics, the tighter setting and until when, rollbacks) is saved in every
checkpoint, and every step's row carries the setting it trained under (`guard/lr_scale`, `guard/max_staleness`), so
`rlbus replay` applies the same LR scale the run used (`set_lr_scale`) and reproduces a tightened step bit for bit.
The rules are pure functions of the rows: `pytest tests/unit/test_guard.py`.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import msgspec

from rlbus.schemas.config import GUARD_RULES, GuardConfig, TrainerConfig

#: Rows of history kept for the rules (the reward's best window mean is kept apart, for the whole run).
_HISTORY = 64
#: Non-zero grad norms needed before grad_spike judges (a median of fewer says little).
_MIN_GRAD_NORMS = 5


class Observation(msgspec.Struct, array_like=True):
    """What the rules read of one step's row (NaN where the row had no finite value)."""

    step: int
    reward: float
    entropy: float
    grad_norm: float


class GuardState(msgspec.Struct, kw_only=True):
    """Everything the guard knows; saved with each checkpoint (`extra["guard"]`)."""

    history: list[Observation] = []  # the last _HISTORY steps, oldest first
    best_reward: list[tuple[int, float]] = []  # (step, window mean of reward/mean) at each new best, in step order
    last_fired: dict[str, int] = {}  # rule -> the step it last fired at (cooldown)
    tightened_until: int = 0  # last step trained under the tighter setting (0: none)
    rollbacks: int = 0  # rollbacks done so far this run


class Firing(msgspec.Struct, kw_only=True):
    """One rule that fired on a step."""

    rule: str
    value: float  # what it observed
    threshold: float  # what it compared with
    since: int  # first step of the evidence (the window's first step, or the step itself)
    actions: list[str]

    def describe(self) -> str:
        what = {"entropy_collapse": "entropy (window mean) {v:.4g} < {t:.4g} before the reward converged",
                "mismatch_kl": "mismatch KL (k3) {v:.4g} > {t:.4g}",
                "grad_spike": "grad norm {v:.4g} > {t:.4g} (x the recent median)",
                "clip_fraction": "clip fraction {v:.4g} > {t:.4g}",
                "reward_drop": "reward (window mean) fell {v:.4g} below its best, more than {t:.4g}"}[self.rule]
        return what.format(v=self.value, t=self.threshold)


class Verdict(msgspec.Struct, kw_only=True):
    """What the guard decided after one step."""

    step: int
    fired: list[Firing] = []
    actions: list[str] = []  # union of the fired rules' actions, in warn, tighten, rollback order
    rollback_before: int = 0  # rollback: restore a checkpoint taken at a step < this one (<= 0: none can be)

    @property
    def acted(self) -> bool:
        return bool(self.fired)

    def message(self) -> str:
        return "; ".join(f"{f.rule}: {f.describe()}" for f in self.fired) + f" -> {', '.join(self.actions)}"


def _finite(row: dict[str, Any], key: str) -> float:
    v = row.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else math.nan


def _mean(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return sum(finite) / len(finite) if len(finite) == len(values) and finite else math.nan


class StabilityGuard:
    """The rules, the state they need, and the setting in force. Pure: no I/O, no torch."""

    cfg: GuardConfig
    trainer: TrainerConfig
    state: GuardState

    def __init__(self, cfg: GuardConfig, trainer: TrainerConfig, state: GuardState | None = None):
        self.cfg, self.trainer = cfg, trainer
        self.state = state or GuardState()

    # ------------------------------------------------------------------ the setting in force

    def tightened(self, step: int) -> bool:
        """Whether step `step` trains under the tighter setting."""
        return self.cfg.enabled and step <= self.state.tightened_until

    def lr_scale(self, step: int) -> float:
        """The multiplier of the LR schedule for step `step` (1.0 unless tightened)."""
        return self.cfg.tighten_lr_factor if self.tightened(step) else 1.0

    def effective_max_staleness(self, step: int) -> int:
        """The staleness bound while training step `step`: the configured one, or the tighter one, never higher and
        never below what `weight_sync_interval` needs under the drop policy (else every group would be dropped)."""
        bound = self.trainer.max_staleness
        if self.tightened(step) and self.cfg.tighten_max_staleness >= 0:
            floor = self.trainer.weight_sync_interval - 1 if self.trainer.staleness_policy == "drop" else 0
            bound = max(min(bound, self.cfg.tighten_max_staleness), floor)
        return bound

    def setting_metrics(self, step: int) -> dict[str, float]:
        """The guard/* keys every step's row carries: the setting that step trained under."""
        return {"guard/lr_scale": self.lr_scale(step), "guard/max_staleness": float(self.effective_max_staleness(step)),
                "guard/tightened": float(self.tightened(step)), "guard/rollbacks": float(self.state.rollbacks)}

    # ------------------------------------------------------------------ judging a step

    def observe(self, step: int, row: dict[str, Any]) -> Verdict:
        """Record step `step`'s metrics row, judge every rule, and apply the tighten part of the verdict (the caller
        carries out warn and rollback). A disabled guard records nothing and never fires."""
        if not self.cfg.enabled:
            return Verdict(step=step)
        s = self.state
        obs = Observation(step=step, reward=_finite(row, "reward/mean"), entropy=_finite(row, "actor/entropy"),
                          grad_norm=_finite(row, "actor/grad_norm"))
        previous = list(s.history)  # the spike is judged against the norms before this one
        s.history = (s.history + [obs])[-_HISTORY:]
        w = self.cfg.window
        recent = s.history[-w:]
        reward_mean = _mean([o.reward for o in recent]) if len(recent) == w else math.nan
        if not math.isnan(reward_mean) and (not s.best_reward or reward_mean > s.best_reward[-1][1]):
            s.best_reward.append((step, reward_mean))

        fired = [f for f in (self._entropy_collapse(recent, reward_mean), self._mismatch_kl(step, row),
                             self._grad_spike(obs, previous), self._clip_fraction(step, row),
                             self._reward_drop(recent, reward_mean)) if f is not None]
        fired = [f for f in fired if step - s.last_fired.get(f.rule, -10**9) > self.cfg.cooldown_steps]
        verdict = Verdict(step=step, fired=fired)
        if not fired:
            return verdict
        for f in fired:
            s.last_fired[f.rule] = step
        wanted = {a for f in fired for a in f.actions}
        if "rollback" in wanted and s.rollbacks >= self.cfg.max_rollbacks:
            wanted = (wanted - {"rollback"}) | {"warn", "tighten"}  # out of rollbacks: the next best thing
        if "rollback" in wanted:
            wanted.add("tighten")  # a rollback goes on with the tighter setting
            # The evidence's first step trained on rollouts of weights up to max_staleness versions older than it:
            # the checkpoint to restore must predate those too.
            since = min(f.since for f in fired if "rollback" in f.actions)
            verdict.rollback_before = since - self.trainer.max_staleness
        verdict.actions = [a for a in ("warn", "tighten", "rollback") if a in wanted]
        if "tighten" in wanted:
            s.tightened_until = max(s.tightened_until, step + self.cfg.tighten_steps)
        return verdict

    def _entropy_collapse(self, recent: list[Observation], reward_mean: float) -> Firing | None:
        if self.cfg.entropy_min <= 0 or len(recent) < self.cfg.window or math.isnan(reward_mean):
            return None
        if self.state.best_reward and self.state.best_reward[-1][1] >= self.cfg.converged_reward:
            return None  # converged once: a later fall with low entropy is reward_drop's (a dip is no early collapse)
        entropy = _mean([o.entropy for o in recent])
        if math.isnan(entropy) or entropy >= self.cfg.entropy_min or reward_mean >= self.cfg.converged_reward:
            return None
        return self._firing("entropy_collapse", entropy, self.cfg.entropy_min, recent[0].step)

    def _mismatch_kl(self, step: int, row: dict[str, Any]) -> Firing | None:
        kl = _finite(row, "mismatch/kl_k3")
        if math.isnan(kl) or kl <= self.cfg.max_mismatch_kl:
            return None
        return self._firing("mismatch_kl", kl, self.cfg.max_mismatch_kl, step)

    def _grad_spike(self, obs: Observation, previous: list[Observation]) -> Firing | None:
        norms = [o.grad_norm for o in previous if not math.isnan(o.grad_norm) and o.grad_norm > 0]
        norms = norms[-self.cfg.grad_norm_window:]
        if math.isnan(obs.grad_norm) or len(norms) < _MIN_GRAD_NORMS:
            return None
        bound = max(self.cfg.grad_spike_factor * statistics.median(norms), self.cfg.grad_spike_min)
        if obs.grad_norm <= bound:
            return None
        return self._firing("grad_spike", obs.grad_norm, bound, obs.step)

    def _clip_fraction(self, step: int, row: dict[str, Any]) -> Firing | None:
        clip = _finite(row, "actor/clipfrac")
        if math.isnan(clip) or clip <= self.cfg.max_clipfrac:
            return None
        return self._firing("clip_fraction", clip, self.cfg.max_clipfrac, step)

    def _reward_drop(self, recent: list[Observation], reward_mean: float) -> Firing | None:
        if math.isnan(reward_mean) or not self.state.best_reward:
            return None
        drop = self.state.best_reward[-1][1] - reward_mean
        if drop <= self.cfg.reward_drop:
            return None
        return self._firing("reward_drop", drop, self.cfg.reward_drop, recent[0].step)

    def _firing(self, rule: str, value: float, threshold: float, since: int) -> Firing:
        return Firing(rule=rule, value=value, threshold=threshold, since=since, actions=self.cfg.actions_of(rule))

    # ------------------------------------------------------------------ rollback and persistence

    def rolled_back(self, to_step: int) -> None:
        """The trainer went back to checkpoint `to_step`: forget what the dropped steps showed (their rows and
        bests), count the rollback. The tighter setting stays: `tighten_steps` from the step the trainer resumes at."""
        s = self.state
        s.history = [o for o in s.history if o.step <= to_step]
        s.best_reward = [b for b in s.best_reward if b[0] <= to_step]
        s.last_fired = {r: min(st, to_step) for r, st in s.last_fired.items()}
        s.rollbacks += 1
        s.tightened_until = to_step + self.cfg.tighten_steps

    def state_dict(self) -> dict:
        return msgspec.to_builtins(self.state)

    def load_state_dict(self, d: dict) -> None:
        self.state = msgspec.convert(d, GuardState)


def rollback_checkpoint(checkpoint_steps: list[int], before: int) -> int | None:
    """The newest checkpoint step < `before` (the trouble's first step), or None when none is kept."""
    return max((s for s in checkpoint_steps if s < before), default=None)


# ---------------------------------------------------------------------------------------------------------------
# the LR scale, on the engine's scheduler (every rank, and `rlbus replay`)


def install_lr_scale(engine: Any) -> None:
    """Make the engine's LambdaLR multiply its schedule by a scale the engine holds (`set_lr_scale`).

    The scale lives on the engine, not on the scheduler: LambdaLR's state_dict saves every attribute of the scheduler
    (a checkpoint would carry it, and a restore would replace it under the lambdas). The wrapped lambdas are plain
    functions, which the state_dict leaves out as it did the originals, so checkpoints are unchanged. With the scale
    at 1.0 every LR is the schedule's own float (x * 1.0 == x).
    """
    if getattr(engine, "_guard_lr_scale", None) is not None:
        return
    sched = engine.scheduler
    if not hasattr(sched, "lr_lambdas"):
        raise TypeError(f"the stability guard scales a LambdaLR schedule, not a {type(sched).__name__}")
    box = [1.0]
    sched.lr_lambdas = [(lambda u, f=f: f(u) * box[0]) for f in sched.lr_lambdas]
    engine._guard_lr_scale = box


def set_lr_scale(engine: Any, scale: float) -> None:
    """Train the next updates at `scale` x the schedule, from the schedule's current position."""
    install_lr_scale(engine)
    engine._guard_lr_scale[0] = float(scale)
    sched = engine.scheduler
    for group, base, fn in zip(engine.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas, strict=True):
        group["lr"] = base * fn(sched.last_epoch)  # LambdaLR.get_lr's own expression


__all__ = ["GUARD_RULES", "Firing", "GuardState", "Observation", "StabilityGuard", "Verdict", "install_lr_scale",
           "rollback_checkpoint", "set_lr_scale"]
