"""The workloads bench/agentic.py measures, and its arms: what each run's config and environment are.

A workload is the quickstart's task and model with one remote service's latency (bench/agentic_tools.py):

    b1  a slow tool: the calculator behind the lognormal wait (RLBUS_TOOL_*)
    b2  a judge with few slots: the reward scored after the judge's wait, at most RLBUS_JUDGE_SLOTS calls at once
        per producer (RLBUS_JUDGE_*)
    b3  a straggling environment: the question as a Gym-style environment whose steps wait (RLBUS_ENV_*); a share
        of them straggles, a share hangs until rollout.episode_timeout_s (60 s here) gives the task back; every
        arm starts 2 redundant episodes a group (rollout.redundant_samples=2: a group is its first n to finish)

The arms: `nolat` is the same task without the latency (b1: the built-in calculator; b2, b3: the same judge or
environment with a median of 0 and no stragglers or hangs), `async` is rlbus's defaults with the latency, `sync`
the latency with one step's groups in flight on the current weights, each its own `rlbus up`; `trl` is TRL's
GRPOTrainer with the latency (bench/agentic_trl.py, in the TRL venv). The median comes from bench/agentic.py's
--medians; a workload's other latency settings (`shape`) are its defaults here, and a variable already set in the
caller's environment wins (`RLBUS_JUDGE_SLOTS=2 python bench/agentic.py --workload b2`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from rlbus.common.model.demos import QUICKSTART_SYSTEM_PROMPT

RESULTS_DIR = Path(__file__).resolve().parent / "results"
#: Every rlbus arm sizes its tasks in flight from the engine's idle time (the quickstart config pins 1, as its
#: published figures were measured); `sync` also holds the staleness bound at 0. `trl` is TRL's GRPOTrainer
#: (bench/agentic_trl.py, b1 and b3), no rlbus run: the workload's config, resolved, gives it the task's settings.
ARMS: dict[str, tuple[str, ...]] = {
    "nolat": ("rollout.max_inflight_tasks=0",),
    "async": ("rollout.max_inflight_tasks=0",),
    "sync": ("rollout.max_inflight_tasks=0", "trainer.max_staleness=0", "trainer.max_staleness_for_latency=0"),
    "trl": (),
}
RLBUS_ARMS = ("nolat", "async", "sync")
SIGMA, CAP_S = 1.0, 8.0


@dataclass(frozen=True)
class Workload:
    name: str  # b1, b2, b3: --workload
    heading: str  # its section of docs/benchmarks.md
    results: Path  # its results file unless --results says otherwise
    prefix: str  # its latency's variables: RLBUS_<prefix>_MEDIAN_S, _SIGMA, _CAP_S, _SEED
    waits: str  # what waits, for the tables' "<waits> median" column
    what: str  # what the runs are, for the report and the docs
    default_median: float  # seconds, when --medians is not given
    task: tuple[str, ...] = ()  # overrides of every arm: the workload's task ("{seed}": the run's seed)
    slow: tuple[str, ...] = ()  # overrides of the arms with the latency only
    shape: Mapping[str, str] = field(default_factory=dict)  # the latency's other variables, their defaults
    quiet: Mapping[str, str] = field(default_factory=dict)  # what `nolat` sets of them instead
    failures: bool = False  # the tables show the failed rollouts (given back, retried) and the ledger's problems

    def overrides(self, arm: str, seed: int, extra: tuple[str, ...] | list[str] = ()) -> list[str]:
        """An arm's config overrides: the task (its `{seed}` filled in), the caller's `extra`, then the arm's own
        (the last one wins)."""
        task = [t.replace("{seed}", str(seed)) for t in self.task]
        return [*task, *extra, *(self.slow if arm != "nolat" else ()), *ARMS[arm]]

    def shape_in(self, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
        """The latency's other variables as a run gets them: the caller's environment, else the defaults."""
        return {k: environ.get(k, v) for k, v in self.shape.items()}

    def described(self, shape: Mapping[str, str]) -> str:
        """`what`, with the shape the runs had."""
        return self.what.format(**shape)

    def latency_env(self, arm: str, median: float, seed: int, environ: Mapping[str, str] = os.environ
                    ) -> dict[str, str]:
        """The variables that set an arm's latency: the median and seed of the run, the shape (the caller's
        `environ` wins), and no latency at all for `nolat`."""
        p = f"RLBUS_{self.prefix}"
        out = self.shape_in(environ)
        out.update({f"{p}_MEDIAN_S": str(0.0 if arm == "nolat" else median), f"{p}_SIGMA": str(SIGMA),
                    f"{p}_CAP_S": str(CAP_S), f"{p}_SEED": str(seed)})
        if arm == "nolat":
            out.update(self.quiet)
        return out


WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload(
        "b1", "## Agentic: a slow tool", RESULTS_DIR / "agentic.json", "TOOL", "tool",
        "The quickstart's task and model; the calculator behind a lognormal latency (sigma 1, capped at 8 s)",
        default_median=1.0, slow=("rollout.tools=[bench.agentic_tools:RemoteCalculator]",)),
    Workload(
        "b2", "## Agentic: a judge with few slots", RESULTS_DIR / "agentic_b2.json", "JUDGE", "judge",
        "The quickstart's task and model; its reward from a remote judge (the math reward's score after a "
        "lognormal latency, sigma 1, capped at 8 s) that takes {RLBUS_JUDGE_SLOTS} calls at once per producer; the "
        "calculator instant",
        default_median=1.0, task=("rollout.reward=bench.agentic_tools:slow_judge",),
        shape={"RLBUS_JUDGE_SLOTS": "4"}),
    Workload(
        "b3", "## Agentic: a straggling environment", RESULTS_DIR / "agentic_b3.json", "ENV", "env step",
        "The quickstart's question and model as a Gym-style environment (its step is the calculator, or scores the "
        "answer) whose steps wait a lognormal latency (sigma 1, capped at 8 s); a share {RLBUS_ENV_STRAGGLE} of "
        "steps straggles for {RLBUS_ENV_STRAGGLE_S} s, a share {RLBUS_ENV_HANG} hangs until the episode timeout (60 s); "
        "each group starts 2 redundant episodes and keeps the first n to finish",
        default_median=0.2,
        task=("env.type=gym", "env.make=bench.agentic_tools:make_straggler_env", "env.seed={seed}",
              f"env.system_prompt={QUICKSTART_SYSTEM_PROMPT}", "rollout.tools=[]", "rollout.episode_timeout_s=60",
              "rollout.redundant_samples=2"),
        shape={"RLBUS_ENV_STRAGGLE": "0.02", "RLBUS_ENV_STRAGGLE_S": "30", "RLBUS_ENV_HANG": "0.005"},
        quiet={"RLBUS_ENV_STRAGGLE": "0", "RLBUS_ENV_HANG": "0"}, failures=True),
)}

